"""Norm + projection fused (one decode row) against the unfused kernels' references."""

import pytest
import torch

from mambaserve.kernels import KernelConfig
from mambaserve.kernels.norm_linear import (gated_rmsnorm_linear, gated_rmsnorm_linear_ref, rmsnorm_linear,
                                            rmsnorm_linear_ref)


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _tiles(K, **tiles):
    return KernelConfig(linear_tiles={K: tiles})


@pytest.mark.parametrize("N,K", [(24, 40), (9, 512), (37, 1100)])
@pytest.mark.parametrize("residual_kind", ["none", "fp32", "same"])
@pytest.mark.parametrize("bias", [False, True])
def test_rmsnorm_linear_matches_unfused(dev, N, K, residual_kind, bias):
    x, w = _rand(1, K, seed=N).to(dev), (_rand(N, K, seed=K) / K ** 0.5).to(dev)
    nw, b = (1 + 0.1 * _rand(K, seed=3)).to(dev), _rand(N, seed=4).to(dev) if bias else None
    fp32 = residual_kind == "fp32"
    residual = None if residual_kind == "none" else (4 * _rand(1, K, seed=5)).to(dev)
    y, res = rmsnorm_linear(x, residual, nw, 1e-5, fp32, w, b, force_triton=True, config=_tiles(K, BLOCK_K=256))
    y_ref, res_ref = rmsnorm_linear_ref(x, residual, nw, 1e-5, fp32, w, b)
    assert y.shape == (1, N) and res.dtype == res_ref.dtype
    assert torch.equal(res, res_ref)  # the new residual is the same add, stored by one program
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("N,K", [(24, 40), (33, 1100)])
def test_gated_rmsnorm_linear_matches_unfused(dev, N, K):
    x, z = _rand(1, K, seed=1).to(dev), _rand(1, K, seed=2).to(dev)
    w, nw = (_rand(N, K, seed=3) / K ** 0.5).to(dev), (1 + 0.1 * _rand(K, seed=4)).to(dev)
    y = gated_rmsnorm_linear(x, z, nw, 1e-5, K, w, force_triton=True, config=_tiles(K, BLOCK_K=256))
    torch.testing.assert_close(y, gated_rmsnorm_linear_ref(x, z, nw, 1e-5, K, w), rtol=1e-5, atol=1e-5)


def test_bf16_rounds_like_the_unfused_path(dev):
    K, N = 768, 40
    x, w = _rand(1, K, seed=1).bfloat16().to(dev), (_rand(N, K, seed=2) / K ** 0.5).bfloat16().to(dev)
    nw, residual = (1 + 0.1 * _rand(K, seed=3)).bfloat16().to(dev), _rand(1, K, seed=4).to(dev)
    y, res = rmsnorm_linear(x, residual, nw, 1e-5, True, w, force_triton=True)
    y_ref, res_ref = rmsnorm_linear_ref(x, residual, nw, 1e-5, True, w)
    assert y.dtype == torch.bfloat16 and torch.equal(res, res_ref)
    # the fused path does not round the normalised row to bf16 before the product: within that rounding
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=2e-2, atol=2e-2)


def test_what_the_kernel_does_not_take_runs_unfused(dev):
    """Two rows, or several norm groups: exactly the unfused result."""
    x, z, w, nw = _rand(2, 64, seed=1).to(dev), _rand(2, 64, seed=2).to(dev), _rand(8, 64, seed=3).to(dev), \
        _rand(64, seed=4).to(dev)
    y, res = rmsnorm_linear(x, None, nw, 1e-5, True, w, force_triton=True)
    y_ref, res_ref = rmsnorm_linear_ref(x, None, nw, 1e-5, True, w)
    assert torch.equal(y, y_ref) and torch.equal(res, res_ref)
    grouped = gated_rmsnorm_linear(x[:1], z[:1], nw, 1e-5, 16, w, force_triton=True)
    assert torch.equal(grouped, gated_rmsnorm_linear_ref(x[:1], z[:1], nw, 1e-5, 16, w))


@pytest.mark.parametrize("width,conv_bias", [(2, False), (3, True), (4, True)])
@pytest.mark.parametrize("slot", [2, -1])
def test_conv_step_in_the_epilogue(dev, width, conv_bias, slot):
    """in_proj with the decode conv over columns [col0, col0 + D): the projection, then
    causal_conv1d_update over those columns (padding slot: zeros there and no state touched)."""
    from mambaserve.kernels.norm_linear import ConvStep

    K, N, col0, D = 96, 29, 5, 17  # conv columns straddle program boundaries at both ends
    x, w = _rand(1, K, seed=1).to(dev), (_rand(N, K, seed=2) / K ** 0.5).to(dev)
    nw, residual = (1 + 0.1 * _rand(K, seed=3)).to(dev), _rand(1, K, seed=4).to(dev)
    cw, cb = _rand(D, width, seed=5).to(dev), _rand(D, seed=6).to(dev) if conv_bias else None
    state = _rand(4, D, width - 1, seed=7).to(dev)
    slots = torch.tensor([slot], device=dev)
    ref_state = state.clone()
    y, res = rmsnorm_linear(x, residual, nw, 1e-5, True, w, None, ConvStep(cw, cb, state, slots, col0),
                            force_triton=True, config=_tiles(K, BLOCK_K=32))
    y_ref, res_ref = rmsnorm_linear_ref(x, residual, nw, 1e-5, True, w, None, ConvStep(cw, cb, ref_state, slots, col0))
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, ref_state, rtol=1e-5, atol=1e-5)
    assert torch.equal(res, res_ref)
    plain, _ = rmsnorm_linear_ref(x, residual, nw, 1e-5, True, w)
    outside = torch.ones(N, dtype=torch.bool)
    outside[col0:col0 + D] = False
    torch.testing.assert_close(y[0, outside], plain[0, outside], rtol=1e-5, atol=1e-5)
    if slot < 0:
        assert torch.equal(state, _rand(4, D, width - 1, seed=7).to(dev)) and not y[0, col0:col0 + D].any()
    else:
        assert not torch.equal(state[slot], _rand(4, D, width - 1, seed=7).to(dev)[slot])


@pytest.mark.parametrize("tiles", [{"ACC_2D": False}, {"ACC_2D": True}, {"BLOCK_N": 8, "num_warps": 2},
                                   {"STAGES": 3}])
def test_loop_variants_agree(dev, tiles):
    """The tile and loop knobs the benchmarks sweep (one call's ``tiles``) compute the same product."""
    K, N = 1100, 37
    x, w = _rand(1, K, seed=1).to(dev), (_rand(N, K, seed=2) / K ** 0.5).to(dev)
    nw, residual = (1 + 0.1 * _rand(K, seed=3)).to(dev), _rand(1, K, seed=4).to(dev)
    y, _ = rmsnorm_linear(x, residual, nw, 1e-5, True, w, force_triton=True, tiles={"BLOCK_K": 256, **tiles})
    torch.testing.assert_close(y, rmsnorm_linear_ref(x, residual, nw, 1e-5, True, w)[0], rtol=1e-5, atol=1e-5)


def test_unfused_config_gives_the_unfused_result_bit_for_bit(dev):
    """``fuse_norm_linear=False`` is the A/B baseline: exactly the norm kernel then the projection."""
    K, N = 96, 29
    x, w = _rand(1, K, seed=1).to(dev), (_rand(N, K, seed=2) / K ** 0.5).to(dev)
    nw, residual = (1 + 0.1 * _rand(K, seed=3)).to(dev), _rand(1, K, seed=4).to(dev)
    off = KernelConfig(fuse_norm_linear=False)
    y, res = rmsnorm_linear(x, residual, nw, 1e-5, True, w, force_triton=True, config=off)
    y_ref, res_ref = rmsnorm_linear_ref(x, residual, nw, 1e-5, True, w)
    assert torch.equal(y, y_ref) and torch.equal(res, res_ref)
    z = _rand(1, K, seed=5).to(dev)
    assert torch.equal(gated_rmsnorm_linear(x, z, nw, 1e-5, K, w, force_triton=True, config=off),
                       gated_rmsnorm_linear_ref(x, z, nw, 1e-5, K, w))
