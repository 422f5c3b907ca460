"""Baselines kept beside the product for comparison. They plug into the core through its
registries, and the core never imports them:

  eagle.py           the EAGLE-style autoregressive draft head and its drafter
                     (`jetspec_jax.draft.drafter.register`)
  eagle_training.py  its training chain and checkpoints, the trainer's head kind "eagle"
                     (`jetspec_jax.train.head_kinds.register`)
  __main__.py        `python -m lab ...`: the `jetspec` command with these heads

Importing `lab` registers them all."""

from lab import eagle, eagle_training  # noqa: F401  (registered on import)
