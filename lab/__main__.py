"""`python -m lab COMMAND ...`: the `jetspec` command with the lab's heads registered:

    python -m lab train-draft --head eagle --data runs/data --out runs/eagle
    python -m lab convert --head runs/eagle/head runs/eagle-export --dtype bfloat16
"""

import sys

import lab  # noqa: F401  (registers the lab's heads)
from jetspec_jax.cli import main
from jetspec_jax.train.head_kinds import HEADS


def run(argv: list[str] | None = None) -> int:
    return main(argv, train_heads=tuple(HEADS))


if __name__ == "__main__":
    sys.exit(run())
