"""Triton gated RMSNorm against its reference."""

import pytest
import torch

from mambaserve.kernels.gated_rmsnorm import gated_rmsnorm, gated_rmsnorm_ref
from tests.kernels.helpers import TOL, assert_close, gen, randn


@pytest.mark.parametrize("groups", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference(dev, groups, dtype):
    T, D = 3, 48
    g = gen(groups)
    xz = randn(g, T, 2 * D + 5, dtype=dtype, dev=dev)  # x, z as strided views of one projection
    x, z = xz[:, :D], xz[:, D:2 * D]
    w = randn(g, D, dtype=dtype, dev=dev)
    out = gated_rmsnorm(x, z, w, 1e-5, D // groups, force_triton=True)
    ref = gated_rmsnorm_ref(x, z, w, 1e-5, D // groups)
    assert out.dtype == ref.dtype
    assert_close(out, ref, TOL[dtype])


def test_no_gate_and_fp32_weight_on_bf16(dev):
    g = gen(5)
    x = randn(g, 4, 20, dtype=torch.bfloat16, dev=dev)
    w = randn(g, 20, dev=dev)
    out = gated_rmsnorm(x, None, w, 1e-6, 10, force_triton=True)
    ref = gated_rmsnorm_ref(x, None, w, 1e-6, 10)
    assert out.dtype == torch.float32
    assert_close(out, ref, TOL[torch.bfloat16])  # one bf16 rounding inside (interpreter truncates)
