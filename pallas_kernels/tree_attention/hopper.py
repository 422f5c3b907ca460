"""Hopper (sm_90) cache/tree attention with Pallas Mosaic GPU: wgmma + TMA.

One CTA (a single warpgroup) computes 64 packed rows (rows r = t * G + g, as in the portable
kernel) of one KV head, for one split of the prefix. K/V blocks of `block_k` slots stream
through `stages` shared-memory buffers by TMA, issued `stages - 1` steps ahead of use, with
one barrier per buffer for K and one for V. Per step: S = Q K^T (wgmma, f32 accumulator in
registers), online softmax in the exp2 domain, O += P V (wgmma with P from registers).

The step sequence is [full prefix blocks | ragged prefix tail (masked slot < end) | block
keys]; with split-K, each split takes an equal contiguous share of the whole sequence (masked
blocks included, so the split that holds the block keys is not the slowest). Block-key steps
start at prefix_len + i * block_k, clamped to S - block_k so the copy never leaves the cache
(columns that fall back into the prefix are masked out); visibility of block key j for row r
comes from the bit-packed mask: rows' words are loaded from shared memory as row vectors and
each column picks its word and bit.

Shapes it does not serve raise NotImplementedError (callers fall back to the portable
kernel): dtype other than bf16/f16, head_dim not in {64, 128}, S not a multiple of block_k.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels import common
from pallas_kernels.tree_attention import mask as mask_lib
from pallas_kernels.tree_attention.config import MosaicConfig, mosaic_config, mosaic_smem_bytes

ROWS = 64  # rows per warpgroup (wgmma M)


def default_config(q, k_cache) -> MosaicConfig:
    """Tuned or heuristic config for these shapes, with block_k 64 where the cache length is
    not a multiple of the chosen block_k."""
    b, t, n, h = q.shape
    _, kh, s, _ = k_cache.shape
    cfg = mosaic_config(t * (n // max(kh, 1)), h, batch=b, num_queries=t, kv_len=s,
                        dtype=q.dtype)
    if s % cfg.block_k and s % 64 == 0:
        cfg = dataclasses.replace(cfg, block_k=64)
    return cfg


def supported(q, k_cache, config: MosaicConfig | None = None) -> str | None:
    b, t, n, h = q.shape
    _, kh, s, _ = k_cache.shape
    if n % kh:
        return f"num_q_heads {n} not a multiple of num_kv_heads {kh}"
    cfg = config or default_config(q, k_cache)
    if h not in (64, 128):
        return f"head_dim {h} not in (64, 128)"
    if jnp.dtype(q.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype {q.dtype} (needs bf16/f16)"
    if k_cache.dtype != q.dtype:
        return "q and cache dtypes differ"
    if cfg.block_k % 64 or s % cfg.block_k or s < cfg.block_k:
        return f"cache length {s} not a multiple of block_k {cfg.block_k}"
    return None


def _build(*, b, kh, s, h, t, g, nrb, ns, causal, n_words, dtype, block_k, stages,
           interpret, pv_via_smem):
    interpret = bool(interpret)
    bk = block_k
    log2e = common.LOG2E
    qk_scale = (h ** -0.5) * log2e
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    tiling = plgpu.TilingTransform((8, 64))
    swizzle = plgpu.SwizzleTransform(128)
    n_word_chunks = bk // mask_lib.WORD_BITS + 1

    def body(prefix_ref, extent_ref, words_ref, q_ref, k_ref, v_ref, *refs):
        if ns == 1:
            (o_ref,) = refs[:1]
            lse_ref = None
            scratch = refs[1:]
        else:
            o_ref, lse_ref = refs[:2]
            scratch = refs[2:]
        del scratch
        rb = lax.axis_index("rb")
        hi = lax.axis_index("h")
        bs = lax.axis_index("bs")
        bi = lax.div(bs, jnp.int32(ns))
        sp = lax.rem(bs, jnp.int32(ns))
        r0 = rb * ROWS

        prefix = prefix_ref[bi]
        if causal:
            extent = jnp.minimum(lax.div(r0 + (ROWS - 1), jnp.int32(g)) + 1, t)
        else:
            extent = extent_ref[bi, rb]
        # Nominal blocks: [full blocks of [0, A) | mixed blocks from A], A = prefix rounded
        # down to block_k; the mixed ones (the ragged prefix tail plus the block keys) are
        # masked. Split sp takes the contiguous nominal blocks [first, first + n_total).
        # Every copy starts at a multiple of block_k (TMA into tiled shared memory needs it),
        # so mixed blocks near the end of the cache are clamped to S - block_k and columns
        # already covered by an earlier step are masked out.
        a_blocks = lax.div(prefix, jnp.int32(bk))
        n_mixed = lax.div(prefix + extent - a_blocks * bk + (bk - 1), jnp.int32(bk))
        total = a_blocks + n_mixed
        if ns == 1:
            first = jnp.int32(0)
            n_total = total
        else:
            per = lax.div(total + (ns - 1), jnp.int32(ns))
            first = sp * per
            n_total = jnp.maximum(jnp.minimum(per, total - first), 0)
        n_full = jnp.clip(a_blocks - first, 0, n_total)  # unmasked steps come first
        last_block = s // bk - 1

        def nominal_block(step):
            return first + step

        def src_start(step):
            return jnp.minimum(nominal_block(step), last_block) * bk

        def scoped(q_smem, k_smem, v_smem, w_smem, lse_smem, p_smem, q_bar, k_bar, v_bar):
            def fetch(step):
                slot = lax.rem(step, jnp.int32(stages))
                start = src_start(step)
                plgpu.copy_gmem_to_smem(k_ref.at[bi, hi, pl.ds(start, bk)], k_smem.at[slot],
                                        k_bar.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[bi, hi, pl.ds(start, bk)], v_smem.at[slot],
                                        v_bar.at[slot])

            plgpu.copy_gmem_to_smem(q_ref.at[bi, hi, pl.ds(r0, ROWS)], q_smem, q_bar.at[0])
            if not causal:
                plgpu.copy_gmem_to_smem(words_ref.at[bi, :, pl.ds(r0, ROWS)], w_smem, q_bar.at[1])
            for i in range(stages - 1):
                @pl.when(i < n_total)
                def _():
                    fetch(jnp.int32(i))
            plgpu.barrier_wait(q_bar.at[0])
            if not causal:
                plgpu.barrier_wait(q_bar.at[1])

            rows = plgpu.broadcasted_iota(jnp.int32, (ROWS, bk), 0, layout=plgpu.Layout.WGMMA)
            cols = plgpu.broadcasted_iota(jnp.int32, (ROWS, bk), 1, layout=plgpu.Layout.WGMMA)

            def visibility(step):
                start = src_start(step)
                slot_ids = start + cols
                fresh = slot_ids >= nominal_block(step) * bk  # not seen by an earlier step
                j = slot_ids - prefix  # block-key index of each column (< 0: prefix)
                in_block = (j >= 0) & (j < t)
                t_row = jnp.minimum(lax.div(r0 + rows, jnp.int32(g)), t - 1)
                if causal:
                    blk_ok = in_block & (j <= t_row)
                else:
                    jc = jnp.maximum(j, 0)
                    w_base = lax.div(jnp.maximum(start - prefix, 0), jnp.int32(mask_lib.WORD_BITS))
                    w_col = lax.div(jc, jnp.int32(mask_lib.WORD_BITS)) - w_base
                    word = jnp.zeros((ROWS, bk), jnp.int32)
                    for c in range(n_word_chunks):
                        wi = jnp.minimum(w_base + c, n_words - 1)
                        vec = plgpu.load(w_smem.at[wi], layout=row_layout)
                        word = jnp.where(w_col == c, lax.broadcast_in_dim(vec, (ROWS, bk), [0]),
                                         word)
                    bit = lax.shift_right_logical(word, lax.rem(jc, jnp.int32(mask_lib.WORD_BITS)))
                    blk_ok = in_block & ((bit & 1) != 0)
                return fresh & ((j < 0) | blk_ok)

            def kv_step(step, carry, masked):
                acc, m_i, l_i = carry
                slot = lax.rem(step, jnp.int32(stages))

                @pl.when(step + (stages - 1) < n_total)
                def _():
                    fetch(step + (stages - 1))

                plgpu.barrier_wait(k_bar.at[slot])

                def qk_fn(acc_ref):
                    plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
                    return acc_ref[...]

                sc = pl.run_scoped(qk_fn, plgpu.ACC((ROWS, bk), jnp.float32))
                sc = sc * qk_scale
                if masked:
                    sc = jnp.where(visibility(step), sc, -jnp.inf)
                m_new = jnp.maximum(m_i, sc.max(axis=1))
                alpha = jnp.exp2(m_i - m_new)
                p = jnp.exp2(sc - lax.broadcast_in_dim(m_new, sc.shape, [0]))
                l_i = l_i * alpha + p.sum(axis=1)
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                p16 = p.astype(dtype)
                plgpu.barrier_wait(v_bar.at[slot])

                if interpret or pv_via_smem:
                    # GPU interpret mode supports neither pre-initialized accumulators nor
                    # register operands of wgmma: P goes through shared memory and P V into a
                    # fresh accumulator that is added in registers (same result).
                    p_smem[...] = p16
                    plgpu.commit_smem()

                    def pv_fresh(acc_ref):
                        plgpu.wgmma(acc_ref, p_smem, v_smem.at[slot])
                        return acc_ref[...]

                    acc = acc + pl.run_scoped(pv_fresh, plgpu.ACC((ROWS, h), jnp.float32))
                else:
                    def pv_fn(acc_ref):
                        plgpu.wgmma(acc_ref, p16, v_smem.at[slot])

                    acc = pl.run_state(pv_fn)(plgpu.ACC.init(acc))
                return acc, m_new, l_i

            acc = plgpu.layout_cast(jnp.zeros((ROWS, h), jnp.float32), plgpu.Layout.WGMMA)
            m_i = plgpu.layout_cast(jnp.full((ROWS,), common.NEG_INIT, jnp.float32), row_layout)
            l_i = plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), row_layout)
            carry = (acc, m_i, l_i)
            carry = lax.fori_loop(0, n_full, functools.partial(kv_step, masked=False), carry)
            acc, m_i, l_i = lax.fori_loop(n_full, n_total,
                                          functools.partial(kv_step, masked=True), carry)

            seen = l_i > 0
            l_safe = jnp.where(seen, l_i, 1.0)
            out = acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])
            q_smem[...] = out.astype(dtype)
            if lse_ref is not None:
                lse_smem[...] = jnp.where(seen, m_i + jnp.log2(l_safe), -jnp.inf)
            plgpu.commit_smem()
            if ns == 1:
                plgpu.copy_smem_to_gmem(q_smem, o_ref.at[bi, hi, pl.ds(r0, ROWS)])
            else:
                plgpu.copy_smem_to_gmem(q_smem, o_ref.at[bi, hi, sp, pl.ds(r0, ROWS)])
                plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[bi, hi, sp, pl.ds(r0, ROWS)])
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(
            scoped,
            plgpu.SMEM((ROWS, h), dtype, transforms=(tiling, swizzle)),
            plgpu.SMEM((stages, bk, h), dtype, transforms=(tiling, swizzle)),
            plgpu.SMEM((stages, bk, h), dtype, transforms=(tiling, swizzle)),
            plgpu.SMEM((n_words, ROWS), jnp.int32),
            plgpu.SMEM((ROWS,), jnp.float32),
            plgpu.SMEM((ROWS, bk) if (interpret or pv_via_smem) else (8, 64), dtype,
                       transforms=(tiling, swizzle)),  # P staging (dummy when unused)
            plgpu.Barrier(num_barriers=2),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
        )

    rp = nrb * ROWS
    if ns == 1:
        out_type = jax.ShapeDtypeStruct((b, kh, rp, h), dtype)
    else:
        out_type = (jax.ShapeDtypeStruct((b, kh, ns, rp, h), dtype),
                    jax.ShapeDtypeStruct((b, kh, ns, rp), jnp.float32))
    return plgpu.kernel(
        body,
        out_type=out_type,
        grid=(nrb, kh, b * ns),
        grid_names=("rb", "h", "bs"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )


def _forward(q, k_cache, v_cache, prefix_len, block_mask, config, interpret):
    b, t, n, h = q.shape
    _, kh, s, _ = k_cache.shape
    g = n // kh
    rows = t * g
    nrb = common.cdiv(rows, ROWS)
    rp = nrb * ROWS
    causal = block_mask is None
    if config.num_splits is not None:
        ns = config.num_splits
    else:
        ctas = common.ctas_per_sm(mosaic_smem_bytes(config, h, ROWS, q.dtype.itemsize))
        ns = common.auto_num_splits(b * kh * nrb, s, config.block_k, ctas=ctas)
    qr = common.pack_rows(q, kh, rp)
    prefix_len = prefix_len.astype(jnp.int32)
    if causal:
        n_words = 1
        words = jnp.zeros((b, 1, rp), jnp.int32)
        extent = jnp.zeros((b, nrb), jnp.int32)
    else:
        packed = mask_lib.as_packed(block_mask)  # [B, T, W]
        n_words = packed.shape[-1]
        extent = mask_lib.row_block_extent(packed, t, g, ROWS, nrb)
        wi = lax.bitcast_convert_type(packed, jnp.int32)
        t_of_row = jnp.minimum(jnp.arange(rp) // g, t - 1)
        words = jnp.transpose(wi[:, t_of_row, :], (0, 2, 1))  # [B, W, Rp]: row words, per row
    kernel = _build(b=b, kh=kh, s=s, h=h, t=t, g=g, nrb=nrb, ns=ns, causal=causal,
                    n_words=n_words, dtype=q.dtype, block_k=config.block_k,
                    stages=config.stages, interpret=interpret,
                    pv_via_smem=config.pv_via_smem)
    outs = kernel(prefix_len, extent, words, qr, k_cache, v_cache)
    if ns == 1:
        o = outs
    else:
        o = common.combine_splits(outs[0], outs[1], split_axis=2).astype(q.dtype)
    return common.unpack_rows(o, t, n, h)


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def cache_attention_hopper(q, k_cache, v_cache, prefix_len, block_mask=None, *,
                           config: MosaicConfig | None = None, interpret: bool = False):
    """Same contract as `reference.cache_attention_reference`, for sm_90 GPUs. block_mask:
    None (causal), bool [B, T, T] or bit-packed uint32 [B, T, ceil(T/32)].
    interpret=True (or a `plgpu.InterpretGPUParams`, e.g. with detect_races=True) runs the
    kernel in Mosaic GPU interpret mode (CPU)."""
    t = q.shape[1]
    cfg = config or default_config(q, k_cache)
    why = supported(q, k_cache, cfg)
    if why is None and block_mask is not None and t > 1024:
        why = f"T={t} > 1024 with a block mask (mask words must fit in shared memory)"
    if why is None and not interpret:
        platform, cc, _ = common.device_info()
        if platform == "gpu" and not str(cc).startswith("9"):
            why = f"needs sm_90 (wgmma), device has compute capability {cc}"
    if why is not None:
        raise NotImplementedError(f"hopper cache attention: {why}")
    if interpret:
        params = interpret if isinstance(interpret, plgpu.InterpretGPUParams) else (
            plgpu.InterpretGPUParams())
        with plgpu.force_gpu_interpret_mode(params):
            return _forward(q, k_cache, v_cache, prefix_len, block_mask, cfg, interpret)
    return _forward(q, k_cache, v_cache, prefix_len, block_mask, cfg, interpret)
