"""llama.cpp on the same GGUF and prompts as ours, through its own tools (built by
scripts/build_llama_cpp.sh), greedy (--temp 0), batch 1, --max-new tokens a prompt:
  completion    llama-completion: plain decoding, every answer --max-new tokens (--ignore-eos)
  lookup        llama-lookup: prompt-lookup (n-gram) speculative decoding, to the stop token
  spec-ngram    llama-speculative-simple --spec-type ngram-simple, to the stop token
  spec-draft    llama-speculative-simple with a draft GGUF (--draft-gguf), to the stop token
  bench         llama-bench -p 0 -n MAX: its own generation-speed figure (no prompt)
Each tool's timing lines are parsed (load time excluded; prompt time counted, as ours);
a tool that fails or is missing is recorded with its error, not fatal.

    python -m bench.peers.llama_cpp --bin build/llama-cpp-cuda/bin --gpu-layers 99
    python -m bench.peers.llama_cpp --bin build/llama-cpp-cpu/bin --threads 2"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
from pathlib import Path

MODES = ("completion", "lookup", "spec-ngram", "spec-draft", "bench")
NUM = r"([\d.]+)"
PERF = {  # the perf lines llama.cpp prints to stderr
    "prompt": re.compile(rf"prompt eval time =\s*{NUM} ms /\s*(\d+) tokens"),
    "eval": re.compile(rf":\s+eval time =\s*{NUM} ms /\s*(\d+) runs"),
    "encoded": re.compile(rf"encoded\s+(\d+) tokens in\s+{NUM} seconds"),
    "decoded": re.compile(rf"decoded\s+(\d+) tokens in\s+{NUM} seconds"),
    "drafted": re.compile(r"n_drafted\s*=\s*(\d+)"),
    "accept": re.compile(r"n_accept\s*=\s*(\d+)"),
}


def _args(mode: str, args, prompt: str) -> list[str]:
    """The command line of one answer in this mode."""
    b = Path(args.bin)
    common = ["-m", str(args.gguf), "-n", str(args.max_new), "--temp", "0", "--seed", "0",
              "-ngl", str(args.gpu_layers), "-c", str(args.ctx)]
    if args.threads:
        common += ["-t", str(args.threads)]
    if args.no_repack:
        common += ["--no-repack"]
    if mode == "completion":
        return [str(b / "llama-completion"), *common, "-p", prompt, "-no-cnv",
                "--ignore-eos", "--no-display-prompt"]
    if mode == "lookup":
        return [str(b / "llama-lookup"), *common, "-p", prompt,
                "--spec-draft-n-max", str(args.draft_max)]
    spec = [str(b / "llama-speculative-simple"), *common, "-p", prompt,
            "--spec-draft-n-max", str(args.draft_max)]
    if mode == "spec-ngram":
        return spec + ["--spec-type", "ngram-simple"]
    return spec + ["-md", str(args.draft_gguf), "-ngld", str(args.gpu_layers)]


def parse(mode: str, log: str) -> dict:
    """One answer's tokens and seconds (prompt + generation) from the tool's log."""
    found = {k: p.search(log) for k, p in PERF.items()}
    if mode == "completion":
        if not (found["prompt"] and found["eval"]):
            raise ValueError("no perf lines in the log")
        prompt_ms, eval_ms = float(found["prompt"][1]), float(found["eval"][1])
        runs = int(found["eval"][2])
        # The first token comes from the prompt's pass; each later one from one eval run.
        return dict(tokens=runs + 1, seconds=(prompt_ms + eval_ms) / 1e3,
                    decode_s=eval_ms / 1e3, decode_steps=runs)
    if not (found["encoded"] and found["decoded"]):
        raise ValueError("no encoded/decoded lines in the log")
    n, dec = int(found["decoded"][1]), float(found["decoded"][2])
    out = dict(tokens=n, seconds=float(found["encoded"][2]) + dec, decode_s=dec, decode_steps=n)
    if found["drafted"] and found["accept"]:
        out.update(drafted=int(found["drafted"][1]), accepted=int(found["accept"][1]))
    return out


def run_mode(mode: str, args, prompts: list[str]) -> dict:
    """Every prompt once after one untimed warm-up answer -> totals, or the error."""
    if mode == "bench":
        return run_bench(args)
    if mode == "spec-draft" and not args.draft_gguf:
        return dict(mode=mode, error="no --draft-gguf given")
    rows = []
    try:
        for i, p in enumerate([prompts[0], *prompts]):
            cmd = _args(mode, args, p)
            proc = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                                  timeout=args.timeout)
            if proc.returncode != 0:
                raise RuntimeError(f"exit {proc.returncode}: {proc.stderr[-600:]}")
            if i:
                rows.append(parse(mode, proc.stderr + proc.stdout))
    except (OSError, RuntimeError, ValueError, subprocess.TimeoutExpired) as e:
        return dict(mode=mode, error=str(e)[-800:])
    total = {k: sum(r.get(k, 0) for r in rows) for k in rows[0]}
    out = dict(mode=mode, prompts=len(rows), **total,
               tokens_per_s=total["tokens"] / total["seconds"],
               ms_per_token=1e3 * total["seconds"] / total["tokens"],
               decode_ms_per_token=1e3 * total["decode_s"] / total["decode_steps"],
               per_prompt=rows, command=cmd[:1] + ["..."] + cmd[3:])
    if "drafted" in total:
        out["acceptance"] = total["accepted"] / max(total["drafted"], 1)
    return out


def run_bench(args) -> dict:
    cmd = [str(Path(args.bin) / "llama-bench"), "-m", str(args.gguf), "-p", "0",
           "-n", str(args.max_new), "-r", "5", "-ngl", str(args.gpu_layers), "-o", "json"]
    if args.threads:
        cmd += ["-t", str(args.threads)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"exit {proc.returncode}: {proc.stderr[-600:]}")
        row = json.loads(proc.stdout)[0]
    except (OSError, RuntimeError, ValueError, IndexError, subprocess.TimeoutExpired) as e:
        return dict(mode="bench", error=str(e)[-800:])
    keep = ("build_commit", "build_number", "cpu_info", "gpu_info", "backends", "n_threads",
            "n_gpu_layers", "flash_attn", "avg_ts", "stddev_ts", "n_gen")
    return dict(mode="bench", tokens_per_s=row["avg_ts"], ms_per_token=1e3 / row["avg_ts"],
                command=cmd, **{k: row.get(k) for k in keep})


def add_options(ap: argparse.ArgumentParser) -> None:
    """The options of a llama.cpp run (also `run_all`'s)."""
    ap.add_argument("--bin", help="the folder of llama.cpp's tools (build_llama_cpp.sh's OUT/bin)")
    ap.add_argument("--gguf", help="default: the embedded SmolLM2 GGUF, as ours reads")
    ap.add_argument("--ctx", type=int, default=2048, help="-c: context slots")
    ap.add_argument("--gpu-layers", type=int, default=0, help="-ngl: 99 on a GPU")
    ap.add_argument("--threads", type=int, help="CPU threads: llama.cpp's -t (run_all: the "
                    "PyTorch decode's too; default: each engine's own choice)")
    ap.add_argument("--draft-max", type=int, default=8, help="drafted tokens a round")
    ap.add_argument("--draft-gguf", help="a smaller GGUF with the same vocabulary (spec-draft)")
    ap.add_argument("--no-repack", action="store_true", help="llama.cpp's --no-repack: some "
                    "CPU builds crash in the repacked Q4_1 matmul on multi-token batches")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--timeout", type=int, default=300, help="seconds per tool call")


def run(args, prompts: list[str]) -> dict:
    """Every mode -> {"source": what the tools were built from, "modes": [results]}."""
    src = Path(args.bin).parent / "source.txt"
    return dict(source=src.read_text().strip() if src.exists() else None,
                gguf=str(args.gguf), gpu_layers=args.gpu_layers, threads=args.threads,
                modes=[run_mode(m, args, prompts) for m in args.modes])


def main() -> None:
    from bench.peers.reference import chat_prompts, gguf_path

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_options(ap)
    ap.add_argument("--per-set", type=int, default=2, help="prompts per benchmark set")
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args()
    if not args.bin:
        ap.error("--bin is required")
    args.gguf = args.gguf or gguf_path()
    result = run(args, chat_prompts(args.per_set))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    for r in result["modes"]:
        print(f"llama.cpp {r['mode']:<11}", f"error: {r['error'][:200]}" if "error" in r else
              f"{r['tokens_per_s']:8.1f} tok/s {r['ms_per_token']:7.2f} ms/token")


if __name__ == "__main__":
    main()
