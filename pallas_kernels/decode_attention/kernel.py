"""Split-K decode attention (flash-decoding), Pallas with the Triton lowering.

Decode is cache attention with T = 1: the query sees slots [0, prefix_len] (its own key sits
at slot prefix_len). A single sequence has only K (KV heads) independent pieces of work, far
fewer than the GPU's SMs, so the KV range of each (batch, KV head) is cut into `splits`
chunks processed by separate programs; the partial results (normalized output and
log-sum-exp per split) are merged in a small XLA epilogue. Chunks are sized from each
sequence's own length at run time, so ragged batches keep every program busy and no slot
beyond prefix_len is read. The G query heads sharing a KV head are the rows of one tile.

A paged cache (`paged.Pages`) is read in place: the program gets its row of the block table
and its KV head of the pool, and each step of block_k slots (block_k dividing the block size)
loads from the physical block holding them.

The pieces of a program (`split_range`, `attend_slots`, `store_partial`) and of the launch
(`launch_shape`, `partial_outputs`, `merge_splits`) are shared with `fused.py`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels import common
from pallas_kernels.paged import Pages
from pallas_kernels.decode_attention.config import DecodeConfig, decode_config


def _cdiv(x, c: int):
    return lax.div(x + (c - 1), c)


def padded_head_dim(head_dim: int) -> int:
    return max(16, common.next_pow2(head_dim))


@dataclasses.dataclass(frozen=True)
class HeadLayout:
    """How a program reads the head dim H. Scores sum over query parts: part i is the columns
    [part_starts[i], part_starts[i] + part_len), zero-padded to part_width (one part, the whole
    head, here; the two RoPE halves in the fused kernel, which cannot concatenate them in
    registers). V and the output are value_width (H padded to a power of two) wide."""

    head_dim: int
    part_starts: tuple[int, ...]
    part_len: int
    part_width: int
    value_width: int

    @classmethod
    def whole(cls, head_dim: int) -> HeadLayout:
        hp = padded_head_dim(head_dim)
        return cls(head_dim, (0,), head_dim, hp, hp)

    @classmethod
    def halves(cls, head_dim: int) -> HeadLayout:
        half = head_dim // 2
        return cls(head_dim, (0, half), half, padded_head_dim(half), padded_head_dim(head_dim))

    @property
    def block_width(self) -> int:
        """Width of the blocks the columns are read from: reads past H are masked, but their
        static extent must lie inside the block."""
        return max(self.value_width, self.part_starts[-1] + self.part_width)

    def part_ok(self):
        """[1, part_width] column mask, None without padding."""
        return _cols_ok(self.part_width, self.part_len)

    def value_ok(self):
        return _cols_ok(self.value_width, self.head_dim)


def _cols_ok(width: int, used: int):
    return None if width == used else (lax.iota(jnp.int32, width) < used)[None, :]


def split_range(kv_len, num_splits: int, block_k: int):
    """(start, n): this program's share [start, start + n) of the slots [0, kv_len), split
    `num_splits` ways along grid axis 2 in whole blocks (trailing splits may be empty)."""
    chunk = _cdiv(_cdiv(kv_len, num_splits), block_k) * block_k
    start = pl.program_id(2) * chunk
    return start, jnp.maximum(jnp.minimum(chunk, kv_len - start), 0)


def empty_state(rows: int, width: int):
    """Online-softmax state (acc, running max, running sum) before any key."""
    return (jnp.zeros((rows, width), jnp.float32),
            jnp.full((rows,), common.NEG_INIT, jnp.float32),
            jnp.zeros((rows,), jnp.float32))


def attend_slots(state, q_parts, k_ref, v_ref, start, n, *, layout: HeadLayout, block_k: int,
                 qk_scale: float, precision, interpret: bool, table_ref=None):
    """Folds cache slots [start, start + n) of k_ref / v_ref [S, H] into the online-softmax
    state of the query rows (q_parts as in `HeadLayout`; logits in base 2, qk_scale includes
    log2 e). Reads no slot outside the range. Paged: k_ref / v_ref [num_blocks, block_size, H]
    read through table_ref [max_blocks], start a multiple of block_k."""
    part_ok, value_ok = layout.part_ok(), layout.value_ok()

    def scores(lead, row, row_ok):
        s = None
        for q, col in zip(q_parts, layout.part_starts):
            k = common.load_rows(k_ref, row, block_k, layout.part_width, part_ok, row_ok,
                                 col=col, lead=lead)
            d = common.kernel_dot(q, k, trans_b=True, precision=precision, upcast=interpret)
            s = d if s is None else s + d
        return s * qk_scale

    def step(i, carry, masked):
        acc, m_i, l_i = carry
        pos = start + i * block_k
        row_ok = (i * block_k + lax.iota(jnp.int32, block_k) < n) if masked else None
        lead, row = common.block_row(k_ref, table_ref, pos)
        s = scores(lead, row, row_ok)
        if masked:
            s = jnp.where(row_ok[None, :], s, -jnp.inf)
        m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
        alpha = jnp.exp2(m_i - m_new)
        p = jnp.exp2(s - m_new[:, None])
        l_new = l_i * alpha + jnp.sum(p, axis=1)
        v = common.load_rows(v_ref, row, block_k, layout.value_width, value_ok, row_ok,
                             lead=lead)
        pv = common.kernel_dot(p.astype(v.dtype), v, precision=precision, upcast=interpret)
        acc = acc * alpha[:, None] + pv
        return acc, m_new, l_new

    n_full = lax.div(n, block_k)
    state = lax.fori_loop(0, n_full, functools.partial(step, masked=False), state)
    return lax.fori_loop(n_full, _cdiv(n, block_k), functools.partial(step, masked=True), state)


def store_partial(o_ref, lse_ref, state):
    """Writes the split's normalized output and log2-sum-exp2 (-inf if it saw no key)."""
    acc, m_i, l_i = state
    seen = l_i > 0
    o_ref[...] = acc / jnp.where(seen, l_i, 1.0)[:, None]
    lse_ref[...] = jnp.where(seen, m_i + jnp.log2(jnp.where(seen, l_i, 1.0)), -jnp.inf)


def _kernel(len_ref, q_ref, k_ref, v_ref, *refs, layout, block_k, num_splits, scale,
            precision, interpret):
    *table_ref, o_ref, lse_ref = refs  # paged: the row of the block table first
    kv_len = len_ref[()] + 1  # prefix plus the new key at slot prefix_len
    start, n = split_range(kv_len, num_splits, block_k)
    state = empty_state(*q_ref.shape)
    state = attend_slots(state, (q_ref[...],), k_ref, v_ref, start, n, layout=layout,
                         block_k=block_k, qk_scale=scale * common.LOG2E, precision=precision,
                         interpret=interpret, table_ref=table_ref[0] if table_ref else None)
    store_partial(o_ref, lse_ref, state)


def launch_shape(q, kv_heads: int, kv_len: int, config: DecodeConfig | None):
    """(config, padded rows, splits) for q [B, 1, N, H] against a cache [B, K, S, H]."""
    b, _, n, h = q.shape
    cfg = config or decode_config(n // kv_heads, h, batch=b, kv_len=kv_len, dtype=q.dtype)
    rows = max(cfg.block_h, 16, common.next_pow2(n // kv_heads))
    if cfg.num_splits is not None:
        return cfg, rows, cfg.num_splits
    splits = common.auto_num_splits(b * kv_heads, max(kv_len, cfg.block_k), cfg.block_k,
                                    min_blocks_per_split=cfg.min_blocks_per_split)
    return cfg, rows, splits


def partial_outputs(batch: int, kv_heads: int, splits: int, rows: int, width: int):
    """(out_specs, out_shape) of the per-split partial outputs [B, K, splits, rows, width] and
    log2-sum-exps [B, K, splits, rows] (float32), program (b, h, s) writing its own block."""
    specs = [
        pl.BlockSpec((None, None, None, rows, width), lambda bi, hi, si: (bi, hi, si, 0, 0)),
        pl.BlockSpec((None, None, None, rows), lambda bi, hi, si: (bi, hi, si, 0)),
    ]
    shapes = [
        jax.ShapeDtypeStruct((batch, kv_heads, splits, rows, width), jnp.float32),
        jax.ShapeDtypeStruct((batch, kv_heads, splits, rows), jnp.float32),
    ]
    return specs, shapes


def merge_splits(o, lse, num_q_heads: int, head_dim: int, dtype):
    """The XLA epilogue: partial outputs -> [B, 1, N, H] in dtype."""
    out = common.combine_splits(o, lse, split_axis=2).astype(dtype)  # [B, K, rows, width]
    return common.unpack_rows(out, 1, num_q_heads, head_dim)


def supported(q, kv_heads: int) -> str | None:
    b, t, n, h = q.shape
    if t != 1:
        return f"decode kernel needs T == 1, got T={t}"
    if n % kv_heads:
        return f"num_q_heads {n} not a multiple of num_kv_heads {kv_heads}"
    if h > 256:
        return f"head_dim {h} > 256"
    return None


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def decode_attention(q, k_cache, v_cache, prefix_len, block_mask=None, *,
                     config: DecodeConfig | None = None, interpret: bool = False):
    """Cache attention for T = 1 (see `tree_attention.reference`): q [B, 1, N, H];
    k_cache/v_cache [B, K, S, H] or `paged.Pages`; prefix_len [B]. block_mask, if given, must
    be all true ([B, 1, 1]: a query always sees its own key) and is ignored."""
    paged = isinstance(k_cache, Pages)
    kh = (k_cache.pool if paged else k_cache).shape[1]
    why = supported(q, kh)
    if why is not None:
        raise NotImplementedError(f"decode attention: {why}")
    b, _, n, h = q.shape
    cfg, bh, ns = launch_shape(q, kh, k_cache.num_slots if paged else k_cache.shape[2], config)
    layout = HeadLayout.whole(h)
    hp = layout.value_width
    block_k, cache, cache_specs = common.cache_operands(
        k_cache, v_cache, cfg.block_k, cfg.block_k, hp, interpret, "decode attention")

    qr = common.pack_rows(q, kh, bh, hp)  # [B, K, bh, hp]
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    kernel = functools.partial(_kernel, layout=layout, block_k=block_k, num_splits=ns,
                               scale=h ** -0.5, precision=precision, interpret=interpret)
    out_specs, out_shape = partial_outputs(b, kh, ns, bh, hp)
    len_spec = pl.BlockSpec((None,), lambda bi, hi, si: (bi,))
    q_spec = pl.BlockSpec((None, None, bh, hp), lambda bi, hi, si: (bi, hi, 0, 0))
    o, lse = pl.pallas_call(
        kernel,
        grid=(b, kh, ns),
        in_specs=[len_spec, q_spec, *cache_specs],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=pltr.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="decode_attention_splitk",
    )(prefix_len.astype(jnp.int32), qr, *cache)
    return merge_splits(o, lse, n, h, q.dtype)
