"""Time the on-device draft-tree builder (`jetspec_jax.draft.tree`) alone: the sorted builder and
the best-first pop loop (build_trees uses the loop only on the CPU, for top2gap and small
trees), optionally another revision.

Each timed call runs `--inner` builds inside one jitted `lax.fori_loop`, so dispatch cancels;
a row reports the median over `--repeats` calls (after warm-up) divided by `--inner`. Every
build depends on the loop index through a runtime zero, so XLA cannot hoist it out of the loop.
`--compare REV` adds `build_trees` of `git show REV:jetspec_jax/draft/tree.py` (or of a file path),
loaded as a module of its own.

  python -m bench.bench_tree_build --out bench/results/tree_build/tree_build_cpu.json
  python -m bench.bench_tree_build --methods accum_logp top2gap chain --compare HEAD
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

import jax
import jax.numpy as jnp
import numpy as np

from jetspec_jax.draft import tree
from bench.common.results_io import command_line, write_json
from bench.common.timing import median_seconds


def forced(loop: bool):
    """build_trees, with the loop (True) or the sorted builder (False) for every method."""
    def build(roots, lp, tk, *, budget, method):
        static = {**tree._statics(budget, method, *lp.shape[1:]), "loop": loop}
        return tree._grow_batch(roots, lp, tk, tree.tree_caps(lp, method), **static)
    return build


def load_build_trees(rev: str):
    """build_trees of tree.py at a git revision (or in a file), as a module of its own."""
    if os.path.exists(rev):
        source = Path(rev).read_text()
    else:
        source = subprocess.run(["git", "show", f"{rev}:jetspec_jax/draft/tree.py"], cwd=ROOT,
                                check=True, capture_output=True, text=True).stdout
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tree_compare.py"
        path.write_text(source)
        spec = importlib.util.spec_from_file_location("tree_compare", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module.build_trees


def time_build(build, batch, budget, method, depth, width, inner, repeats, ancestors=True):
    """Median milliseconds of one build_trees-like `build` on draft-shaped random inputs."""
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(batch, depth, 1000)).astype(np.float32) * 3)
    lp, tk = tree.topk_from_logits(logits, width)
    roots = jnp.asarray(rng.integers(0, 1000, batch), jnp.int32)

    @jax.jit
    def run(roots, lp, tk, zero):
        def body(i, acc):
            t = build(roots + i * zero.astype(jnp.int32), lp - i * zero, tk, budget=budget,
                      method=method)
            acc = acc + t.parents.sum() + t.tokens.sum() + t.depths.sum()
            acc = acc + jnp.where(t.valid, t.scores, 0).sum().astype(jnp.int32)
            return acc + t.ancestors.sum() if ancestors else acc  # else XLA drops them
        return jax.lax.fori_loop(0, inner, body, jnp.int32(0))

    seconds = median_seconds(run, roots, lp, tk, jnp.float32(0), repeats=repeats, warmup=2)
    return seconds / inner * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--budgets", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--methods", nargs="+", default=["accum_logp"], choices=tree.METHODS)
    ap.add_argument("--depth", type=int, default=15)
    ap.add_argument("--width", type=int, default=7)
    ap.add_argument("--inner", type=int, default=20, help="builds per timed call")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--no-ancestors", action="store_true",
                    help="leave the [N, N] ancestor matrix out (XLA then skips computing it)")
    ap.add_argument("--compare", metavar="REV", help="also time build_trees of this rev / file")
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args()

    builds = {"sorted": forced(False), "loop": forced(True)}
    if args.compare:
        builds[args.compare] = load_build_trees(args.compare)
    rows = []
    for method in args.methods:
        for batch in args.batches:
            for budget in args.budgets:
                loop = tree._statics(budget, method, args.depth, args.width)["loop"]
                row = dict(method=method, batch=batch, budget=budget, depth=args.depth,
                           width=args.width, ancestors=not args.no_ancestors,
                           build_trees="loop" if loop else "sorted")
                for name, build in builds.items():
                    row[f"{name} ms"] = time_build(build, batch, budget, method, args.depth,
                                                   args.width, args.inner, args.repeats,
                                                   not args.no_ancestors)
                row["loop / sorted"] = row["loop ms"] / row["sorted ms"]
                rows.append(row)
                print(row, file=sys.stderr)

    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c])
                                for c in cols) + " |")
    if args.out:
        device = jax.devices()[0]
        write_json(args.out, dict(
            device=f"{device.platform}: {device.device_kind}",
            date=datetime.date.today().isoformat(),
            command=command_line(),
            inner=args.inner, repeats=args.repeats, rows=rows))


if __name__ == "__main__":
    main()
