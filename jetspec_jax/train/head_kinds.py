"""The kinds of head the trainer knows, by name (`TrainConfig.head`), and what it needs of
each: its config, params, training forward, checkpoints and FLOP count. The block heads
("jetspec": causal, "dflash": bidirectional) are registered here; another kind plugs in with
`register` (the lab's baselines do so when `lab` is imported)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

from jetspec_jax.draft.head import DraftConfig, draft_config_for, draft_specs
from jetspec_jax.io import heads as head_io
from jetspec_jax.train.head_forward import head_context, head_logits
from jetspec_jax.train.throughput import step_flops


@dataclasses.dataclass(frozen=True)
class HeadKind:
    config_type: type  # the head's config class (static under jit)
    checkpoint_kind: str  # the `kind` its checkpoints record
    make_config: Callable  # (TrainConfig, target ModelConfig) -> config
    specs: Callable  # config -> param specs
    # (dparams, dcfg, tparams, tcfg, taps [B, T, k*D], tokens [B, T], attention) -> a function
    # of anchors [B, A] giving draft logits [B, A, depth, V] (chunks of anchors share what it
    # made once); attention: "reference" or "cudnn" (`trainer.head_attention`: block heads only)
    training_logits: Callable
    save: Callable  # (path, params, dcfg, *, metadata, overwrite, max_bytes=None) -> Path
    load: Callable  # path -> (dcfg, params)
    convert: Callable  # (src, dst, *, dtype, overwrite, max_bytes) -> Path
    step_flops: Callable | None = None  # `throughput.step_flops`; None: not counted


HEADS: dict[str, HeadKind] = {}


def register(name: str, kind: HeadKind) -> None:
    HEADS[name] = kind


def of_config(dcfg) -> HeadKind:
    """The kind of a head, by its config's type."""
    for kind in HEADS.values():
        if type(dcfg) is kind.config_type:
            return kind
    raise TypeError(f"no head kind registered for {type(dcfg).__name__}")


def of_checkpoint(kind: str | None) -> HeadKind:
    """The kind whose checkpoints record `kind`; the block heads' for theirs and for heads in
    the reference format (no kind)."""
    return next((k for k in HEADS.values() if k.checkpoint_kind == kind), HEADS["jetspec"])


def _block_config(cfg, tcfg, *, causal: bool) -> DraftConfig:
    dcfg = draft_config_for(tcfg, num_layers=cfg.head_layers, block_size=cfg.block_size,
                            num_taps=cfg.num_taps, mask_token_id=cfg.mask_token_id,
                            causal=causal)
    dcfg.check_target(tcfg)
    return dcfg


def _block_logits(dparams, dcfg, tparams, tcfg, taps, tokens, attention):
    ctx = head_context(dparams, dcfg, taps)  # the context K/V, made once for every chunk
    return lambda anchors: head_logits(dparams, dcfg, tparams, tcfg, taps, tokens, anchors,
                                       ctx=ctx, attention=attention)


for _name, _causal in (("jetspec", True), ("dflash", False)):
    register(_name, HeadKind(
        config_type=DraftConfig, checkpoint_kind=head_io.KIND,
        make_config=functools.partial(_block_config, causal=_causal), specs=draft_specs,
        training_logits=_block_logits, save=head_io.save_draft, load=head_io.read_any_draft,
        convert=functools.partial(head_io.convert_head, progress=True), step_flops=step_flops))
