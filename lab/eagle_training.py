"""Training the EAGLE-style head (`eagle.py`: the head, its dynamic tree and its drafter): the
unrolled "training-time test" chain (`eagle_logits`) and its checkpoints (save, load,
convert), registered as the trainer's head kind "eagle" (`jetspec_jax.train.head_kinds`)."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp

from jetspec_jax.draft.head import dense_attention
from jetspec_jax.io.checkpoints import CheckpointError, carried_metadata, load_tree, save_tree
from jetspec_jax.io.shards import is_shard_export, read_shards, save_shards
from jetspec_jax.model.config import ModelConfig
from jetspec_jax.model.params import check_params, unflatten
from jetspec_jax.train.head_kinds import HeadKind, register
from lab.eagle import EagleConfig, eagle_config_for, eagle_specs, fuse_taps, logits, shift, step


KIND = "eagle_head"


def save_eagle(path, eparams, ecfg: EagleConfig, *, metadata=None, overwrite=False,
               max_bytes=None):
    """max_bytes: as flat safetensors files of at most that size (`io/shards.py`)."""
    check_params(eparams, eagle_specs(ecfg), "EAGLE head params to save")
    if max_bytes is not None:
        return save_shards(path, eparams, ecfg.to_dict(), kind=KIND, metadata=metadata,
                           max_bytes=max_bytes, overwrite=overwrite)
    return save_tree(path, eparams, ecfg.to_dict(), kind=KIND, metadata=metadata,
                     overwrite=overwrite)


def load_eagle(path) -> tuple[EagleConfig, dict]:
    """-> (ecfg, eparams) of a `save_eagle` checkpoint (a directory, or its shard files)."""
    if not isinstance(path, (str, Path)) or (is_shard_export(path)
                                             and not (Path(path) / "metadata.json").exists()):
        kind, config, flat, _ = read_shards(path)
        if kind != KIND:
            raise CheckpointError(f"{path} holds a {kind!r} head, not an {KIND!r}")
        ecfg = EagleConfig.from_dict(config)
        return ecfg, unflatten(flat, eagle_specs(ecfg), f"EAGLE head {path}")
    eparams, config, _ = load_tree(path, kind=KIND)
    ecfg = EagleConfig.from_dict(config)
    check_params(eparams, eagle_specs(ecfg), f"EAGLE head {path}")
    return ecfg, eparams


def convert_eagle(src, dst, *, dtype=None, overwrite=False, max_bytes=None):
    """A `save_eagle` checkpoint cast to dtype (e.g. float32 -> bfloat16 to ship) at dst; its
    metadata (training settings) is kept."""
    ecfg, eparams = load_eagle(src)
    if dtype is not None:
        eparams = jax.tree.map(lambda a: a.astype(dtype), eparams)
    kept = (read_shards(src)[3] if not (Path(src) / "metadata.json").exists()
            else carried_metadata(src, KIND))
    return save_eagle(dst, eparams, ecfg, metadata={**kept, "source": str(src)},
                      overwrite=overwrite, max_bytes=max_bytes)


# --- training: the unrolled chain along the data's own tokens ---------------------------------

def eagle_logits(eparams, ecfg: EagleConfig, tparams, tcfg: ModelConfig, taps, tokens, anchors):
    """Draft logits [B, A, D, V] for depths 1..D after each anchor [B, A], the path following
    tokens [B, T]; the same computation as drafting that path at inference."""
    b, t = tokens.shape
    a = anchors.shape[1]
    pos = jnp.arange(t, dtype=jnp.int32)
    causal = jnp.broadcast_to(pos[None, :, None] >= pos[None, None, :], (b, t, t))
    hid, (ck, cv) = step(eparams, ecfg, tparams, shift(fuse_taps(eparams, ecfg, taps)),
                         tokens, jnp.broadcast_to(pos, (b, t)),
                         lambda q, k, v: (dense_attention(q, k, v, causal), (k, v)))
    feat = jnp.take_along_axis(hid, anchors[:, :, None], axis=1)  # [B, A, D] root hidden
    ctx_visible = pos[None, None, :] <= anchors[:, :, None]  # [B, A, T]: up to the anchor
    own = jnp.eye(a, dtype=bool)[None]  # [1, A, A]: a chain sees only its own entries
    depth_hidden, chain_k, chain_v = [feat], [], []
    for j in range(1, ecfg.depth):
        positions = anchors + j
        tok = jnp.take_along_axis(tokens, jnp.minimum(positions, t - 1), axis=1)  # [B, A]

        def attend(q, k, v):
            keys = jnp.concatenate([ck, *chain_k, k], axis=1)
            vals = jnp.concatenate([cv, *chain_v, v], axis=1)
            vis = jnp.concatenate([ctx_visible] + [jnp.broadcast_to(own, (b, a, a))] * j, -1)
            return dense_attention(q, keys, vals, vis), (k, v)

        feat, (k, v) = step(eparams, ecfg, tparams, feat, tok, positions, attend)
        chain_k.append(k)
        chain_v.append(v)
        depth_hidden.append(feat)
    hidden = jnp.stack(depth_hidden, axis=2)  # [B, A, D, D_model]
    return logits(eparams, ecfg, tparams, tcfg, hidden.reshape(b, a * ecfg.depth, -1)).reshape(
        b, a, ecfg.depth, -1)


def _training_logits(eparams, ecfg: EagleConfig, tparams, tcfg: ModelConfig, taps, tokens,
                     attention):  # always "reference": TrainConfig refuses others for EAGLE
    del attention
    return lambda anchors: eagle_logits(eparams, ecfg, tparams, tcfg, taps, tokens, anchors)


def _config(cfg, tcfg: ModelConfig) -> EagleConfig:
    """The trainer's block_size - 1 depths; one layer whatever head_layers says."""
    return eagle_config_for(tcfg, num_taps=cfg.num_taps, depth=cfg.block_size - 1)


register("eagle", HeadKind(
    config_type=EagleConfig, checkpoint_kind=KIND, make_config=_config, specs=eagle_specs,
    training_logits=_training_logits, save=save_eagle, load=load_eagle, convert=convert_eagle))
