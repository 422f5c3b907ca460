"""Memory per device for Qwen3-8B and Qwen3-30B-A3B on 1, 2, 4 and 8 H200s, from the ParamSpec
trees, `jax.eval_shape` of the caches and the sharding rules (`jetspec_jax/model/sharding.py`): the
shard shape of every abstract array on an abstract mesh. Nothing is allocated; runs anywhere.

  python -m bench.memory_dryrun   # prints the tables, writes bench/results/memory/memory_dryrun.md

Counted per device, bf16 weights and caches:
  weights   the target's shards
  KV        the target cache for `context` tokens, batch B
  draft     a reference-sized head (5 layers, block 16, 5 taps): its weights + its context cache
  spec      speculative working memory at budget 256: the cache slots a round writes past the
            context (target and head, `working_slots`), verify logits [B, 256, V] float32 and
            taps [B, 256, 5 D]
Not counted: XLA temporaries (see the XLA-attention column), the CUDA context (~0.5-1 GiB),
allocator fragmentation. Usable per H200: ~139 GiB (nvidia-smi reports 143,771 MiB).
"""

from __future__ import annotations

import math
from pathlib import Path

import jax
import jax.numpy as jnp


from bench.common.results_io import write_text

from jetspec_jax.decode.speculative import working_slots
from jetspec_jax.draft import head as draft_head
from jetspec_jax.model import config, params as P, sharding, target

GIB = 2**30
USABLE_GIB = 139
BUDGET, BLOCK, HEAD_LAYERS, TAPS = 256, 16, 5, 5
CONTEXTS, BATCHES = (8192, 32768), (1, 32)
MESHES = {  # model -> mesh specs, one per device count (30B-A3B on 8 also with experts on ep)
    "qwen3-8b": ("1", "tp=2", "tp=4", "tp=8"),
    "qwen3-30b-a3b": ("1", "tp=2", "tp=4", "tp=8", "tp=4,ep=2"),
}
RESULT = Path(__file__).parent / "results" / "memory" / "memory_dryrun.md"


def shard_bytes(abstract, shardings) -> int:
    """Bytes one device holds of a tree of abstract arrays under a matching sharding tree."""
    return sum(math.prod(s.shard_shape(a.shape)) * a.dtype.itemsize
               for a, s in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings)))


def weights(specs, mesh) -> int:
    abstract = P.abstract_params(specs, jnp.bfloat16)
    return shard_bytes(abstract, sharding.param_shardings(specs, mesh))


def cache(allocate, batch, slots, mesh) -> int:
    abstract = jax.eval_shape(lambda: allocate(batch, slots, jnp.bfloat16))
    return shard_bytes(abstract, sharding.state_shardings(abstract, mesh))


def activation(shape, axes, dtype, mesh) -> int:
    spec = sharding.logical_spec(axes, shape, mesh.shape)
    return shard_bytes(jax.ShapeDtypeStruct(shape, dtype),
                       jax.sharding.NamedSharding(mesh, spec))


def row(cfg, spec, context, batch) -> dict:
    mesh = sharding.abstract_mesh(spec)
    dcfg = draft_head.draft_config_for(cfg, num_layers=HEAD_LAYERS, block_size=BLOCK,
                                       num_taps=TAPS)
    extra = working_slots(BUDGET, BLOCK)
    tcache = lambda b, s, d: target.allocate_cache(cfg, b, s, d)  # noqa: E731
    dcache = lambda b, s, d: draft_head.allocate_cache(dcfg, b, s, d)  # noqa: E731
    kv = cache(tcache, batch, context, mesh)
    draft = weights(draft_head.draft_specs(dcfg), mesh) + cache(dcache, batch, context, mesh)
    spec_work = (cache(tcache, batch, context + extra, mesh) - kv
                 + cache(dcache, batch, context + extra, mesh) - cache(dcache, batch, context, mesh)
                 + activation((batch, BUDGET, cfg.vocab_size), ("batch", None, "vocab"),
                              jnp.float32, mesh)
                 + activation((batch, BUDGET, TAPS * cfg.hidden_size), ("batch", None, "embed"),
                              jnp.bfloat16, mesh))
    # XLA (reference) attention of the verify pass holds one layer's scores [B, N, T, S] f32.
    scores = activation((batch, cfg.num_heads, BUDGET, context + extra),
                        ("batch", "heads", None, "cache_slots"), jnp.float32, mesh)
    w = weights(P.target_specs(cfg), mesh)
    total = w + kv + draft + spec_work
    return dict(model=cfg.name, devices=mesh.size, mesh=spec, context=context, batch=batch,
                weights=w / GIB, kv=kv / GIB, draft=draft / GIB, spec=spec_work / GIB,
                total=total / GIB, xla_scores=scores / GIB, fits=total / GIB <= USABLE_GIB)


def report(rows) -> str:
    combos = [(c, b) for c in CONTEXTS for b in BATCHES]
    lines = ["# Memory per device (dry run, `bench/memory_dryrun.py`)", "",
             f"GiB per device, bf16 weights and KV caches; usable per H200 ~{USABLE_GIB} GiB. "
             f"Speculative settings: budget {BUDGET}, block {BLOCK}, a {HEAD_LAYERS}-layer head "
             f"with {TAPS} taps. Computed from the ParamSpec trees and the sharding rules "
             "(shard shapes of abstract arrays), nothing allocated.", "",
             "## Total per device (weights + KV + draft head + speculative working memory)", "",
             "| model | GPUs | mesh | weights | "
             + " | ".join(f"ctx {c // 1024}k, B {b}" for c, b in combos) + " |",
             "|---|---|---|---|" + "---|" * len(combos)]
    for (model, spec), group in _groups(rows):
        cells = [f"{r['total']:.1f}" + ("" if r["fits"] else " (no)") for r in group]
        lines.append(f"| {model} | {group[0]['devices']} | {spec} | {group[0]['weights']:.1f} | "
                     + " | ".join(cells) + " |")
    lines += ["", "(no): over the usable memory.", "",
              "## Breakdown", "",
              "| model | mesh | ctx | B | weights | KV | draft | spec | total | "
              "+XLA attention scores |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['mesh']} | {r['context'] // 1024}k | {r['batch']} | "
                     f"{r['weights']:.2f} | {r['kv']:.2f} | {r['draft']:.2f} | {r['spec']:.2f} | "
                     f"{r['total']:.2f} | {r['xla_scores']:.2f} |")
    lines += ["", "## Replicated because the mesh axis does not divide them", ""]
    for name, specs in MESHES.items():
        cfg = config.preset(name)
        for spec in specs:
            mesh = sharding.abstract_mesh(spec)
            notes = sharding.replicated_dims(P.target_specs(cfg), mesh.shape)
            lines.append(f"- {name} on `{spec}`: {'; '.join(notes) or 'nothing'}")
    lines += ["", "Columns: *spec* = cache slots one round writes past the context (target and "
              f"head, {working_slots(BUDGET, BLOCK)} slots) + verify logits (float32, vocab-"
              "sharded) + taps. *+XLA attention scores*: with XLA attention (what a multi-device "
              "mesh uses) the verify pass also holds one layer's [B, N, T, S] float32 scores, "
              "not in the total; the Pallas kernels hold none."]
    return "\n".join(lines) + "\n"


def _groups(rows):
    keys = list(dict.fromkeys((r["model"], r["mesh"]) for r in rows))
    return [(k, [r for r in rows if (r["model"], r["mesh"]) == k]) for k in keys]


def main():
    rows = [row(config.preset(name), spec, c, b) for name, specs in MESHES.items()
            for spec in specs for c in CONTEXTS for b in BATCHES]
    text = report(rows)
    print(text)
    write_text(RESULT, text)
    print(f"wrote {RESULT}")


if __name__ == "__main__":
    main()
