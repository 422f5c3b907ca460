"""Portable cache/tree attention kernel: Pallas with the Triton lowering (any NVIDIA GPU).

Flash-attention style. Grid (B, K, row blocks, splits). The G query heads that share a KV
head are packed with the T queries into rows r = t * G + g, so one program reads each K/V
block once for all of them. Each program:
  1. walks its share of the fully visible prefix [0, prefix_len) in KV blocks of block_k
     (full blocks unmasked, the ragged tail with a masked load: nothing beyond prefix_len is
     read);
  2. (last split only) walks the T block keys at slots prefix_len + j in blocks of block_kb,
     up to the row block's extent, testing visibility against the bit-packed mask rows
     (uint32 words [B, T, ceil(T/32)]) or the causal rule;
with an online softmax in float32 (exp2 domain). With one split the normalized output is
written directly; with several, per-split outputs and log-sum-exps are merged afterwards.

A paged cache (`paged.Pages`) is read in place through the program's row of the block table:
the prefix in steps of block_k slots (a divisor of the block size: each step lies in one
block), the block keys, which start anywhere, by gathering each slot from its block.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels import common
from pallas_kernels.paged import Pages
from pallas_kernels.tree_attention import mask as mask_lib
from pallas_kernels.tree_attention.config import PortableConfig, portable_config


def _cdiv(x, c: int):
    return lax.div(x + (c - 1), c)


def _kernel(prefix_ref, extent_ref, words_ref, q_ref, k_ref, v_ref, *refs, num_queries,
            group, head_dim, block_q, block_k, block_kb, num_splits, causal, scale,
            precision, interpret, paged):
    table_ref, out_refs = (refs[0], refs[1:]) if paged else (None, refs)
    t_total, g = num_queries, group
    hp = q_ref.shape[-1]
    rb = pl.program_id(2)
    sp = pl.program_id(3)
    prefix = prefix_ref[()]

    head_ok = None if hp == head_dim else (lax.iota(jnp.int32, hp) < head_dim)[None, :]
    q = q_ref[...]
    qk_scale = scale * common.LOG2E

    def load_kv(ref, start, size, row_ok, aligned):
        """aligned: start a multiple of size (block_k), so a paged step lies in one block."""
        if table_ref is None or aligned:
            lead, row = common.block_row(ref, table_ref, start)
            return common.load_rows(ref, row, size, hp, head_ok, row_ok, lead=lead)
        return common.gather_rows(ref, table_ref, start, size, hp, head_ok, row_ok)

    def step(start, size, carry, row_ok, visible, aligned=True):
        acc, m_i, l_i = carry
        k = load_kv(k_ref, start, size, row_ok, aligned)
        s = common.kernel_dot(q, k, trans_b=True, precision=precision, upcast=interpret)
        s = s * qk_scale  # [bq, size] f32
        if visible is not None:
            s = jnp.where(visible, s, -jnp.inf)
        m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
        alpha = jnp.exp2(m_i - m_new)
        p = jnp.exp2(s - m_new[:, None])
        l_new = l_i * alpha + jnp.sum(p, axis=1)
        v = load_kv(v_ref, start, size, row_ok, aligned)
        pv = common.kernel_dot(p.astype(v.dtype), v, precision=precision, upcast=interpret)
        return acc * alpha[:, None] + pv, m_new, l_new

    carry = (
        jnp.zeros((block_q, hp), jnp.float32),
        jnp.full((block_q,), common.NEG_INIT, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
    )

    # 1. Prefix slots [0, prefix): this split's chunk (a multiple of block_k).
    if num_splits == 1:
        p_start = jnp.int32(0)
        p_len = prefix
    else:
        chunk = _cdiv(_cdiv(prefix, num_splits), block_k) * block_k
        p_start = sp * chunk
        p_len = jnp.maximum(jnp.minimum(chunk, prefix - p_start), 0)
    n_full = lax.div(p_len, block_k)
    n_all = _cdiv(p_len, block_k)

    def full_body(i, c):
        return step(p_start + i * block_k, block_k, c, None, None)

    def tail_body(i, c):
        off = i * block_k + lax.iota(jnp.int32, block_k)
        ok = off < p_len
        return step(p_start + i * block_k, block_k, c, ok, ok[None, :])

    carry = lax.fori_loop(0, n_full, full_body, carry)
    carry = lax.fori_loop(n_full, n_all, tail_body, carry)

    # 2. The T block keys at slots prefix + j, visible per the mask rows.
    rows = rb * block_q + lax.iota(jnp.int32, block_q)
    t_of_row = jnp.minimum(lax.div(rows, g), t_total - 1)
    if causal:
        extent = jnp.minimum(lax.div((rb + 1) * block_q - 1, g) + 1, t_total)
    else:
        extent = extent_ref[()]
    n_block = _cdiv(extent, block_kb)
    if num_splits > 1:
        n_block = jnp.where(sp == num_splits - 1, n_block, 0)

    def block_body(i, c):
        j = i * block_kb + lax.iota(jnp.int32, block_kb)
        j_ok = j < t_total
        if causal:
            vis = (j[None, :] <= t_of_row[:, None]) & j_ok[None, :]
        else:
            n_words = words_ref.shape[-1]
            w_idx = jnp.minimum(lax.div(j, mask_lib.WORD_BITS), n_words - 1)
            ti = jnp.broadcast_to(t_of_row[:, None], (block_q, block_kb))
            wi = jnp.broadcast_to(w_idx[None, :], (block_q, block_kb))
            words = words_ref[ti, wi]  # [bq, bkb] int32 gather (L1-resident)
            shift = lax.rem(j, mask_lib.WORD_BITS)
            bits = lax.shift_right_logical(words, jnp.broadcast_to(shift[None, :], words.shape))
            vis = ((bits & 1) != 0) & j_ok[None, :]
        return step(prefix + i * block_kb, block_kb, c, j_ok, vis, aligned=False)

    acc, m_i, l_i = lax.fori_loop(0, n_block, block_body, carry)

    seen = l_i > 0
    out = acc / jnp.where(seen, l_i, 1.0)[:, None]
    if num_splits == 1:
        (o_ref,) = out_refs
        o_ref[...] = out.astype(o_ref.dtype)
    else:
        o_ref, lse_ref = out_refs
        o_ref[...] = out
        lse_ref[...] = jnp.where(seen, m_i + jnp.log2(jnp.where(seen, l_i, 1.0)), -jnp.inf)


def supported(q, kh: int) -> str | None:
    """None if the portable kernel serves these shapes (kh KV heads), else the reason."""
    b, t, n, h = q.shape
    if n % kh:
        return f"num_q_heads {n} not a multiple of num_kv_heads {kh}"
    if h > 256:
        return f"head_dim {h} > 256"
    if jnp.dtype(q.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16),
                                  jnp.dtype(jnp.float32)):
        return f"dtype {q.dtype}"
    return None


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def cache_attention_portable(q, k_cache, v_cache, prefix_len, block_mask=None, *,
                             config: PortableConfig | None = None, interpret: bool = False):
    """Same contract as `reference.cache_attention_reference` (caches dense or `Pages`).
    block_mask: None (causal), bool [B, T, T], or bit-packed uint32 [B, T, ceil(T/32)]."""
    paged = isinstance(k_cache, Pages)
    kh = (k_cache.pool if paged else k_cache).shape[1]
    why = supported(q, kh)
    if why is not None:
        raise NotImplementedError(f"portable cache attention: {why}")
    b, t, n, h = q.shape
    s = k_cache.num_slots if paged else k_cache.shape[2]
    g = n // kh
    rows = t * g
    cfg = config or portable_config(rows, h, batch=b, num_queries=t, kv_len=s,
                                    dtype=q.dtype)
    if cfg.block_kb % mask_lib.WORD_BITS:
        raise ValueError("block_kb must be a multiple of 32")
    block_q = cfg.block_q
    nrb = common.cdiv(rows, block_q)
    rp = nrb * block_q
    hp = max(16, common.next_pow2(h))
    causal = block_mask is None

    block_k, cache, cache_specs = common.cache_operands(
        k_cache, v_cache, cfg.block_k, max(cfg.block_k, cfg.block_kb), hp, interpret,
        "portable cache attention")

    qr = common.pack_rows(q, kh, rp, hp)
    prefix_len = prefix_len.astype(jnp.int32)
    if causal:
        words = jnp.zeros((b, 1, 1), jnp.int32)
        extent = jnp.zeros((b, nrb), jnp.int32)
    else:
        packed = mask_lib.as_packed(block_mask)
        extent = mask_lib.row_block_extent(packed, t, g, block_q, nrb)
        words = lax.bitcast_convert_type(packed, jnp.int32)
    nw = words.shape[-1]

    if cfg.num_splits is not None:
        ns = cfg.num_splits
    else:
        ns = common.auto_num_splits(b * kh * nrb, s, block_k)

    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    kernel = functools.partial(
        _kernel, num_queries=t, group=g, head_dim=h, block_q=block_q, block_k=block_k,
        block_kb=cfg.block_kb, num_splits=ns, causal=causal, scale=h ** -0.5,
        precision=precision, interpret=interpret, paged=paged)

    in_specs = [
        pl.BlockSpec((None,), lambda bi, hi, ri, si: (bi,)),
        pl.BlockSpec((None, None), lambda bi, hi, ri, si: (bi, ri)),
        pl.BlockSpec((None, words.shape[1], nw), lambda bi, hi, ri, si: (bi, 0, 0)),
        pl.BlockSpec((None, None, block_q, hp), lambda bi, hi, ri, si: (bi, hi, ri, 0)),
        *cache_specs,
    ]
    if ns == 1:
        out_shape = [jax.ShapeDtypeStruct((b, kh, rp, hp), q.dtype)]
        out_specs = [pl.BlockSpec((None, None, block_q, hp), lambda bi, hi, ri, si: (bi, hi, ri, 0))]
    else:
        out_shape = [jax.ShapeDtypeStruct((b, kh, ns, rp, hp), jnp.float32),
                     jax.ShapeDtypeStruct((b, kh, ns, rp), jnp.float32)]
        out_specs = [
            pl.BlockSpec((None, None, None, block_q, hp), lambda bi, hi, ri, si: (bi, hi, si, ri, 0)),
            pl.BlockSpec((None, None, None, block_q), lambda bi, hi, ri, si: (bi, hi, si, ri)),
        ]
    outs = pl.pallas_call(
        kernel,
        grid=(b, kh, nrb, ns),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=pltr.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="tree_attention_portable",
    )(prefix_len, extent, words, qr, *cache)
    if ns == 1:
        o = outs[0]
    else:
        o = common.combine_splits(outs[0], outs[1], split_axis=2).astype(q.dtype)
    return common.unpack_rows(o, t, n, h)
