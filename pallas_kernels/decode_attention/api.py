"""Decode attention (one query per sequence against a KV cache) by implementation name:

  "splitk"     the split-K Pallas kernel (`kernel.py`, Triton lowering, NVIDIA GPUs; on the
               CPU in interpret mode only).
  "reference"  the pure-JAX reference (`reference.py`, XLA).

impl: a name or an ordered list of names (`pallas_kernels.dispatch`); None: `DEFAULT`.
"""

from __future__ import annotations

from collections.abc import Sequence

from pallas_kernels import common, dispatch
from pallas_kernels.decode_attention.reference import decode_attention_reference

DEFAULT = ("splitk", "reference")


def _splitk(q, k_cache, v_cache, prefix_len, *, interpret, config):
    from pallas_kernels.decode_attention.kernel import decode_attention as kernel

    common.require_gpu("split-K decode kernel", interpret)
    return kernel(q, k_cache, v_cache, prefix_len, config=config, interpret=interpret)


def _reference(q, k_cache, v_cache, prefix_len, *, interpret, config):
    del interpret, config
    return decode_attention_reference(q, k_cache, v_cache, prefix_len)


IMPLEMENTATIONS = {"splitk": _splitk, "reference": _reference}


def decode_attention(q, k_cache, v_cache, prefix_len, *,
                     impl: str | Sequence[str] | None = None, interpret: bool = False,
                     config=None):
    """q [B, 1, N, H]; k_cache, v_cache [B, K, S, H] or `paged.Pages`; prefix_len [B] ->
    [B, 1, N, H]: the query attends to slots [0, prefix_len]. config: the kernel's
    `DecodeConfig`."""
    return dispatch.run("decode attention", DEFAULT if impl is None else impl,
                        IMPLEMENTATIONS, q, k_cache, v_cache, prefix_len,
                        interpret=interpret, config=config)
