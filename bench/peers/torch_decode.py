"""A lean hand-written PyTorch decode of a Llama-architecture target, batch 1, greedy: what a
PyTorch user who cares about speed runs (gpt-fast's way: a static KV cache preallocated, one
decode step captured in a CUDA graph and replayed per token), not a transformers model class.
bf16 on a GPU, float32 eager on a CPU. The weights are this library's own dequantized GGUF
(`bench.peers.reference`), and the greedy tokens are checked against our AR tokens: float32
must be identical (the exit code says), bf16 reports the share that matches.

    python -m bench.peers.torch_decode                       # GPU: bf16 + CUDA graph
    python -m bench.peers.torch_decode --bundle /tmp/b.npz   # writes the bundle (needs jax)
    /py311-with-torch/bin/python -m bench.peers.torch_decode --bundle /tmp/b.npz  # reads it

Every answer is --max-new tokens long (no stop token), as for every peer; tokens/s counts the
prompt's prefill in the time, as ours does; decode_ms_per_token is the decoding steps alone."""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from bench.peers.reference import read_bundle


class Decoder:
    """The target with a static KV cache of `num_slots` slots ([L, K, S, H] each for keys and
    values) and a decode step that reads and writes only preallocated tensors, so that it can
    be captured in a CUDA graph once and replayed for every token of every prompt."""

    def __init__(self, meta: dict, weights: dict[str, np.ndarray], *, device, dtype,
                 num_slots: int, max_new: int, graph: bool):
        self.L, self.N, self.K = meta["num_layers"], meta["num_heads"], meta["num_kv_heads"]
        self.H, self.eps, self.S = meta["head_dim"], meta["rms_norm_eps"], num_slots
        self.device, self.dtype = torch.device(device), dtype
        def t(a, dt=dtype):
            return torch.from_numpy(np.ascontiguousarray(a)).to(device, dt)
        w = [{k.split(".", 2)[2]: v for k, v in weights.items()
              if k.startswith(f"layers.{i}.")} for i in range(self.L)]
        D = weights["embed"].shape[1]
        # One matmul for q, k, v and one for gate, up: fewer kernels a step, as any fast
        # decode fuses them. F.linear's [out, in] layout.
        self.wqkv = [t(np.concatenate([l[n].reshape(D, -1) for n in "qkv"], 1).T) for l in w]
        self.wo = [t(l["o"].reshape(-1, D).T) for l in w]
        self.wgu = [t(np.concatenate([l["gate"], l["up"]], 1).T) for l in w]
        self.wdown = [t(l["down"].T) for l in w]
        self.attn_norm = [t(l["attn_norm"], torch.float32) for l in w]
        self.mlp_norm = [t(l["mlp_norm"], torch.float32) for l in w]
        self.final_norm = t(weights["final_norm"], torch.float32)
        self.embed = t(weights["embed"])  # tied: also the LM head
        inv_freq = 1.0 / (meta["rope_theta"] ** (
            torch.arange(0, self.H, 2, dtype=torch.float32) / self.H))
        angles = torch.arange(num_slots, dtype=torch.float32)[:, None] * inv_freq  # [S, H/2]
        self.cos, self.sin = angles.cos().to(device), angles.sin().to(device)
        self.k_cache = torch.zeros(self.L, self.K, num_slots, self.H, device=device, dtype=dtype)
        self.v_cache = torch.zeros_like(self.k_cache)
        self.slots = torch.arange(num_slots, device=device)
        # The step's state: the last token, its position, and where its successor goes.
        self.tok = torch.zeros(1, dtype=torch.long, device=device)
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        self.idx = torch.zeros(1, dtype=torch.long, device=device)
        self.out = torch.zeros(max_new, dtype=torch.long, device=device)
        self.graph = self._capture() if graph else None

    def _rms(self, x, w):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * w).to(x.dtype)

    def _rope(self, x, pos):  # x [T, heads, H]: half-split layout (HF rotate_half)
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]  # [T, 1, H/2]
        x1, x2 = x.float().chunk(2, -1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)

    def forward(self, tok, pos):
        """tok, pos [T] -> logits [V] of the last token; writes the T tokens' K/V at pos."""
        N, K, H, T = self.N, self.K, self.H, tok.shape[0]
        G = N // K
        visible = self.slots[None, :] <= pos[:, None]  # [T, S]: causal over the cache
        x = self.embed[tok]  # [T, D]
        for l in range(self.L):
            q, k, v = F.linear(self._rms(x, self.attn_norm[l]), self.wqkv[l]).split(
                [N * H, K * H, K * H], -1)
            q = self._rope(q.view(T, N, H), pos)
            self.k_cache[l].index_copy_(1, pos, self._rope(k.view(T, K, H), pos).transpose(0, 1))
            self.v_cache[l].index_copy_(1, pos, v.view(T, K, H).transpose(0, 1))
            qg = q.view(T, K, G, H).permute(1, 2, 0, 3).reshape(K, G * T, H)  # [K, G*T, H]
            s = (qg @ self.k_cache[l].transpose(1, 2)).float() / math.sqrt(H)  # [K, G*T, S]
            s = s.view(K, G, T, self.S).masked_fill(~visible, float("-inf"))
            p = torch.softmax(s, -1).to(self.dtype).view(K, G * T, self.S)
            o = (p @ self.v_cache[l]).view(K, G, T, H).permute(2, 0, 1, 3).reshape(T, N * H)
            x = x + F.linear(o, self.wo[l])
            g, u = F.linear(self._rms(x, self.mlp_norm[l]), self.wgu[l]).chunk(2, -1)
            x = x + F.linear(F.silu(g) * u, self.wdown[l])
        return F.linear(self._rms(x[-1], self.final_norm), self.embed)

    def _step(self):
        """One greedy token from tok at pos, kept in out[idx]; advances the state in place."""
        nxt = self.forward(self.tok, self.pos).argmax(-1, keepdim=True)
        self.out.index_copy_(0, self.idx, nxt)
        self.tok.copy_(nxt)
        self.pos.add_(1)
        self.idx.add_(1)

    def _capture(self):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up off the default stream, as capture requires
            for _ in range(3):
                self.idx.zero_()
                self._step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        self.idx.zero_()
        with torch.cuda.graph(graph):
            self._step()
        return graph

    def generate(self, prompt: list[int], max_new: int) -> tuple[list[int], float, float]:
        """-> (max_new greedy tokens, prefill seconds, decode seconds). The decode loop never
        waits on the host: every step is a graph replay (or an eager step on a CPU)."""
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        ids = torch.tensor(prompt, dtype=torch.long, device=self.device)
        sync()
        start = time.perf_counter()
        first = self.forward(ids, torch.arange(len(prompt), device=self.device)).argmax(-1)
        self.out[0] = first
        self.tok.copy_(first.view(1))  # device to device: no host round trip
        self.pos.fill_(len(prompt))
        self.idx.fill_(1)
        sync()
        prefilled = time.perf_counter()
        for _ in range(max_new - 1):
            self.graph.replay() if self.graph is not None else self._step()
        sync()
        end = time.perf_counter()
        return self.out[:max_new].tolist(), prefilled - start, end - prefilled


def compare(tokens: list[list[int]], reference: list[list[int]]) -> dict:
    """Identical prompts, and the share of tokens before each prompt's first difference."""
    same = 0
    for a, b in zip(tokens, reference):
        same += next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    total = sum(map(len, reference))
    return dict(identical_prompts=sum(a == b for a, b in zip(tokens, reference)),
                prompts=len(reference), matching_prefix_share=same / total)


def run(meta: dict, weights: dict, *, device: str, dtype: torch.dtype, graph: bool) -> dict:
    """Decodes every prompt of the bundle (one untimed warm-up answer first) -> the result."""
    prompts, max_new = meta["prompts"], meta["max_new"]
    slots = -(-(max(map(len, prompts)) + max_new) // 64) * 64
    dec = Decoder(meta, weights, device=device, dtype=dtype, num_slots=slots, max_new=max_new,
                  graph=graph)
    dec.generate(prompts[0], max_new)
    tokens, prefill_s, decode_s = [], 0.0, 0.0
    for p in prompts:
        t, a, b = dec.generate(p, max_new)
        tokens.append(t)
        prefill_s, decode_s = prefill_s + a, decode_s + b
    n = sum(map(len, tokens))
    check = compare(tokens, meta["reference_tokens"])
    return dict(engine="torch_decode", mode="autoregressive", device=device,
                dtype=str(dtype).removeprefix("torch."), cuda_graph=graph,
                torch=torch.__version__, num_threads=torch.get_num_threads(),
                max_new=max_new, tokens=n, seconds=prefill_s + decode_s,
                tokens_per_s=n / (prefill_s + decode_s),
                ms_per_token=1e3 * (prefill_s + decode_s) / n,
                decode_ms_per_token=1e3 * decode_s / (len(prompts) * (max_new - 1)),
                prefill_s=prefill_s, reference_dtype=meta["reference_dtype"], **check,
                tokens_out=tokens)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", help="weights, prompts and our tokens (.npz); written first "
                    "when missing (needs jetspec_jax); default: a temporary file")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--per-set", type=int, default=2, help="prompts per benchmark set")
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--no-graph", action="store_true", help="eager steps on a GPU too")
    ap.add_argument("--threads", type=int, help="CPU threads (default: torch's choice)")
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    bundle = args.bundle or os.path.join(tempfile.mkdtemp(), "bundle.npz")
    if not Path(bundle).exists():
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # GPU shared with torch
        from bench.peers.reference import write_bundle
        write_bundle(bundle, per_set=args.per_set, max_new=args.max_new, dtype=dtype)
    meta, weights = read_bundle(bundle)
    if meta["reference_dtype"] != dtype:
        ap.error(f"the bundle's reference tokens are {meta['reference_dtype']}, not {dtype}")
    graph = args.device.startswith("cuda") and not args.no_graph
    result = run(meta, weights, device=args.device, dtype=getattr(torch, dtype), graph=graph)
    if args.json:
        Path(args.json).write_text(json.dumps(result))
    print(f"torch_decode {result['device']} {result['dtype']} (CUDA graph: {graph}): "
          f"{result['tokens']} tokens, {result['tokens_per_s']:.1f} tok/s, "
          f"{result['ms_per_token']:.2f} ms/token (decode steps {result['decode_ms_per_token']:.2f}"
          f" ms); identical to ours: {result['identical_prompts']}/{result['prompts']} prompts, "
          f"{100 * result['matching_prefix_share']:.1f}% of tokens before a difference")
    exact = result["identical_prompts"] == result["prompts"]
    return 0 if exact or dtype != "float32" else 1


if __name__ == "__main__":
    raise SystemExit(main())
