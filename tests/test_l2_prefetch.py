"""The L2 prefetch kernel (`pallas_kernels/l2_prefetch.py`): its plan of boxes, the value
passing through unchanged with the kernel in the program, refusals by name, lowering for an
H200."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import count_eqns
from pallas_kernels.l2_prefetch import l2_prefetch, plan

BF16 = jnp.bfloat16


def test_plan_takes_leading_rows_in_proportion():
    big, small = jnp.zeros((1024, 512), BF16), jnp.zeros((1024, 128), BF16)
    layout = plan([big, small], 512 * 1024)  # 0.5 MB of 1.25 MB
    rows = [r for r, *_ in layout]
    assert rows == [512, 512]  # 0.4 MB and 0.1 MB (410 rows), up to whole 256-row boxes
    (_, br, bc, boxes), (_, _, small_bc, small_boxes) = layout
    assert (br, bc, boxes, small_bc, small_boxes) == (256, 256, 4, 128, 2)
    assert plan([big], 10**9)[0][0] == 1024  # never past the weight
    with pytest.raises(NotImplementedError, match=r"\[1024, 12\]"):
        plan([jnp.zeros((1024, 12), BF16)], 1000)


def test_values_pass_through_and_kernel_is_ordered():
    ws = [jnp.ones((512, 256), BF16), jnp.ones((256, 2, 128), BF16)]
    fn = lambda x, ws: l2_prefetch(x * 2, ws, 200_000, interpret=True) + 1  # noqa: E731
    x = jnp.arange(512.0).reshape(2, 256)
    np.testing.assert_array_equal(jax.jit(fn)(x, ws), x * 2 + 1)
    # interpret mode traces to the kernel body: one prefetch call site per weight here
    assert count_eqns(fn, x, ws, primitive="async_prefetch") == 2
    assert count_eqns(lambda x, ws: l2_prefetch(x, ws, 0), x, ws,
                      primitive="async_prefetch") == 0
    with pytest.raises(NotImplementedError, match="pass through"):
        l2_prefetch(jnp.zeros(100), ws, 1000, interpret=True)


def test_lowers_for_h200():
    from pallas_kernels.lowering_check import lower_for_gpu

    ws = [jnp.zeros((4096, 32, 128), BF16), jnp.zeros((4096, 8, 128), BF16)]
    text = lower_for_gpu(lambda x, a, b: l2_prefetch(x, [a, b], 30 * 2**20),
                         jnp.zeros((1, 1, 32, 128), BF16), *ws)
    assert "mosaic_gpu" in text
