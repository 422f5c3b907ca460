"""Model FLOPs of a training step, for tokens/s and model-FLOP utilisation (MFU) in the log.

Counted as the step computes them: matmuls only (2 FLOPs a multiply-add), attention over every
key it scores (the dense masked training attention, causal target attention in full). A step
is the frozen target's forward over B x T tokens with its LM head at every position (no LM head
with a stored top-K teacher, no target at all with a feature cache), and the head's forward
and backward (3x its forward, the usual estimate; the recomputation of checkpointed anchor
chunks is not model work and is not counted).

    flops = step_flops(tcfg, dcfg, batch=32, seq_len=448, anchors=256, anchor_chunk=32)
    mfu = flops["step"] / seconds_per_step / 790e12
"""

from __future__ import annotations

import time

from jetspec_jax.draft.head import DraftConfig
from jetspec_jax.model.config import ModelConfig


def layer_flops(cfg: ModelConfig, layer: int, tokens: int, keys: int) -> int:
    """One decoder layer over `tokens` queries, each scoring `keys` keys."""
    d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    proj = 2 * tokens * d * h * (2 * n + 2 * k)  # q, o; k, v
    attn = 4 * tokens * keys * n * h  # scores and the weighted sum
    if cfg.layer_is_moe(layer):
        mlp = 2 * tokens * d * (3 * cfg.moe_intermediate_size * cfg.experts_per_token
                                + cfg.num_experts)
    else:
        mlp = 2 * tokens * d * 3 * cfg.intermediate_size
    return proj + attn + mlp


def step_flops(tcfg: ModelConfig, dcfg: DraftConfig, *, batch: int, seq_len: int, anchors: int,
               anchor_chunk: int | None = None, teacher: str = "online") -> dict[str, int]:
    """Model FLOPs of one training step of a block head: {"target", "head", "step"} where
    target is the target's forward (teacher "online": every layer and the LM head; "stored":
    the layers up to the last tap; "features": none), head the head's forward and step =
    target + 3 * head."""
    b, t, blk = batch, seq_len, dcfg.block_size
    d = tcfg.hidden_size
    v = tcfg.vocab_size if dcfg.draft_vocab is None else len(dcfg.draft_vocab)
    slots = b * anchors * (blk - 1)
    layers = {"online": tcfg.num_layers, "stored": max(dcfg.tap_layers) + 1, "features": 0}
    target = sum(layer_flops(tcfg, i, b * t, t) for i in range(layers[teacher]))
    if teacher == "online":
        target += 2 * b * t * d * tcfg.vocab_size  # the teacher's LM head
    c = dcfg.layers
    q = b * anchors * blk
    chunk = min(anchor_chunk or anchors, anchors)
    head = 2 * b * t * len(dcfg.tap_layers) * d * d  # fc over the context
    for i in range(c.num_layers):
        head += 2 * b * t * d * c.head_dim * 2 * c.num_kv_heads  # context k, v
        head += layer_flops(c, i, q, t + chunk * blk)  # block queries: context + chunk slots
    head += 2 * slots * d * v  # the LM head (its draft vocabulary's rows) at the drafted slots
    return {"target": target, "head": head, "step": target + 3 * head}


class Throughput:
    """Steps timed between log points (the caller leaves a call's first, compiling step out):
    tokens and model FLOPs per step (flops None: not counted) over peak, the rate of all
    devices together."""

    def __init__(self, tokens: int, flops: int | None, peak: float):
        self.tokens, self.flops, self.peak = tokens, flops, peak
        self.reset()

    def reset(self):
        self.start, self.steps = time.time(), 0

    def row(self) -> dict:
        if not self.steps:
            return {}
        sec = (time.time() - self.start) / self.steps
        out = {"step_s": sec, "tok_s": self.tokens / sec}
        if self.flops:
            out["mfu"] = self.flops / sec / self.peak
        return out
