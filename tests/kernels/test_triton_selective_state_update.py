"""Triton selective state update against its reference, tiny shapes (interpreter on CPU)."""

import pytest
import torch

from mambaserve.kernels.selective_state_update import selective_state_update, selective_state_update_ref
from tests.kernels.helpers import TOL, assert_close, gen, randn


def _case(dev, groups, state_dtype, x_dtype=torch.float32, H=8, P=4, N=6, rows=5, slots=9, seed=0):
    g = gen(seed)
    x, z = randn(g, rows, H, P, dtype=x_dtype, dev=dev), randn(g, rows, H, P, dtype=x_dtype, dev=dev)
    dt = randn(g, rows, H, dev=dev)
    A = (-torch.rand(H, generator=g) * 2 - 0.1).to(dev)
    B, C = randn(g, rows, groups, N, dtype=x_dtype, dev=dev), randn(g, rows, groups, N, dtype=x_dtype, dev=dev)
    D, bias = randn(g, H, dev=dev), randn(g, H, dev=dev)
    pool = randn(g, slots, H, P, N, dtype=state_dtype, dev=dev)
    return x, z, dt, A, B, C, D, bias, pool


@pytest.mark.parametrize("groups", [1, 2, 4, 8])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_matches_reference_with_padding_and_dst(dev, groups, state_dtype):
    x, z, dt, A, B, C, D, bias, pool = _case(dev, groups, state_dtype, seed=groups)
    ref_pool, before = pool.clone(), pool.clone()
    idx = torch.tensor([3, -1, 1, 6, -1], device=dev)
    dst = torch.tensor([4, -1, 2, 6, -1], device=dev)
    kw = dict(state_indices=idx, dst_state_indices=dst)
    y = selective_state_update(pool, x, dt, A, B, C, D, z, bias, **kw, force_triton=True)
    y_ref = selective_state_update_ref(ref_pool, x, dt, A, B, C, D, z, bias, **kw)
    tol = TOL[state_dtype]
    assert_close(y, y_ref, tol)
    assert_close(pool, ref_pool, tol)
    assert (y[1] == 0).all() and (y[4] == 0).all()
    for untouched in (0, 1, 3, 5, 7, 8):  # padding rows and sources with another destination
        assert torch.equal(pool[untouched], before[untouched])


def test_in_place_no_optionals_and_bf16_activations(dev):
    x, _, dt, A, B, C, _, _, pool = _case(dev, 2, torch.float32, x_dtype=torch.bfloat16, P=16, N=16, seed=7)
    ref_pool = pool.clone()
    idx = torch.tensor([0, 2, 5, -1, 8], device=dev)
    y = selective_state_update(pool, x, dt, A, B, C, state_indices=idx, dt_softplus=False,
                               dt_limit=(0.01, 0.5), force_triton=True)
    y_ref = selective_state_update_ref(ref_pool, x, dt, A, B, C, state_indices=idx, dt_softplus=False,
                                       dt_limit=(0.01, 0.5))
    assert y.dtype == torch.bfloat16
    assert_close(y, y_ref, TOL[torch.bfloat16])
    assert_close(pool, ref_pool, 1e-5)


def test_extreme_decay_and_dt_range_are_finite(dev):
    x, z, dt, A, B, C, D, bias, pool = _case(dev, 1, torch.float32, H=4, seed=11)
    A = torch.tensor([-16.0, -16.0, -0.01, -1.0], device=dev)
    dt = torch.tensor([10.0, 30.0, -30.0, 0.0], device=dev).repeat(x.shape[0], 1)
    ref_pool = pool.clone()
    idx = torch.tensor([1, 2, 3, 4, 5], device=dev)
    y = selective_state_update(pool, x, dt, A, B, C, D, z, None, state_indices=idx, force_triton=True)
    y_ref = selective_state_update_ref(ref_pool, x, dt, A, B, C, D, z, None, state_indices=idx)
    assert torch.isfinite(y).all() and torch.isfinite(pool).all()
    assert_close(y, y_ref, 1e-5)
    assert_close(pool, ref_pool, 1e-5)


def test_all_padding_touches_nothing(dev):
    x, z, dt, A, B, C, D, bias, pool = _case(dev, 1, torch.float32, seed=12)
    before = pool.clone()
    y = selective_state_update(pool, x, dt, A, B, C, D, z, bias, state_indices=torch.full((5,), -1, device=dev),
                               force_triton=True)
    assert torch.equal(pool, before) and not y.any()
