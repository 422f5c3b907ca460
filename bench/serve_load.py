"""Load on the OpenAI-compatible server: speculative against autoregressive serving of the same
model, requests arriving as a Poisson process with at most C in flight, C = 1 / 4 / 16 / 32.
Reports requests/s, tokens/s, time to first token (TTFT), per-token latency after the first
(TPOT) and end-to-end latency percentiles, as a table and as JSON (--out).

  python -m bench.serve_load --quick --out /tmp/serve_cpu.json             # CPU, minutes
  python -m bench.serve_load --out serve_smollm2.json                       # SmolLM2, shipped head
  python -m bench.serve_load --random qwen3-8b --dtype bfloat16 --out q8.json  # cost only
  python -m bench.serve_load --soak-minutes 10 --concurrency 32 --out soak.json
  python -m bench.serve_load --quick --kv-block-size 16 --kv-blocks 40   # paged KV caches

Each mode's server runs in a child process on 127.0.0.1 (a free port), so the load generator
does not share its interpreter. --random: random weights of a preset and a random 5-layer,
block-16 head: acceptance is near 1, so this measures costs, not speedups.

Soak (--soak-minutes): the speculative server alone, a mix of greedy and sampled, streamed and
whole requests for that long, with bad requests (each must get a 4xx in the OpenAI error
format) and clients that give up mid-answer mixed in; first each prompt's greedy tokens alone
(concurrency 1), then every greedy response must equal them and every response must be
complete (finish reason, usage equal to the tokens returned, streamed text equal to the whole
text), and after each batch the server must hold no request (slots and queue back to 0). The
server's resident memory is recorded after each batch. Nonzero exit on a lost or corrupt
response, a 5xx, or a request left behind. Rows are written after each (mode, concurrency);
--resume skips the rows the --out file has.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import socket
import sys
import time

from bench.common.results_io import command_line, resume, write_json
from jetspec_jax.options import PREFILL_CHUNK

PROMPTS = (
    "Explain in three sentences why the sky is blue.",
    "Write a short poem about the sea.",
    "List five fruits and one fact about each.",
    "How do I reverse a list in Python? Show an example.",
    "What is 17 times 23? Think step by step.",
    "Summarise the plot of Romeo and Juliet in one paragraph.",
    "Write a Python function that checks whether a number is prime.",
    "Give three tips for learning a new language.",
)
MAX_STARTUP_S = 1800  # loading and compiling, at most


# ---- the server, in a child process ----------------------------------------------------------


def _serve(opts: dict, port: int) -> None:
    from jetspec_jax import api
    from jetspec_jax.serve import app, engine

    api.exact_float32(opts["dtype"])
    if opts["random"]:
        from bench.common.models import random_params
        from jetspec_jax.draft import head as draft_head
        from jetspec_jax.io.tokenizer import Tokenizer
        from jetspec_jax.model import config, params as P

        tcfg = config.preset(opts["random"])
        target = api.Target(tcfg, random_params(P.target_specs(tcfg), opts["dtype"]),
                            Tokenizer.qwen3(), tcfg.name)
        dcfg = draft_head.draft_config_for(tcfg, num_layers=5, block_size=16, num_taps=5)
        draft = api.Draft(dcfg, random_params(draft_head.draft_specs(dcfg), opts["dtype"]))
    else:
        target = api.load_target(opts["model"], dtype=opts["dtype"], progress=False)
        path = opts["draft"] or api.default_draft_path(target.name)
        draft = api.load_draft(path, target)
    if opts["mode"] == "autoregressive":
        draft = None
    config = engine.EngineConfig(max_batch=opts["max_batch"], max_len=opts["max_len"],
                                 budget=opts["budget"], max_queue=opts["max_queue"],
                                 chunk=opts["chunk"] if opts["mode"] == "speculative" else None,
                                 prefill_chunk=opts["prefill_chunk"],
                                 kv_block_size=opts["kv_block_size"],
                                 kv_blocks=opts["kv_blocks"])
    app.serve(engine.Engine(target, draft, config), "bench", "127.0.0.1", port, "warning")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ChildServer:
    def __init__(self, opts: dict):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = multiprocessing.get_context("spawn").Process(
            target=_serve, args=(opts, self.port), daemon=True)

    def __enter__(self):
        import httpx

        self.proc.start()
        deadline = time.monotonic() + MAX_STARTUP_S
        while time.monotonic() < deadline and self.proc.is_alive():
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.__exit__()
        raise RuntimeError(f"the {self.url} server did not start")

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.join(30)


# ---- the load --------------------------------------------------------------------------------


def chat_body(prompt: str, max_tokens: int, **fields) -> dict:
    """A chat completion request of one user turn."""
    return dict(model="bench", messages=[{"role": "user", "content": prompt}],
                max_tokens=max_tokens, **fields)


async def one_request(client, url, prompt, max_tokens, *, stream=True, temperature=0.0,
                      seed=None) -> dict:
    """One chat completion -> its timings, text, token ids and finish reason."""
    body = chat_body(prompt, max_tokens, temperature=temperature, seed=seed, stream=stream,
                     return_token_ids=True)
    start = time.perf_counter()
    first, text, ids, finish, usage = None, [], [], None, None
    if not stream:
        r = await client.post(url + "/v1/chat/completions", json=body)
        data = r.json()
        if r.status_code != 200:
            return dict(status=r.status_code, error=data)
        choice = data["choices"][0]
        return dict(status=200, start=start, first=None, end=time.perf_counter(),
                    text=choice["message"]["content"], ids=choice["token_ids"],
                    finish=choice["finish_reason"], usage=data["usage"])
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return dict(status=r.status_code, error=(await r.aread()).decode())
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                return dict(status=500, error=data)
            usage = data.get("usage") or usage
            for choice in data["choices"]:
                if choice.get("token_ids"):
                    first = first or time.perf_counter()
                    ids += choice["token_ids"]
                text.append(choice["delta"].get("content") or "")
                finish = choice["finish_reason"] or finish
    return dict(status=200, start=start, first=first, end=time.perf_counter(), text="".join(text),
                ids=ids, finish=finish, usage=usage)


BAD_BODIES = (  # each must get a 4xx naming its problem, never a 5xx
    b'{"model": "bench", "messages": [{"role": "user", "content": "hi"}', # truncated JSON
    json.dumps(dict(model="bench", messages=[])).encode(),
    json.dumps(dict(model="bench", messages=[{"role": "user", "content": "hi"}],
                    max_tokens=10**9)).encode(),
    json.dumps(dict(model="bench", messages=[{"role": "user", "content": "hi"}],
                    top_k=10**12)).encode(),
    json.dumps(dict(model="bench", messages=[{"role": "user", "content": "hi"}],
                    temperature="hot")).encode(),
)


async def bad_request(client, url, body: bytes) -> dict:
    r = await client.post(url + "/v1/chat/completions", content=body,
                          headers={"content-type": "application/json"})
    try:
        error = r.json().get("error")
    except ValueError:
        error = None
    return dict(status=r.status_code, error=error, bad=True)


async def given_up_request(client, url, prompt, max_tokens, *, stream: bool) -> dict:
    """A client that gives up: a stream dropped after its first chunk, or a whole answer
    abandoned after 0.3 s; the server must free its row."""
    body = chat_body(prompt, max_tokens, stream=stream)
    try:
        if stream:
            async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
                async for _ in r.aiter_lines():
                    break
                return dict(status=r.status_code, given_up=True)
        r = await asyncio.wait_for(client.post(url + "/v1/chat/completions", json=body), 0.3)
        return dict(status=r.status_code, given_up=True)
    except asyncio.TimeoutError:
        return dict(status=0, given_up=True)


async def run_load(url, concurrency, num_requests, rate, max_tokens, rng, make=None) -> tuple:
    """num_requests arriving as a Poisson process of `rate` per second, at most `concurrency`
    in flight -> (results, wall seconds)."""
    import httpx

    limit = asyncio.Semaphore(concurrency)
    make = make or (lambda i: dict(prompt=PROMPTS[i % len(PROMPTS)]))
    async with httpx.AsyncClient(timeout=600,
                                 limits=httpx.Limits(max_connections=concurrency + 4)) as client:
        async def go(i, at):
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
            async with limit:
                kw = make(i)
                if "bad_body" in kw:
                    return dict(one=await bad_request(client, url, kw["bad_body"]), i=i)
                if kw.pop("give_up", False):
                    return dict(one=await given_up_request(client, url, kw["prompt"],
                                                           max_tokens, stream=kw["stream"]), i=i)
                return dict(one=await one_request(client, url, kw.pop("prompt"), max_tokens,
                                                  **kw), i=i)

        t0, at, tasks = time.perf_counter(), 0.0, []
        for i in range(num_requests):
            tasks.append(asyncio.create_task(go(i, at)))
            at += rng.expovariate(rate)
        results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - t0


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))] if xs else None


def summarise(results, wall) -> dict:
    ok = [r["one"] for r in results if r["one"]["status"] == 200 and "ids" in r["one"]]
    tokens = sum(len(r["ids"]) for r in ok)
    ttft = [r["first"] - r["start"] for r in ok if r["first"]]
    tpot = [(r["end"] - r["first"]) / (len(r["ids"]) - 1) for r in ok
            if r["first"] and len(r["ids"]) > 1]
    e2e = [r["end"] - r["start"] for r in ok]
    row = dict(requests=len(results), ok=len(ok), seconds=wall, requests_per_s=len(ok) / wall,
               tokens=tokens, tokens_per_s=tokens / wall)
    for name, xs in (("ttft_s", ttft), ("tpot_s", tpot), ("latency_s", e2e)):
        row.update({f"{name}_p{q}": pct(xs, q) for q in (50, 90, 99)})
    return row


def table(rows) -> str:
    head = f"{'mode':<15}{'conc':>5}{'req/s':>8}{'tok/s':>9}{'TTFT p50':>10}{'p99':>8}" \
           f"{'TPOT p50':>10}{'p99':>8}{'ok':>6}"
    lines = [head]
    for r in rows:
        ms = lambda x: f"{1e3 * x:.0f}ms" if x is not None else "-"  # noqa: E731
        lines.append(f"{r['mode']:<15}{r['concurrency']:>5}{r['requests_per_s']:>8.2f}"
                     f"{r['tokens_per_s']:>9.1f}{ms(r['ttft_s_p50']):>10}{ms(r['ttft_s_p99']):>8}"
                     f"{ms(r['tpot_s_p50']):>10}{ms(r['tpot_s_p99']):>8}"
                     f"{r['ok']:>4}/{r['requests']}")
    return "\n".join(lines)


# ---- the soak --------------------------------------------------------------------------------


def soak(args, opts, result) -> int:
    """-> the number of lost or corrupt responses, 5xx answers and requests left behind."""
    rng = random.Random(0)
    with ChildServer({**opts, "mode": "speculative"}) as server:
        async def references():
            import httpx
            async with httpx.AsyncClient(timeout=600) as client:
                return [await one_request(client, server.url, p, args.max_tokens, stream=False)
                        for p in PROMPTS]

        ref = asyncio.run(references())
        print(f"references: {[len(r['ids']) for r in ref]} tokens", flush=True)
        began = time.monotonic()
        deadline = began + 60 * args.soak_minutes
        bad, total, greedy_total, rows, batch, memory = [], 0, 0, [], 0, []
        counts = dict(bad_requests=0, given_up=0)
        while time.monotonic() < deadline:
            kinds = {}

            def make(i, kinds=kinds):
                draw, greedy, stream = rng.random(), rng.random() < 0.75, rng.random() < 0.5
                kinds[i] = (i % len(PROMPTS), greedy, stream)
                if draw < 0.1:
                    return dict(bad_body=BAD_BODIES[i % len(BAD_BODIES)])
                return dict(prompt=PROMPTS[i % len(PROMPTS)], stream=stream,
                            temperature=0.0 if greedy else 0.8, seed=i, give_up=draw < 0.2)

            n = args.concurrency[0]
            results, wall = asyncio.run(run_load(server.url, args.concurrency[0], n,
                                                 args.rate or 2.0 * n, args.max_tokens, rng, make))
            for r in results:
                one, (p, greedy, stream) = r["one"], kinds[r["i"]]
                if one.get("bad"):
                    counts["bad_requests"] += 1
                    problems = ([] if 400 <= one["status"] < 500 and one["error"] else
                                [f"bad request answered {one['status']}, error {one['error']}"])
                elif one.get("given_up"):
                    counts["given_up"] += 1
                    problems = [f"HTTP {one['status']}"] if one["status"] >= 500 else []
                else:
                    greedy_total += greedy
                    problems = check_response(one, ref[p] if greedy else None)
                if problems:
                    bad.append(dict(prompt=p, greedy=greedy, stream=stream, problems=problems))
            if left := held_requests(server.url):
                bad.append(dict(problems=[f"after batch {batch + 1}: {left}"]))
            total += n
            batch += 1
            memory.append(resident_mib(server.proc.pid))
            rows.append(summarise(results, wall))
            print(f"soak batch {batch}: {total} requests, {len(bad)} bad, "
                  f"{rows[-1]['tokens_per_s']:.1f} tok/s, server {memory[-1]:.0f} MiB",
                  flush=True)
    result["soak"] = dict(minutes=args.soak_minutes, concurrency=args.concurrency[0],
                          seconds=time.monotonic() - began, requests=total,
                          greedy=greedy_total, **counts, bad=len(bad), failures=bad[:20],
                          tokens_per_s=sum(r["tokens"] for r in rows)
                          / sum(r["seconds"] for r in rows),
                          server_mib=dict(first=memory[0], max=max(memory), last=memory[-1])
                          if memory else None)
    return len(bad)


def held_requests(url: str, wait_s: float = 10.0) -> str:
    """"" when the server holds no request (no active slot, nothing queued or prefilling)
    within wait_s of a batch's end (a given-up row is freed at a round boundary), else what
    it still holds."""
    import httpx

    deadline, held = time.monotonic() + wait_s, {}
    while time.monotonic() < deadline:
        text = httpx.get(url + "/metrics", timeout=10).text
        held = {name: float(line.split()[-1]) for line in text.splitlines()
                for name in ("slots_active", "queue_depth", "prefilling")
                if line.startswith(f"jetspec_{name} ")}
        if not any(held.values()):
            return ""
        time.sleep(0.2)
    return ", ".join(f"{k} {v:g}" for k, v in held.items() if v)


def resident_mib(pid: int) -> float:
    """The process's resident memory (Linux /proc), MiB."""
    with open(f"/proc/{pid}/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kib / 1024


def check_response(one: dict, expected: dict | None) -> list[str]:
    if one["status"] != 200:
        return [f"HTTP {one['status']}: {str(one.get('error'))[:200]}"]
    problems = []
    if one["finish"] not in ("stop", "length"):
        problems.append(f"finish reason {one['finish']!r}")
    if not one["usage"] or one["usage"]["completion_tokens"] != len(one["ids"]):
        problems.append(f"usage {one['usage']} for {len(one['ids'])} tokens")
    if expected is not None and (one["ids"] != expected["ids"] or one["text"] != expected["text"]):
        problems.append("greedy output differs from its solo output")
    return problems


# ---- main ------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--draft", help="draft head (default: the model's shipped head)")
    ap.add_argument("--random", metavar="PRESET", help="random weights of a preset, e.g. "
                    "qwen3-8b, and a random head (costs only)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    ap.add_argument("--requests", type=int, default=0,
                    help="requests per concurrency level (default: 4 x C, at least 8)")
    ap.add_argument("--rate", type=float, default=0,
                    help="Poisson arrival rate, requests/s (default: 2 x C per second, where "
                    "tokens/s at low C is the offered load; 1e9 keeps C in flight: capacity)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--max-queue", type=int, default=256)
    ap.add_argument("--budget", default=None, help="tree budget or 'auto' (default: the "
                    "server's)")
    ap.add_argument("--chunk", type=int, default=None,
                    help="speculative rounds per device call (default: the server's)")
    ap.add_argument("--prefill-chunk", type=int, default=PREFILL_CHUNK,
                    help="prompt tokens per prefill pass (default: %(default)s)")
    ap.add_argument("--kv-block-size", type=int, default=None,
                    help="serve with paged KV caches in blocks of this many slots (default: "
                    "dense rows)")
    ap.add_argument("--kv-blocks", type=int, default=None,
                    help="the paged pool's blocks (default: the server's)")
    ap.add_argument("--modes", nargs="+", default=["speculative", "autoregressive"],
                    choices=["speculative", "autoregressive"])
    ap.add_argument("--quick", action="store_true",
                    help="CPU sizes: C = 1 4, 8 requests, 16 tokens, 4 slots, max-len 256")
    ap.add_argument("--soak-minutes", type=float, default=0)
    ap.add_argument("--out", help="JSON results file (written after each row)")
    ap.add_argument("--resume", action="store_true", help="skip the rows --out already has")
    args = ap.parse_args()
    if args.quick:
        args.concurrency, args.max_tokens = [1, 4], 16
        args.requests, args.max_batch, args.max_len = args.requests or 8, 4, 256
    if args.soak_minutes and len(args.concurrency) != 1:
        ap.error("--soak-minutes takes one --concurrency")
    if min(args.concurrency) < 1 or args.max_tokens < 1 or args.soak_minutes < 0 \
            or (args.chunk is not None and args.chunk < 1) or args.prefill_chunk < 1:
        ap.error("--concurrency, --max-tokens, --chunk and --prefill-chunk must be >= 1, "
                 "--soak-minutes >= 0")
    budget = args.budget if args.budget in (None, "auto") else int(args.budget)
    opts = dict(model=args.model, draft=args.draft, random=args.random, dtype=args.dtype,
                max_batch=args.max_batch, max_len=args.max_len, max_queue=args.max_queue,
                budget=budget, chunk=args.chunk, prefill_chunk=args.prefill_chunk,
                kv_block_size=args.kv_block_size, kv_blocks=args.kv_blocks)
    result = resume(args.out if args.resume else None, command_line(),
                    dict(date=time.strftime("%Y-%m-%d"), options=opts, rows=[]))
    if args.soak_minutes:
        bad = soak(args, opts, result)
        if args.out:
            write_json(args.out, result)
        print(json.dumps(result["soak"], indent=1))
        return 1 if bad else 0
    done = {(r["mode"], r["concurrency"]) for r in result["rows"]}
    for mode in args.modes:
        todo = [c for c in args.concurrency if (mode, c) not in done]
        if not todo:
            continue
        with ChildServer({**opts, "mode": mode}) as server:
            asyncio.run(run_load(server.url, 1, 2, 1e9, args.max_tokens, random.Random(0)))
            for c in todo:
                n = args.requests or max(8, 4 * c)
                # the same arrival times for every mode at a level: a paired comparison
                results, wall = asyncio.run(run_load(server.url, c, n, args.rate or 2.0 * c,
                                                     args.max_tokens, random.Random(c)))
                result["rows"].append(dict(mode=mode, concurrency=c, **summarise(results, wall)))
                print(table(result["rows"][-1:]).splitlines()[-1], flush=True)
                if args.out:
                    write_json(args.out, result)
    print(table(result["rows"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
