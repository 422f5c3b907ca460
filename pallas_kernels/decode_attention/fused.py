"""One decode step of an attention layer in one kernel: q/k RMSNorm, RoPE, the KV-cache write
of the new token and split-K decode attention (Pallas, Triton lowering).

Unfused, XLA runs the two norms, the two RoPEs, the query packing and the two cache writes as
about seven tiny kernels per layer, each launch-bound.
Here they are the prologue and epilogue of the attention programs, which load the raw
projections anyway.

Grid (B, K, splits) as in `kernel.py`; program (b, h, s):
  1. loads the G raw query heads of KV head h as the rows of one tile and applies RMSNorm and
     RoPE the way `layers.rms_norm` and `layers.rope` do (float32 math, cast to the dtype after
     each). The RoPE halves stay two query parts (`HeadLayout.halves`): Triton cannot
     concatenate them, so each logit is the sum of two half-width dots.
  2. attends over its share of the cached slots [0, write_start[b]) (the old keys only);
  3. if it is the writer (s = splits - 1), it also normalizes and rotates the new key, folds
     the new token into its online softmax as the first key (weight 1, its logit the running
     max) from registers, and stores the new key and value at slot write_start[b].
The per-split partial results are merged by the XLA epilogue of `decode_attention`.

No race: every program reads only slots < write_start[b]; slot write_start[b] is written by
exactly one program per (b, h) and read by none. The caches are aliased to the outputs
(input_output_aliases), so under jit with donated caches XLA updates them in place; the
program's output block is the whole [S, H] cache of (b, h), but on the GPU a Triton program
writes only what it stores. The writer is the last split because its share is the smallest
(shares are whole blocks rounded up, so it is often empty), and because interpret mode runs
programs in grid order: the writer runs after every reader of its (b, h), so a read of slot
write_start[b] would see the NaN the tests put there.

The new key written equals the unfused path's bit for bit when the kernel's float32 sum of
squares, rsqrt and RoPE products round as XLA's do: checked in interpret mode (where XLA
evaluates both); on a GPU, Triton's reduction order, rsqrt and FMA contraction may differ from
XLA's fusions, so on a GPU tests/test_fused_decode.py compares with a tolerance.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels import common
from pallas_kernels.decode_attention.config import DecodeConfig
from pallas_kernels.decode_attention.kernel import (HeadLayout, attend_slots, empty_state,
                                                    launch_shape, merge_splits, partial_outputs,
                                                    split_range, store_partial)


def rope_cos_sin(positions, head_dim: int, theta: float):
    """cos, sin [B, H/2] float32 of the RoPE angles at positions [B], computed as `layers.rope`
    does (once per step, shared by every layer)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles = positions.astype(jnp.float32)[:, None] * inv_freq
    return jnp.cos(angles), jnp.sin(angles)


def _load_cols(ref, rows: int, width: int, col: int, cols_ok, row_ok=None):
    return common.load_rows(ref, 0, rows, width, cols_ok, row_ok, col=col)


def _rope_halves(ref, rows: int, row_ok, weight_ref, cos, sin, *, layout: HeadLayout,
                 eps: float):
    """Raw projection rows ref [rows, H] -> the two RoPE halves [rows, part_width] in the
    ref's dtype, after RMSNorm by weight_ref [1, H] if given. Op for op `layers.rms_norm`
    then `layers.rope`, so that the new key matches the unfused cache write bit for bit."""
    dtype, width, ok = ref.dtype, layout.part_width, layout.part_ok()
    halves = [_load_cols(ref, rows, width, c, ok, row_ok).astype(jnp.float32)
              for c in layout.part_starts]
    if weight_ref is not None:
        x = _load_cols(ref, rows, layout.value_width, 0, layout.value_ok(), row_ok)
        x = x.astype(jnp.float32)
        inv_rms = lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) / layout.head_dim + eps)
        halves = [((half * inv_rms) * _load_cols(weight_ref, 1, width, c, ok).astype(jnp.float32))
                  .astype(dtype).astype(jnp.float32)
                  for half, c in zip(halves, layout.part_starts)]
    x1, x2 = halves
    return (x1 * cos - x2 * sin).astype(dtype), (x2 * cos + x1 * sin).astype(dtype)


def _new_token_state(q_parts, k_parts, v, is_writer, qk_scale: float):
    """The writer starts its online softmax with the new token alone (logit = running max,
    weight 1, acc = its value); the other splits start empty."""
    logit = None
    for q, k in zip(q_parts, k_parts):
        d = jnp.sum(q.astype(jnp.float32) * k.astype(jnp.float32), axis=1)
        logit = d if logit is None else logit + d
    acc0, m0, l0 = empty_state(q_parts[0].shape[0], v.shape[1])
    acc = jnp.where(is_writer, jnp.broadcast_to(v.astype(jnp.float32), acc0.shape), acc0)
    return acc, jnp.where(is_writer, logit * qk_scale, m0), jnp.where(is_writer, 1.0, l0)


def _store(ref, value, mask):
    if mask is None:
        ref[...] = value
    else:
        pltr.store(ref, value, mask=mask)


def _store_new_token(k_out_ref, v_out_ref, slot, k_parts, v, layout: HeadLayout):
    """Writes the new key (its two RoPE halves) and value at cache row `slot`."""
    row = pl.ds(slot, 1)
    for part, col in zip(k_parts, layout.part_starts):
        _store(k_out_ref.at[row, pl.ds(col, layout.part_width)], part, layout.part_ok())
    _store(v_out_ref.at[row, pl.ds(0, layout.value_width)], v, layout.value_ok())


def _kernel(*refs, has_q_norm, has_k_norm, layout: HeadLayout, group, slots, block_k,
            num_splits, eps, scale, precision, interpret):
    ws_ref, cos_ref, sin_ref, q_ref, kn_ref, vn_ref, *refs = refs
    qw_ref = refs.pop(0) if has_q_norm else None
    kw_ref = refs.pop(0) if has_k_norm else None
    k_ref, v_ref, o_ref, lse_ref, k_out_ref, v_out_ref = refs
    rows = o_ref.shape[0]
    # Clamped like write_slots' dynamic_update_slice: the store can never leave the cache.
    slot = jnp.clip(ws_ref[()], 0, slots - 1)
    is_writer = pl.program_id(2) == num_splits - 1

    width, ok = layout.part_width, layout.part_ok()
    cos, sin = (_load_cols(r, 1, width, 0, ok) for r in (cos_ref, sin_ref))
    row_ok = None if rows == group else lax.iota(jnp.int32, rows) < group
    rope = functools.partial(_rope_halves, cos=cos, sin=sin, layout=layout, eps=eps)
    q_parts = rope(q_ref, rows, row_ok, qw_ref)
    k_parts = rope(kn_ref, 1, None, kw_ref)
    v_new = _load_cols(vn_ref, 1, layout.value_width, 0, layout.value_ok())

    qk_scale = scale * common.LOG2E
    state = _new_token_state(q_parts, k_parts, v_new, is_writer, qk_scale)
    start, n = split_range(slot, num_splits, block_k)
    state = attend_slots(state, q_parts, k_ref, v_ref, start, n, layout=layout, block_k=block_k,
                         qk_scale=qk_scale, precision=precision, interpret=interpret)
    store_partial(o_ref, lse_ref, state)

    @pl.when(is_writer)
    def _():
        _store_new_token(k_out_ref, v_out_ref, slot, k_parts, v_new, layout)


def supported(q, k_new, v_new, k_cache, v_cache, write_start, cos, sin, q_norm=None,
              k_norm=None) -> str | None:
    """Why the fused kernel cannot serve these shapes and dtypes, or None."""
    if q.ndim != 4 or q.shape[1] != 1:
        return f"needs q [B, 1, N, H] (T == 1), got {q.shape}"
    b, _, n, h = q.shape
    if k_cache.ndim != 4:
        return f"needs caches [B, K, S, H], got {k_cache.shape}"
    kh, s = k_cache.shape[1], k_cache.shape[2]
    if n % kh:
        return f"num_q_heads {n} not a multiple of num_kv_heads {kh}"
    if h > 256 or h % 2:
        return f"head_dim {h} > 256 or odd"
    if k_cache.shape != (b, kh, s, h) or v_cache.shape != k_cache.shape:
        return f"caches {k_cache.shape} / {v_cache.shape} do not match q {q.shape}"
    if k_new.shape != (b, 1, kh, h) or v_new.shape != k_new.shape:
        return f"k_new / v_new {k_new.shape} / {v_new.shape} are not [B, 1, K, H]"
    dtypes = {x.dtype for x in (k_new, v_new, k_cache, v_cache)}
    if dtypes != {q.dtype}:
        return f"dtype mismatch: q {q.dtype}, k/v and caches {sorted(map(str, dtypes))}"
    if write_start.shape != (b,):
        return f"write_start {write_start.shape} is not [B]"
    if cos.shape != (b, h // 2) or sin.shape != cos.shape:
        return f"cos / sin {cos.shape} / {sin.shape} are not [B, H/2] = {(b, h // 2)}"
    for name, w in (("q_norm", q_norm), ("k_norm", k_norm)):
        if w is not None and w.shape != (h,):
            return f"{name} {w.shape} is not [H]"
    return None


def _operands(q, k_new, v_new, k_cache, v_cache, write_start, cos, sin, q_norm, k_norm,
              layout: HeadLayout, rows: int, block_k: int):
    """The pallas_call's operands (free reshapes of the inputs, no copies) and their block
    specs on the grid (B, K, splits); and the spec of a cache. Blocks may be larger than the
    arrays (G query heads padded to `rows`, H to the block width): every load's static extent
    must lie inside its block, and masks keep the reads and writes inside the array."""
    b, _, n, h = q.shape
    kh, s = k_cache.shape[1:3]
    width = layout.block_width  # H, or more when H or H/2 is no power of two

    def per_head(num_rows):  # num_rows x width of (batch, KV head)
        return pl.BlockSpec((None, None, num_rows, width), lambda bi, hi, si: (bi, hi, 0, 0))

    per_seq = pl.BlockSpec((None, 1, layout.part_width), lambda bi, hi, si: (bi, 0, 0))
    # A cache shorter than one block still gets a block_k-slot block.
    cache_spec = per_head(max(s, block_k))
    args = [write_start.astype(jnp.int32), cos.reshape(b, 1, h // 2), sin.reshape(b, 1, h // 2),
            q.reshape(b, kh, n // kh, h), k_new.reshape(b, kh, 1, h), v_new.reshape(b, kh, 1, h)]
    specs = [pl.BlockSpec((None,), lambda bi, hi, si: (bi,)), per_seq, per_seq,
             per_head(rows), per_head(1), per_head(1)]
    for w in (q_norm, k_norm):
        if w is not None:
            args.append(w.reshape(1, h))
            specs.append(pl.BlockSpec((1, width), lambda bi, hi, si: (0, 0)))
    return args + [k_cache, v_cache], specs + [cache_spec, cache_spec], cache_spec


@functools.partial(jax.jit, static_argnames=("eps", "config", "interpret"))
def fused_decode_attention(q, k_new, v_new, k_cache, v_cache, write_start, cos, sin,
                           q_norm=None, k_norm=None, *, eps: float = 1e-6,
                           config: DecodeConfig | None = None, interpret: bool = False):
    """Decode attention of one layer with its prologue fused: q [B, 1, N, H] and k_new / v_new
    [B, 1, K, H] are the raw projections; caches [B, K, S, H] (q's dtype); write_start [B]
    (< S); cos / sin [B, H/2] from `rope_cos_sin`; q_norm / k_norm [H] RMSNorm weights or
    None. Equivalent to rms_norm (if weights) + rope on q and k, write_slots of k and v at
    write_start, then cache attention seeing slots [0, write_start].

    Returns (out [B, 1, N, H] in q's dtype, k_cache, v_cache with the new key and value
    written). The caches are updated in place when the caller donates them."""
    why = supported(q, k_new, v_new, k_cache, v_cache, write_start, cos, sin, q_norm, k_norm)
    if why is not None:
        raise NotImplementedError(f"fused decode attention: {why}")
    b, _, n, h = q.shape
    _, kh, s, _ = k_cache.shape
    cfg, rows, ns = launch_shape(q, kh, s, config)
    layout = HeadLayout.halves(h)

    args, in_specs, cache_spec = _operands(q, k_new, v_new, k_cache, v_cache, write_start, cos,
                                           sin, q_norm, k_norm, layout, rows, cfg.block_k)
    out_specs, out_shape = partial_outputs(b, kh, ns, rows, layout.value_width)
    out_specs += [cache_spec, cache_spec]
    out_shape += [jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype)] * 2
    kernel = functools.partial(
        _kernel, has_q_norm=q_norm is not None, has_k_norm=k_norm is not None, layout=layout,
        group=n // kh, slots=s, block_k=cfg.block_k, num_splits=ns, eps=eps, scale=h ** -0.5,
        precision=lax.Precision.HIGHEST if q.dtype == jnp.float32 else None,
        interpret=interpret)
    o, lse, k_cache, v_cache = pl.pallas_call(
        kernel,
        grid=(b, kh, ns),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases={len(args) - 2: 2, len(args) - 1: 3},
        compiler_params=pltr.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="fused_decode_attention_splitk",
    )(*args)
    return merge_splits(o, lse, n, h, q.dtype), k_cache, v_cache
