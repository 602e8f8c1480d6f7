"""SwiGLU's activation over a fused gate/up projection (``kernels/swiglu.py``) against the two torch ops it replaces."""

import pytest
import torch

from mambaserve.kernels.swiglu import silu_mul, silu_mul_ref
from tests.kernels.helpers import TOL, assert_close, gen, randn


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,n", [(1, 8), (5, 40), (3, 1100)])  # a width no block divides; two column blocks
def test_matches_reference(dev, dtype, T, n):
    x = randn(gen(T * n), T, 2 * n, dtype=dtype, dev=dev, scale=3.0)
    out = silu_mul(x, force_triton=True)
    assert out.shape == (T, n) and out.dtype == dtype
    assert_close(out, silu_mul_ref(x), TOL[dtype])


def test_strided_rows_of_a_wider_projection(dev):
    """The gate/up columns as a slice of a GEMM that also computed other columns (Granite's router logits first)."""
    wide = randn(gen(7), 4, 6 + 2 * 24, dev=dev)
    x = wide[:, 6:]
    assert_close(silu_mul(x, force_triton=True), silu_mul_ref(x.contiguous()), TOL[torch.float32])
    assert silu_mul(wide[:0, 6:], force_triton=True).shape == (0, 24)
    with pytest.raises(ValueError):
        silu_mul(wide[:, :5], force_triton=True)
