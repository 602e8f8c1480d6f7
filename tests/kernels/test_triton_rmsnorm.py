"""Triton residual add + RMSNorm against its reference, and the reference against float64."""

import pytest
import torch

from mambaserve.kernels.rmsnorm import rmsnorm, rmsnorm_ref
from tests.kernels.helpers import TOL, assert_close, gen, randn


def _inputs(seed, T, D, dtype, has_residual, residual_in_fp32, dev="cpu"):
    g = gen(seed)
    wide = randn(g, T, D + 7, dtype=dtype, dev=dev)
    x = wide[:, 3:3 + D]  # a strided row view, as a slice of a projection would be
    rdtype = torch.float32 if residual_in_fp32 else dtype
    residual = randn(g, T, D, dtype=rdtype, dev=dev, scale=3.0) if has_residual else None
    w = randn(g, D, dtype=dtype, dev=dev, scale=0.5) + 1
    return x, residual, w


@pytest.mark.parametrize("residual_in_fp32", [False, True])
@pytest.mark.parametrize("has_residual", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference(dev, dtype, has_residual, residual_in_fp32):
    x, residual, w = _inputs(int(has_residual) + 2 * int(residual_in_fp32), 5, 37, dtype, has_residual,
                             residual_in_fp32, dev)
    out, res = rmsnorm(x, residual, w, 1e-5, residual_in_fp32, force_triton=True)
    out_ref, res_ref = rmsnorm_ref(x, residual, w, 1e-5, residual_in_fp32)
    assert out.dtype == out_ref.dtype == dtype
    assert res.dtype == res_ref.dtype == (torch.float32 if residual_in_fp32 else dtype)
    assert out.shape == res.shape == x.shape
    assert_close(out, out_ref, TOL[dtype])
    if res_ref.dtype == torch.float32:  # one fp32 add or a widening copy: bit-identical
        assert torch.equal(res, res_ref)
    else:  # one rounding of the sum to bf16 (the interpreter truncates)
        assert_close(res, res_ref, TOL[dtype])
    if residual is None and not residual_in_fp32:
        assert res is x and res_ref is x  # nothing to add: the input is the residual


@pytest.mark.parametrize("D", [1, 64, 300])
def test_widths_and_empty(dev, D):
    x, residual, w = _inputs(D, 3, D, torch.float32, True, True, dev)
    out, res = rmsnorm(x, residual, w, 1e-6, True, force_triton=True)
    out_ref, res_ref = rmsnorm_ref(x, residual, w, 1e-6, True)
    assert_close(out, out_ref, TOL[torch.float32])
    assert torch.equal(res, res_ref)
    out, res = rmsnorm(x[:0], residual[:0], w, 1e-6, True, force_triton=True)
    assert out.shape == res.shape == (0, D)


def test_fp32_weight_on_bf16_input_promotes_like_torch(dev):
    x, residual, _ = _inputs(9, 4, 20, torch.bfloat16, True, True, dev)
    w = randn(gen(10), 20, dev=dev)
    out, _ = rmsnorm(x, residual, w, 1e-5, True, force_triton=True)
    out_ref, _ = rmsnorm_ref(x, residual, w, 1e-5, True)
    assert out.dtype == out_ref.dtype == torch.float32
    assert_close(out, out_ref, TOL[torch.bfloat16])  # one bf16 rounding inside (interpreter truncates)


def test_residual_dtype_is_checked():
    x, residual, w = _inputs(0, 2, 8, torch.bfloat16, True, True)
    with pytest.raises(ValueError, match="residual_in_fp32=False"):
        rmsnorm(x, residual, w, 1e-5, False)


@pytest.mark.parametrize("residual_in_fp32", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_against_float64(dtype, residual_in_fp32):
    x, residual, w = _inputs(3, 6, 96, dtype, True, residual_in_fp32)
    out, res = rmsnorm_ref(x, residual, w, 1e-5, residual_in_fp32)
    r64 = residual.double() + x.double()
    out64 = w.double() * r64 * torch.rsqrt(r64.pow(2).mean(-1, keepdim=True) + 1e-5)
    tol = {torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype]  # bf16: the residual, h and out each round
    assert_close(res, r64, 1e-7 if res.dtype == torch.float32 else tol)
    assert_close(out, out64, tol)


def test_chain_of_blocks_matches_unfused_math():
    """Three blocks the way the model runs them, against the per-op torch code it replaced."""
    g = gen(7)
    dtype, D = torch.bfloat16, 48
    emb = randn(g, 4, D, dtype=dtype)
    outs = [randn(g, 4, D, dtype=dtype) for _ in range(3)]
    ws = [randn(g, D, dtype=dtype, scale=0.3) + 1 for _ in range(4)]

    def norm(h, w):
        hf = h.float()
        return w * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)

    x, residual, fused = emb, None, []
    for w, out in zip(ws[:3], outs):
        h, residual = rmsnorm_ref(x, residual, w, 1e-5, True)
        fused.append(h)
        x = out
    fused.append(rmsnorm_ref(x, residual, ws[3], 1e-5, True)[0])
    residual, unfused = emb.float(), []
    for w, out in zip(ws[:3], outs):
        unfused.append(norm(residual.to(dtype), w))
        residual = residual + out
    unfused.append(norm(residual.to(dtype), ws[3]))
    for a, b in zip(fused, unfused):
        assert torch.equal(a, b)


@pytest.mark.parametrize("has_residual", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scaled_residual_add(dev, dtype, has_residual):
    """``residual + x * scale`` (Granite's residual multiplier) rounded once, then the norm, as the reference."""
    x, residual, w = _inputs(11, 6, 40, dtype, has_residual, False, dev)
    out, res = rmsnorm(x, residual, w, 1e-5, scale=0.22, force_triton=True)
    out_ref, res_ref = rmsnorm_ref(x, residual, w, 1e-5, scale=0.22)
    want = x.double() * 0.22 + (residual.double() if has_residual else 0)
    assert_close(res_ref, want.to(dtype), TOL[dtype])
    assert_close(res, res_ref, TOL[dtype])
    assert_close(out, out_ref, TOL[dtype])
    assert res is not x
