"""Every peer and ours in one run, on the same model (SmolLM2-135M-Instruct from the same
GGUF), prompts (the first --per-set of HumanEval, MATH500 and MT-Bench, chat-templated), batch
1, greedy, --max-new tokens an answer: ours autoregressive and speculative (the shipped head,
each of --budgets, the fastest marked "best"), the hand-written PyTorch decode
(`torch_decode`, CUDA graph on a GPU) and llama.cpp's tools (`llama_cpp`, with --llama-bin).
Writes one result file (command, versions, device, date) and prints the table: tokens/s,
ms/token (the whole answer's time, prompt included, over its tokens) and the speedup over the
fastest peer's autoregressive decoding.

    python -m bench.peers.run_all --llama-bin build/llama-cpp-cuda/bin --gpu-layers 99  # GPU
    python -m bench.peers.run_all --per-set 1 --threads 1 \\
        --torch-python /py311-with-torch/bin/python --llama-bin build/llama-cpp-cpu/bin  # CPU

Every engine answers exactly --max-new tokens where it can (ours and the PyTorch decode ignore
the stop token; llama-completion runs with --ignore-eos); llama.cpp's lookup and speculative
tools stop at it, so they count the tokens they made."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common.results_io import ROOT, command_line, write_json
from bench.peers import llama_cpp


def ours(args, target, ids) -> tuple[list[dict], list[list[int]]]:
    """Ours AR, then speculative at each budget, then the n-gram drafter alone -> (rows, our AR
    tokens)."""
    from jetspec_jax import api
    from bench.peers.reference import generate

    ar = generate(target, ids, args.max_new)
    rows = [dict(engine="jetspec_jax", mode="autoregressive", ar=True, tokens=_n(ar["tokens"]),
                 seconds=ar["seconds"], compile_s=ar["compile_s"])]

    def speculative(mode, draft, tree_budget, **extra):
        sp = generate(target, ids, args.max_new, draft=draft, budget=tree_budget)
        rows.append(dict(engine="jetspec_jax", mode=mode, ar=False, **extra,
                         tokens=_n(sp["tokens"]), seconds=sp["seconds"],
                         compile_s=sp["compile_s"], tau=sp["tau"],
                         identical_to_ar=sp["tokens"] == ar["tokens"]))

    draft = api.load_draft(api.default_draft_path(target.name), target)
    for b in args.budgets or [api.default_budget(draft)]:
        speculative(f"speculative (budget {b})", draft, b, budget=b)
    ng = api.ngram_draft()  # prompt lookup, no head: what llama-lookup does
    speculative("n-gram drafter (no head)", ng, api.default_budget(ng))
    return rows, ar["tokens"]


def torch_peer(args, bundle: str, device: str) -> dict:
    """`torch_decode` in its own process (--torch-python; its own GPU memory) -> its row."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "torch.json"
        cmd = [args.torch_python, "-m", "bench.peers.torch_decode", "--bundle", bundle,
               "--device", device, "--json", str(out)]
        if args.threads:  # the CPU threads llama.cpp gets, the same for torch
            cmd += ["--threads", str(args.threads)]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if not out.exists():
            return dict(engine="torch_decode", mode="autoregressive", ar=True,
                        error=(proc.stderr or proc.stdout)[-800:])
        r = json.loads(out.read_text())
    r.pop("tokens_out")
    return dict(r, engine="torch_decode",
                mode="autoregressive" + (" (CUDA graph)" if r["cuda_graph"] else " (eager)"),
                ar=True)


def llama_rows(args, prompts: list[str]) -> tuple[list[dict], dict]:
    res = llama_cpp.run(args, prompts)
    rows = []
    for r in res.pop("modes"):
        r = dict(r, engine="llama.cpp", ar=r["mode"] in ("completion", "bench"))
        # llama-bench generates without a prompt: shown, but not a reference for speedups.
        r["same_prompts"] = r["mode"] != "bench"
        rows.append(r)
    return rows, res


def _n(tokens) -> int:
    return sum(map(len, tokens))


def machine() -> dict:
    import jax

    dev = jax.devices()[0]
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text()
                .splitlines() if line.startswith("model name")), platform.processor())
    return dict(backend=jax.default_backend(), device_kind=dev.device_kind, cpu=cpu,
                cpu_cores=os.cpu_count(), load_average=os.getloadavg())


def versions() -> dict:
    import importlib.metadata as md

    import jax

    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                         text=True).stdout.strip()
    return dict(jax=jax.__version__, jetspec_jax=md.version("jetspec-jax"), commit=rev,
                python=platform.python_version())


def table(rows: list[dict]) -> str:
    """The rows with tokens/s, ms/token and speedup over the fastest peer's AR."""
    peers_ar = [r["tokens_per_s"] for r in rows if r["ar"] and r["engine"] != "jetspec_jax"
                and "error" not in r and r.get("same_prompts", True)]
    base = max(peers_ar, default=None)
    lines = [f"{'engine':<12} {'mode':<28} {'tok/s':>9} {'ms/token':>9} {'x fastest peer AR':>18}"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['engine']:<12} {r['mode']:<28} error: {r['error'][:120]!r}")
            continue
        x = f"{r['tokens_per_s'] / base:.2f}" if base else "-"
        lines.append(f"{r['engine']:<12} {r['mode']:<28} {r['tokens_per_s']:9.1f} "
                     f"{r['ms_per_token']:9.2f} {x:>18}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", help="ours and the PyTorch decode (default: bfloat16 on a GPU, "
                    "float32 on a CPU)")
    ap.add_argument("--per-set", type=int, default=2, help="prompts per benchmark set")
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--budgets", type=int, nargs="+", help="speculative tree budgets "
                    "(default: the one the head measured fastest on this kind of machine)")
    ap.add_argument("--torch-python", default=sys.executable,
                    help="a Python with torch for the PyTorch decode ('' skips it)")
    ap.add_argument("--llama-bin", dest="bin", help="llama.cpp's tools (skipped without)")
    llama_cpp.add_options(ap)
    ap.add_argument("--note", default="", help="kept in the result (e.g. the machine's load)")
    ap.add_argument("--out", help="default: bench/results/peers/peers_<backend>_<date>.json")
    args = ap.parse_args()

    import jax

    from jetspec_jax import api
    from bench.peers.reference import (chat_prompts, gguf_path, load_targets, prompt_texts,
                                       save_bundle)

    gpu = jax.default_backend() == "gpu"
    dtype = args.dtype or ("bfloat16" if gpu else "float32")
    args.gguf = args.gguf or gguf_path()
    command, date = command_line(), datetime.date.today().isoformat()
    fp32, target = load_targets(dtype)
    texts = chat_prompts(args.per_set)  # for llama.cpp, which tokenizes them itself
    ids = api.encode_prompts(fp32, prompt_texts(args.per_set))
    rows, ar_tokens = ours(args, target, ids)
    llama_info = None
    with tempfile.TemporaryDirectory() as tmp:
        if args.torch_python:
            bundle = str(Path(tmp) / "bundle.npz")
            save_bundle(bundle, fp32, ids, ar_tokens, dtype=dtype, max_new=args.max_new)
            rows.append(torch_peer(args, bundle, "cuda" if gpu else "cpu"))
    if args.bin:
        llama, llama_info = llama_rows(args, texts)
        rows += llama
    for r in rows:
        if "error" not in r and "tokens_per_s" not in r:
            r["tokens_per_s"] = r["tokens"] / r["seconds"]
            r["ms_per_token"] = 1e3 * r["seconds"] / r["tokens"]
    spec = [r for r in rows if r["engine"] == "jetspec_jax" and not r["ar"]]
    best = max(spec, key=lambda r: r["tokens_per_s"])
    best["best"] = True
    result = dict(question="Ours against the engines a user would run instead, batch 1, greedy",
                  command=command, date=date, machine=machine(), versions=versions(),
                  model="SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)", dtype=dtype,
                  prompts=len(ids), prompt_lens=list(map(len, ids)), max_new=args.max_new,
                  llama_cpp=llama_info, note=args.note, rows=rows, table=table(rows))
    kind = "h200" if "H200" in result["machine"]["device_kind"] else result["machine"]["backend"]
    out = args.out or ROOT / "bench/results/peers" / f"peers_{kind}_{dtype}_{date}.json"
    write_json(out, result)
    print(result["table"])
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
