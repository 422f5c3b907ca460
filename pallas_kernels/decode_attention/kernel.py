"""Split-K decode attention (flash-decoding), Pallas with the Triton lowering.

Decode is cache attention with T = 1: the query sees slots [0, prefix_len] (its own key sits
at slot prefix_len). A single sequence has only K (KV heads) independent pieces of work, far
fewer than the GPU's SMs, so the KV range of each (batch, KV head) is cut into `splits`
chunks processed by separate programs; the partial results (normalized output and
log-sum-exp per split) are merged in a small XLA epilogue. Chunks are sized from each
sequence's own length at run time, so ragged batches keep every program busy and no slot
beyond prefix_len is read. The G query heads sharing a KV head are the rows of one tile.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels import common
from pallas_kernels.decode_attention.config import DecodeConfig, decode_config


def _cdiv(x, c: int):
    return lax.div(x + (c - 1), c)


def _kernel(len_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, head_dim, block_k, num_splits,
            scale, precision, interpret):
    bh, hp = q_ref.shape
    sp = pl.program_id(2)
    kv_len = len_ref[()] + 1  # prefix plus the new key at slot prefix_len

    head_ok = None if hp == head_dim else (lax.iota(jnp.int32, hp) < head_dim)[None, :]
    q = q_ref[...]
    qk_scale = scale * common.LOG2E

    chunk = _cdiv(_cdiv(kv_len, num_splits), block_k) * block_k
    start = sp * chunk
    n = jnp.maximum(jnp.minimum(chunk, kv_len - start), 0)

    def load_kv(ref, pos, row_ok):
        return common.load_rows(ref, pos, block_k, hp, head_ok, row_ok)

    def step(i, carry, masked):
        acc, m_i, l_i = carry
        pos = start + i * block_k
        row_ok = (i * block_k + lax.iota(jnp.int32, block_k) < n) if masked else None
        k = load_kv(k_ref, pos, row_ok)
        s = common.kernel_dot(q, k, trans_b=True, precision=precision, upcast=interpret) * qk_scale
        if masked:
            s = jnp.where(row_ok[None, :], s, -jnp.inf)
        m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
        alpha = jnp.exp2(m_i - m_new)
        p = jnp.exp2(s - m_new[:, None])
        l_new = l_i * alpha + jnp.sum(p, axis=1)
        v = load_kv(v_ref, pos, row_ok)
        pv = common.kernel_dot(p.astype(v.dtype), v, precision=precision, upcast=interpret)
        acc = acc * alpha[:, None] + pv
        return acc, m_new, l_new

    carry = (
        jnp.zeros((bh, hp), jnp.float32),
        jnp.full((bh,), common.NEG_INIT, jnp.float32),
        jnp.zeros((bh,), jnp.float32),
    )
    n_full = lax.div(n, block_k)
    carry = lax.fori_loop(0, n_full, functools.partial(step, masked=False), carry)
    acc, m_i, l_i = lax.fori_loop(n_full, _cdiv(n, block_k), functools.partial(step, masked=True),
                                  carry)
    seen = l_i > 0
    o_ref[...] = acc / jnp.where(seen, l_i, 1.0)[:, None]
    lse_ref[...] = jnp.where(seen, m_i + jnp.log2(jnp.where(seen, l_i, 1.0)), -jnp.inf)


def supported(q, k_cache) -> str | None:
    b, t, n, h = q.shape
    kh = k_cache.shape[1]
    if t != 1:
        return f"decode kernel needs T == 1, got T={t}"
    if n % kh:
        return f"num_q_heads {n} not a multiple of num_kv_heads {kh}"
    if h > 256:
        return f"head_dim {h} > 256"
    return None


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def decode_attention(q, k_cache, v_cache, prefix_len, block_mask=None, *,
                     config: DecodeConfig | None = None, interpret: bool = False):
    """Cache attention for T = 1 (see `tree_attention.reference`): q [B, 1, N, H];
    k_cache/v_cache [B, K, S, H]; prefix_len [B]. block_mask, if given, must be all true
    ([B, 1, 1]: a query always sees its own key) and is ignored."""
    why = supported(q, k_cache)
    if why is not None:
        raise NotImplementedError(f"decode attention: {why}")
    b, _, n, h = q.shape
    _, kh, s, _ = k_cache.shape
    g = n // kh
    cfg = config or decode_config(g, h, batch=b, kv_len=s, dtype=q.dtype)
    bh = max(cfg.block_h, 16, common.next_pow2(g))
    hp = max(16, common.next_pow2(h))
    if s < cfg.block_k:  # tiny cache: pad it so that every (masked) block load stays in bounds
        pad = ((0, 0), (0, 0), (0, cfg.block_k - s), (0, 0))
        k_cache, v_cache, s = jnp.pad(k_cache, pad), jnp.pad(v_cache, pad), cfg.block_k
    if cfg.num_splits is not None:
        ns = cfg.num_splits
    else:
        ns = common.auto_num_splits(b * kh, s, cfg.block_k,
                                    min_blocks_per_split=cfg.min_blocks_per_split)

    qr = common.pack_rows(q, kh, bh, hp)  # [B, K, bh, hp]
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    kernel = functools.partial(_kernel, head_dim=h, block_k=cfg.block_k, num_splits=ns,
                               scale=h ** -0.5, precision=precision, interpret=interpret)
    o, lse = pl.pallas_call(
        kernel,
        grid=(b, kh, ns),
        in_specs=[
            pl.BlockSpec((None,), lambda bi, hi, si: (bi,)),
            pl.BlockSpec((None, None, bh, hp), lambda bi, hi, si: (bi, hi, 0, 0)),
            pl.BlockSpec((None, None, s, hp), lambda bi, hi, si: (bi, hi, 0, 0)),
            pl.BlockSpec((None, None, s, hp), lambda bi, hi, si: (bi, hi, 0, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, bh, hp), lambda bi, hi, si: (bi, hi, si, 0, 0)),
            pl.BlockSpec((None, None, None, bh), lambda bi, hi, si: (bi, hi, si, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, kh, ns, bh, hp), jnp.float32),
            jax.ShapeDtypeStruct((b, kh, ns, bh), jnp.float32),
        ],
        compiler_params=pltr.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="decode_attention_splitk",
    )(prefix_len.astype(jnp.int32), qr, k_cache, v_cache)
    out = common.combine_splits(o, lse, split_axis=2).astype(q.dtype)  # [B, K, bh, hp]
    return common.unpack_rows(out, 1, n, h)
