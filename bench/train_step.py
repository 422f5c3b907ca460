"""How fast is a draft head's training step, per teacher and draft vocabulary, on one data set?

Times `trainer.make_steps`' step, the one `train-draft` runs, side by side in one process on
the same batches: the online teacher (the target's full distribution at every position), the
stored top-K teacher (`train-data --teacher-top-k`) with the full vocabulary or draft
vocabularies, at each batch size, with every `--target-attention` of the frozen target's pass
and every `--head-attention` of the head. Per variant: seconds per step
(median after warm-up), tokens/s, model FLOPs (`throughput.step_flops`) over peak, and the
draft vocabulary's share of the data's answer tokens (its coverage). A variant that fails (a
kernel this machine lacks) is reported with its error and the others go on.

    python -m bench.train_step --data runs/data --vocab 0 8192 16384 --batch 32 64 \
        --out bench/results/training/step_h200.json
    python -m bench.train_step --synthetic 1024 --vocab 16384 --head-attention reference cudnn
    python -m bench.train_step --tiny          # a random tiny target, on the CPU (the tests)

--synthetic needs neither the model's weights nor a data set (random ones at its shapes): a
step's work follows the shapes, not the values.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.common.results_io import command_line, write_json
from bench.trace_summary import profile
from jetspec_jax.options import HEAD_ATTENTION
from jetspec_jax.train import data as D
from jetspec_jax.train.throughput import step_flops
from jetspec_jax.train.trainer import (TrainConfig, fresh_params, make_optimizer, make_steps,
                                       head_attention as resolved)
from jetspec_jax.draft.head import draft_specs


def time_variant(cfg: TrainConfig, tparams, tcfg, data, vocab, stored: bool, steps: int,
                 profile_dir: str | None = None):
    """(compile seconds, median step seconds) of cfg's step on batches of data; with
    profile_dir, one more step traced there and its busiest device ops printed."""
    dcfg = cfg.draft_config(tcfg, vocab)
    tx = make_optimizer(cfg)[0]
    dparams = fresh_params(cfg, draft_specs(dcfg), tparams)
    opt_state = tx.init(dparams)
    train_step, _ = make_steps(cfg, tcfg, dcfg, tx, stored=stored)
    keys = ("tokens", "lengths", "prompt_lengths") + (("top_logp", "top_ids") if stored else ())
    rng = np.random.default_rng(0)
    times, t0 = [], time.perf_counter()
    for i in range(steps + 2):
        rows = rng.choice(len(data["lengths"]), cfg.batch_size, replace=False)
        batch = {k: jnp.asarray(data[k][rows]) for k in keys}
        start = time.perf_counter()
        dparams, opt_state, m = train_step(dparams, opt_state, tparams, batch, jax.random.key(i))
        jax.block_until_ready(m)
        times.append(time.perf_counter() - start)
        if i == 0:
            compile_s = time.perf_counter() - t0
    if profile_dir:  # the step donates its state: each run gets copies
        def step():
            copies = jax.tree.map(jnp.copy, (dparams, opt_state))
            return train_step(*copies, tparams, batch, jax.random.key(0))

        print(profile(step, trace_dir=profile_dir, top=20), flush=True)
    return dcfg, compile_s, float(np.median(times[2:]))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", help="train-data output made with --teacher-top-k")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--head-layers", type=int, default=3)
    p.add_argument("--anchors", type=int, default=256)
    p.add_argument("--anchor-chunk", type=int, nargs="+", default=[32])
    p.add_argument("--batch", type=int, nargs="+", default=[32])
    p.add_argument("--vocab", type=int, nargs="+", default=[0],
                   help="draft vocabulary sizes of the stored-teacher variants, 0 the full "
                   "vocabulary (default: 0)")
    p.add_argument("--target-attention", nargs="+", default=["auto"], metavar="KERNELS",
                   help="the frozen target's attention in the step, each timed (e.g. "
                   "reference auto: XLA's, then the GPU kernels; default: auto)")
    p.add_argument("--head-attention", nargs="+", default=["auto"],
                   choices=HEAD_ATTENTION, help="the head's attentions, each timed (e.g. "
                   "reference cudnn: XLA's, then cuDNN's; default: auto)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per variant")
    p.add_argument("--no-online", action="store_true", help="skip the online-teacher baseline")
    p.add_argument("--peak-tflops", type=float, default=790.0)
    p.add_argument("--tiny", action="store_true", help="a random tiny target and data (CPU)")
    p.add_argument("--synthetic", type=int, metavar="SEQ_LEN",
                   help="no data set: --model's preset with random weights, 64 random "
                   "sequences of SEQ_LEN tokens and a random top-32 (speed only)")
    p.add_argument("--profile", metavar="DIR", help="trace a step of each variant under DIR "
                   "and print where its device time went")
    p.add_argument("--out")
    args = p.parse_args(argv)
    if args.tiny:
        tparams, tcfg, data = _tiny_data()
        args.anchors, args.head_layers = 4, 1
    elif args.synthetic:
        tparams, tcfg, data = _synthetic_data(args.model, args.dtype, args.synthetic)
    else:
        from jetspec_jax import api

        target = api.load_target(args.model, dtype=args.dtype)
        tparams, tcfg, data = target.params, target.cfg, D.load_shards(args.data)
    if "top_ids" not in data:
        raise SystemExit(f"{args.data} holds no stored teacher: make it with --teacher-top-k")
    seq_len = data["tokens"].shape[1]
    eos = tcfg.eos_token_ids
    variants = [("online", None, False)] if not args.no_online else []
    variants += [(f"stored top-K, draft vocab {n}" if n else "stored top-K", n or None, True)
                 for n in args.vocab]
    rows = []
    settings = itertools.product(args.batch, args.anchor_chunk, args.target_attention,
                                 args.head_attention, variants)
    for batch, chunk, attention, head_attention, (name, n, stored) in settings:
        if not stored and (batch, head_attention) != (args.batch[0], args.head_attention[0]):
            continue  # the online baseline at the first batch size and head attention only
        cfg = TrainConfig(data_dir="-", out_dir="-", head_layers=args.head_layers,
                          batch_size=batch, num_anchors=args.anchors, anchor_chunk=chunk,
                          gamma=3.0, depth1_weight=3.0, draft_vocab=n,
                          target_attention=attention, head_attention=head_attention)
        vocab = D.frequent_tokens(data, n, tcfg.vocab_size, eos) if n else None
        row = {"variant": name, "batch": batch, "anchor_chunk": chunk,
               "target_attention": attention, "head_attention": resolved(cfg),
               "draft_vocab": n,
               "coverage": D.vocab_coverage(data, vocab) if vocab else 1.0}
        tag = "_".join(re.sub(r"[^A-Za-z0-9]+", "_", str(v)) for k, v in row.items()
                       if k != "coverage")
        try:
            dcfg, compile_s, step_s = time_variant(cfg, tparams, tcfg, data, vocab, stored,
                                                   args.steps, args.profile and
                                                   f"{args.profile}/{tag}")
        except Exception as e:  # noqa: BLE001  (a kernel this machine lacks: say so, go on)
            rows.append(row | {"error": f"{type(e).__name__}: {str(e)[:300]}"})
            print(rows[-1], flush=True)
            continue
        flops = step_flops(tcfg, dcfg, batch=batch, seq_len=seq_len, anchors=args.anchors,
                           anchor_chunk=chunk, teacher="stored" if stored else "online")
        rows.append(row | {"compile_s": round(compile_s, 2), "step_s": round(step_s, 4),
                           "tok_s": round(batch * seq_len / step_s),
                           "mfu": round(flops["step"] / step_s / (args.peak_tflops * 1e12), 4)})
        print(rows[-1], flush=True)
    print_table(rows)
    if args.out:
        write_json(args.out, {"command": command_line(), "backend": jax.default_backend(),
                              "device": str(jax.devices()[0].device_kind), "seq_len": seq_len,
                              "sequences": int(len(data["lengths"])),
                              "date": time.strftime("%Y-%m-%d"), "rows": rows})


def print_table(rows: list[dict]) -> None:
    """The rows side by side, each step's speed against the first timed row's."""
    timed = [r for r in rows if "step_s" in r]
    base = timed[0]["tok_s"] if timed else None
    print(f"\n{'variant':<34} {'batch':>5} {'chunk':>5} {'target attn':>11} "
          f"{'head attn':>9} {'cover':>6} {'step s':>7} {'tok/s':>8} {'x':>5} {'MFU':>5}")
    for r in rows:
        head = (f"{r['variant']:<34} {r['batch']:>5} {r['anchor_chunk']:>5} "
                f"{r['target_attention']:>11} {r['head_attention']:>9} {r['coverage']:>6.4f}")
        if "error" in r:
            print(f"{head} failed: {r['error'][:80]}")
        else:
            print(f"{head} {r['step_s']:>7.3f} {r['tok_s']:>8,} {r['tok_s'] / base:>5.2f} "
                  f"{r['mfu']:>5.1%}")


def _tiny_data():
    """A random tiny target and 16 random sequences with their stored top-8 teacher."""
    from jetspec_jax.model.config import tiny_dense
    from jetspec_jax.model.params import init_params, target_specs
    from jetspec_jax.train.teacher import label_top_k

    tcfg = tiny_dense(vocab_size=64, eos_token_ids=(1,))
    tparams = init_params(target_specs(tcfg), jax.random.key(0))
    rng = np.random.default_rng(0)
    tokens = rng.integers(2, tcfg.vocab_size, (16, 24)).astype(np.int32)
    lengths = rng.integers(12, 25, 16).astype(np.int32)
    data = {"tokens": tokens, "lengths": lengths, "prompt_lengths": np.full(16, 4, np.int32)}
    return tparams, tcfg, data | label_top_k(tparams, tcfg, tokens, lengths, 8, batch_tokens=64,
                                               bucket=8)


def _synthetic_data(model: str, dtype: str, seq_len: int, n: int = 64, top_k: int = 32):
    """A preset target with random weights and n random sequences (prompts a quarter of
    seq_len, lengths from half of it up) with a random top-K teacher: times a step at a real
    model's shapes without its weights or a data set."""
    from jetspec_jax.model.config import preset
    from jetspec_jax.model.params import init_params, target_specs

    tcfg = preset(model)
    tparams = init_params(target_specs(tcfg), jax.random.key(0), jnp.dtype(dtype))
    rng = np.random.default_rng(0)
    probs = np.sort(rng.dirichlet(np.ones(top_k + 1), (n, seq_len))[..., :top_k], axis=-1)
    return tparams, tcfg, {
        "tokens": rng.integers(2, tcfg.vocab_size, (n, seq_len)).astype(np.int32),
        "lengths": rng.integers(seq_len // 2, seq_len + 1, n).astype(np.int32),
        "prompt_lengths": np.full(n, seq_len // 4, np.int32),
        "top_logp": np.log(probs[..., ::-1]).astype(np.float16),
        "top_ids": rng.integers(0, tcfg.vocab_size, (n, seq_len, top_k)).astype(np.int32)}


if __name__ == "__main__":
    main()
