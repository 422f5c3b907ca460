"""Self-distillation loss of the draft head.

Per sequence, A anchors are drawn in the response region; the block at anchor a drafts depths
d = 1..blk-1 and slot d is trained towards the target's own next-token distribution for
position a + d (the target's logits at a + d - 1): forward KL(target || head), which keeps
the target's whole distribution (better for tree drafting than hard labels). Depth d may be
weighted by exp(-(d-1)/gamma): early depths decide most of the accepted length. With a top-K
teacher (stored with the data, `teacher.py`, or computed online for a head with a draft
vocabulary) the KL is over those K tokens and the rest's mass (`slot_topk_kl`). Every kind of
head (`head_kinds.py`) is trained the same way on its own drafts of the D depths.
The anchors run in chunks (`map_anchor_chunks`): the head's logits and the teacher's
log-probabilities of one chunk, [B, chunk, blk-1, V] in float32, are all a step holds at a time
beside the teacher's [B, T, V], so recipe-sized anchor counts (256-512 per sequence) fit; the
result equals one pass over all anchors.

Mask token: a head either owns a learned `mask_embed` (`DraftConfig.mask_token_id=None`) or
uses the target's embedding of a reserved id. We recommend the learned embedding for new
heads: nothing has to be reserved or added to the target's vocabulary (SmolLM2 has no spare
mask token), and the head can learn the input that suits it; a reserved id is only needed
to load heads in the reference format, whose Qwen3 heads use an added `<|MASK|>` token.
Both train the same way here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jetspec_jax.draft.drafter import HeadConfig
from jetspec_jax.model.config import ModelConfig
from jetspec_jax.model import target
from jetspec_jax.model.kernels import Kernels
from jetspec_jax.model.layers import XLA
from jetspec_jax.train import head_kinds
from jetspec_jax.train.head_forward import sample_anchors, target_pass
from jetspec_jax.train.teacher import top_k_teacher


TINY = 1e-12  # a floor under the probabilities whose logarithm the top-K KL takes


def vocab_index(dcfg, vocab_size: int):
    """[V] int32: the head's logit column of each token id, -1 outside its draft vocabulary;
    None for a head over the whole vocabulary."""
    if getattr(dcfg, "draft_vocab", None) is None:  # heads of any kind; only block heads have one
        return None
    ids = jnp.asarray(dcfg.draft_vocab, jnp.int32)
    return jnp.full((vocab_size,), -1, jnp.int32).at[ids].set(
        jnp.arange(ids.shape[0], dtype=jnp.int32))


def depth_weights(depth: int, gamma: float | None, depth1_weight: float | None = None):
    """[depth] weights exp(-(d-1)/gamma) for d = 1..depth (all ones when gamma is None);
    depth1_weight, when given, replaces depth 1's weight (its share of the loss is then
    depth1_weight / sum of the weights)."""
    if gamma is None:
        w = jnp.ones((depth,), jnp.float32)
    else:
        w = jnp.exp(-jnp.arange(depth, dtype=jnp.float32) / gamma)
    return w if depth1_weight is None else w.at[0].set(depth1_weight)


def _reduce(kl, hit, valid, weights):
    """Per-slot kl, hit [B, A, J]; valid [B, A, J]; weights [J] -> (weighted mean KL,
    metrics)."""
    m = valid.astype(jnp.float32)
    w = weights * m
    count = jnp.sum(m, axis=(0, 1))  # [J]
    per_depth = lambda x: jnp.sum(x * m, axis=(0, 1)) / jnp.maximum(count, 1)  # noqa: E731
    loss = jnp.sum(w * kl) / jnp.maximum(jnp.sum(w), 1e-6)
    return loss, {"kl": per_depth(kl), "acc": per_depth(hit), "count": count}


def slot_kl(head, teacher):
    """head, teacher: logits [..., V] -> per-slot KL(teacher || head) and argmax hit [...]."""
    return slot_logp_kl(head, jax.nn.log_softmax(teacher.astype(jnp.float32), axis=-1))


def slot_logp_kl(head, logp):
    """As `slot_kl` with the teacher already as float32 log-probabilities logp [..., V]."""
    logq = jax.nn.log_softmax(head.astype(jnp.float32), axis=-1)
    kl = jnp.sum(jnp.exp(logp) * (logp - logq), axis=-1)
    return kl, jnp.argmax(head, axis=-1) == jnp.argmax(logp, axis=-1)


def slot_topk_kl(head, top_logp, top_ids, vocab_index=None):
    """As `slot_kl` with a top-K teacher top_logp, top_ids [..., K] (log-probabilities under the
    target's full softmax, most likely first) and head logits [..., V'] over the head's
    vocabulary: the KL between the two distributions coarsened to K + 1 outcomes, each of the
    teacher's K tokens and "the rest" (its tail, and any of the K outside a draft vocabulary).
    With K = V and no draft vocabulary it is the full KL. vocab_index [V] int32: the head's
    column of each token id, -1 outside its draft vocabulary (None: every id is its column).
    hit: the head's most likely token is the teacher's."""
    logq = jax.nn.log_softmax(head.astype(jnp.float32), axis=-1)
    top_logp = top_logp.astype(jnp.float32)
    cols = top_ids if vocab_index is None else vocab_index[top_ids]
    inside = cols >= 0
    logq_k = jnp.take_along_axis(logq, jnp.maximum(cols, 0), axis=-1)
    p_k = jnp.where(inside, jnp.exp(top_logp), 0.0)
    kl = jnp.sum(jnp.where(inside, p_k * (top_logp - logq_k), 0.0), axis=-1)
    # The head's rest as a logsumexp over its other columns, not 1 - sum(q_k): that difference
    # loses all precision as q_rest -> 0 and its gradient p_rest / q_rest explodes; this one's
    # gradient stays bounded by p_rest. The teacher's rest is clipped (a top-K stored in
    # reduced precision can sum past 1).
    width = logq.shape[-1]
    taken = jax.vmap(lambda c: jnp.zeros((width,), bool).at[c].set(True, mode="drop"))(
        jnp.where(inside, cols, width).reshape(-1, cols.shape[-1])).reshape(logq.shape)
    logq_rest = jax.nn.logsumexp(jnp.where(taken, -jnp.inf, logq), axis=-1)
    p_rest = jnp.clip(1.0 - jnp.sum(p_k, axis=-1), 0.0, 1.0)
    kl = kl + p_rest * (jnp.log(jnp.maximum(p_rest, TINY))
                        - jnp.maximum(logq_rest, jnp.log(TINY)))
    return kl, jnp.argmax(head, axis=-1) == cols[..., 0]  # -1 (outside) never hits


def distill_loss(head, teacher, valid, gamma: float | None = None):
    """head, teacher: logits [B, A, J, V]; valid [B, A, J]. -> (weighted mean KL, metrics):
    per-depth KL and accuracy (head argmax == target argmax) over valid slots."""
    return _reduce(*slot_kl(head, teacher), valid, depth_weights(head.shape[2], gamma))


def map_anchor_chunks(fn, chunk: int | None, *xs):
    """fn over anchors in chunks: xs are [B, A, ...] arrays, fn(*pieces [B, C, ...]) returns
    [B, C, ...] arrays. With A > chunk the chunks run one after another (lax.map) under
    jax.checkpoint, so the step holds one chunk's logits at a time, forward and backward
    (the backward recomputes each chunk); the blocks of different anchors never see each
    other, so the result equals one pass over all anchors."""
    a = xs[0].shape[1]
    if chunk is None or chunk >= a:
        return fn(*xs)
    if a % chunk:
        raise ValueError(f"anchor chunk {chunk} must divide the {a} anchors per sequence")
    n = a // chunk

    def split(x):  # [B, A, ...] -> [n, B, chunk, ...]
        return jnp.moveaxis(x.reshape(x.shape[0], n, chunk, *x.shape[2:]), 1, 0)

    out = jax.lax.map(lambda p: jax.checkpoint(fn)(*p), tuple(split(x) for x in xs))
    return jax.tree.map(lambda y: jnp.moveaxis(y, 0, 1).reshape(y.shape[1], a, *y.shape[3:]),
                        out)


def at_positions(x, pos):
    """x [B, T, ...] at pos [B, A, J] (clipped to T-1) -> [B, A, J, ...]."""
    b, a, j = pos.shape
    idx = jnp.clip(pos, 0, x.shape[1] - 1).reshape(b, a * j, *([1] * (x.ndim - 2)))
    return jnp.take_along_axis(x, idx, axis=1).reshape(b, a, j, *x.shape[2:])


def _anchor_slots(key, batch, num_anchors: int, depth: int):
    """Anchors [B, A], the teacher positions of their slots pos [B, A, J] (slot d predicts
    the token at pos + 1) and which slots are supervised, valid [B, A, J]."""
    lengths = batch["lengths"]
    anchors, ok = sample_anchors(key, lengths, batch["prompt_lengths"], num_anchors,
                                 batch["tokens"].shape[1])
    pos = anchors[:, :, None] + jnp.arange(depth, dtype=jnp.int32)  # predicts pos + 1
    valid = ok[:, :, None] & (pos + 1 < lengths[:, None, None])
    return anchors, pos, valid


def teacher_outputs(tparams, tcfg: ModelConfig, dcfg: HeadConfig, batch, key,
                    num_anchors: int, top_k: int | None = None, kernels: Kernels = XLA):
    """The frozen target's part of a training step (no gradient flows into it), run online.

    batch: {"tokens" [B, T], "lengths" [B], "prompt_lengths" [B]}. -> dict with taps
    [B, T, k*D], anchors [B, A], the teacher positions of their slots pos [B, A, blk-1], valid
    [B, A, blk-1], and the teacher: its log-probabilities at every position logp [B, T, V]
    (float32), or with top_k its K most likely tokens at the anchors' slots, as
    `stored_teacher_outputs` gives them. logp is made once per position and gathered per anchor
    chunk in `head_loss`: the slots repeat each position about A*(blk-1)/T times (8x at 256
    anchors over 448 tokens), and [B, A, blk-1, V] at once would dwarf the rest. kernels: the
    target pass's (`head_forward.target_pass`)."""
    hidden, taps = target_pass(tparams, tcfg, batch["tokens"], dcfg.tap_layers, kernels)
    logits = target.lm_head(tparams, tcfg, hidden)
    anchors, pos, valid = _anchor_slots(key, batch, num_anchors, dcfg.depth)
    out = {"taps": taps, "anchors": anchors, "pos": pos, "valid": valid}
    if top_k is None:
        out["logp"] = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
    else:
        top_logp, top_ids = top_k_teacher(logits, top_k)
        out |= {"top_logp": at_positions(top_logp, pos), "top_ids": at_positions(top_ids, pos)}
    return jax.lax.stop_gradient(out)


def stored_teacher_outputs(tparams, tcfg: ModelConfig, dcfg: HeadConfig, batch,
                           key, num_anchors: int, kernels: Kernels = XLA):
    """`teacher_outputs` with a top-K teacher stored beside the tokens: batch also holds
    top_logp, top_ids [B, T, K] (`data.make_dataset(teacher_top_k=K)` or a feature cache,
    `features.py`) and, from a feature cache, taps [B, T, k*D]; without taps the target runs
    for them (no LM head, and XLA drops the layers after the last tapped one). The same key
    draws the same anchors. -> dict with taps (in the target's dtype), anchors, valid and the
    teacher top_logp, top_ids [B, A, blk-1, K] at the anchors' slots. kernels: as in
    `teacher_outputs`."""
    anchors, pos, valid = _anchor_slots(key, batch, num_anchors, dcfg.depth)
    if "taps" in batch:
        taps = batch["taps"].astype(tparams["embed"].dtype)
    else:
        taps = target_pass(tparams, tcfg, batch["tokens"], dcfg.tap_layers, kernels)[1]
    return jax.lax.stop_gradient({
        "taps": taps, "anchors": anchors, "valid": valid,
        "top_logp": at_positions(batch["top_logp"], pos),
        "top_ids": at_positions(batch["top_ids"], pos)})


def head_loss(dparams, dcfg: HeadConfig, tparams, tcfg: ModelConfig, tokens, teach,
              gamma: float | None = None, *, depth1_weight: float | None = None,
              anchor_chunk: int | None = None, attention: str = "reference"):
    """Loss and metrics of the head (of any kind, `head_kinds.of_config`) on the anchors
    chosen in `teacher_outputs` (full teacher logits, or top-K) or `stored_teacher_outputs`
    (top-K).

    anchor_chunk: anchors per chunk (`map_anchor_chunks`; must divide A); None: all at once.
    attention: the head's attention, "reference" or "cudnn" (`trainer.head_attention`)."""
    anchors, valid = teach["anchors"], teach["valid"]
    logits = head_kinds.of_config(dcfg).training_logits(dparams, dcfg, tparams, tcfg,
                                                         teach["taps"], tokens, attention)
    if "logp" in teach:
        if getattr(dcfg, "draft_vocab", None) is not None:
            raise ValueError("a head with a draft vocabulary trains on a top-K teacher: "
                             "pass top_k to teacher_outputs")
        fn = lambda anc, pos: slot_logp_kl(  # noqa: E731
            logits(anc), at_positions(teach["logp"], pos))
        kl, hit = map_anchor_chunks(fn, anchor_chunk, anchors, teach["pos"])
    else:
        index = vocab_index(dcfg, tcfg.vocab_size)
        fn = lambda anc, lp, ids: slot_topk_kl(logits(anc), lp, ids, index)  # noqa: E731
        kl, hit = map_anchor_chunks(fn, anchor_chunk, anchors, teach["top_logp"],
                                    teach["top_ids"])
    return _reduce(kl, hit, valid, depth_weights(kl.shape[2], gamma, depth1_weight))
