"""What every peer is measured against, from this library: the prompts (the first few of each
benchmark set, chat-templated by our tokenizer into token ids, so every engine reads the same
ids), our greedy autoregressive tokens for them, and the dequantized GGUF weights as float32
arrays. `write_bundle` puts them in one .npz, which a PyTorch without jax reads
(`torch_decode --bundle`)."""

from __future__ import annotations

import json

import numpy as np

MODEL = "smollm2-135m"


def prompt_texts(per_set: int) -> list[str]:
    """The first `per_set` prompts of HumanEval, MATH500 and MT-Bench, in that order."""
    from bench.common.prompts import BENCHMARKS

    return [p for load in BENCHMARKS.values() for p in load()[:per_set]]


def gguf_path():
    """The GGUF every engine reads: the embedded model's file."""
    from jetspec_jax.io.sources import EMBEDDED, package_file

    return package_file(*EMBEDDED[MODEL])


def chat_prompts(per_set: int) -> list[str]:
    """`prompt_texts` wrapped in the model's chat template, as text: what engines that
    tokenize for themselves read (`llama_cpp`); ours reads the same text's token ids."""
    from jetspec_jax.io.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(gguf_path())
    return [tok.chat_text([{"role": "user", "content": p}]) for p in prompt_texts(per_set)]


def generate(target, ids: list[list[int]], max_new: int, draft=None, budget=None) -> dict:
    """Ours at batch 1, prompt after prompt, every answer max_new tokens long (no stop token,
    as for the peers): {tokens per prompt, seconds (prefill + decode, summed), compile_s,
    tau}."""
    from jetspec_jax import api

    out = dict(tokens=[], seconds=0.0, compile_s=0.0, accepted=0, rounds=0)
    for p in ids:
        r = api.generate(target, [p], draft=draft, budget=budget, max_new_tokens=max_new,
                         stop_ids=())
        out["tokens"].append(r.tokens[0])
        out["seconds"] += r.seconds
        out["compile_s"] += r.compile_s
        if r.accepted is not None:
            out["accepted"] += sum(r.accepted[0])
            out["rounds"] += len(r.accepted[0])
    out["tau"] = out.pop("accepted") / out.pop("rounds") if draft is not None else None
    return out


def params_arrays(params) -> dict[str, np.ndarray]:
    """The separate-layout target weights as flat float32 arrays ("layers.3.q", ...)."""
    flat = {k: np.asarray(params[k], np.float32) for k in ("embed", "final_norm")}
    for i, layer in enumerate(params["layers"]):
        flat.update({f"layers.{i}.{k}": np.asarray(v, np.float32) for k, v in layer.items()})
    return flat


def load_targets(dtype: str):
    """-> (the target in float32 with separate q/k/v, what the bundle's weights are; the
    target in `dtype` in the layout ours decodes with on this machine)."""
    from jetspec_jax import api

    fp32 = api.load_target(MODEL, dtype="float32", fuse=False, progress=False)
    target = fp32 if dtype == "float32" else api.load_target(MODEL, dtype=dtype, progress=False)
    api.exact_float32(target.dtype)
    return fp32, target


def bundle_meta(cfg, ids: list[list[int]], tokens: list[list[int]], *, dtype: str,
                max_new: int) -> dict:
    """What the PyTorch decode needs beside the weights: the shapes, the prompt ids and our
    `dtype` AR tokens for them."""
    return dict(model=cfg.name, num_layers=cfg.num_layers, num_heads=cfg.num_heads,
                num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, rope_theta=cfg.rope_theta,
                rms_norm_eps=cfg.rms_norm_eps, vocab_size=cfg.vocab_size, max_new=max_new,
                reference_dtype=dtype, prompts=ids, reference_tokens=tokens)


def save_bundle(path, fp32, ids: list[list[int]], tokens: list[list[int]], *, dtype: str,
                max_new: int) -> None:
    """fp32's weights and `bundle_meta` -> path (.npz)."""
    meta = bundle_meta(fp32.cfg, ids, tokens, dtype=dtype, max_new=max_new)
    np.savez(path, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8),
             **params_arrays(fp32.params))


def write_bundle(path, *, per_set: int, max_new: int, dtype: str = "float32") -> dict:
    """The bundle of `per_set` prompts a set, with our AR tokens in `dtype` -> our AR run."""
    from jetspec_jax import api

    fp32, target = load_targets(dtype)
    ids = api.encode_prompts(fp32, prompt_texts(per_set))
    ours = generate(target, ids, max_new)
    save_bundle(path, fp32, ids, ours["tokens"], dtype=dtype, max_new=max_new)
    return ours


def read_bundle(path) -> tuple[dict, dict[str, np.ndarray]]:
    """-> (meta, weights) of a `write_bundle` file."""
    with np.load(path) as z:
        return json.loads(z["meta"].tobytes()), {k: z[k] for k in z.files if k != "meta"}
