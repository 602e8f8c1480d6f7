"""Triton state slot copy / clear / masked scatter against the references."""

import torch

from mambaserve.kernels.state_ops import (clear_slots, clear_slots_ref, copy_slots, copy_slots_ref, scatter_steps,
                                          scatter_steps_ref)
from tests.kernels.helpers import gen, randn


def test_copy_and_clear(dev):
    pool = randn(gen(0), 3, 9, 5, 7, dev=dev)  # E = 35: not a multiple of the block
    ref = pool.clone()
    src, dst = torch.tensor([1, 2, 2], device=dev), torch.tensor([5, 6, 8], device=dev)
    copy_slots(pool, src, dst, force_triton=True)
    copy_slots_ref(ref, src, dst)
    assert torch.equal(pool, ref)
    clear_slots(pool, torch.tensor([1, 8], device=dev), force_triton=True)
    clear_slots_ref(ref, torch.tensor([1, 8], device=dev))
    assert torch.equal(pool, ref)
    copy_slots(pool, src[:0], dst[:0], force_triton=True)  # empty: no launch
    assert torch.equal(pool, ref)


def test_masked_scatter_with_dtype_cast(dev):
    g = gen(1)
    dst = randn(g, 2, 6, 3, 4, dtype=torch.bfloat16, dev=dev)
    src = randn(g, 2, 4, 5, 3, 4, dev=dev)  # [L, R, steps, ...] fp32
    ref = dst.clone()
    idx = torch.tensor([3, 4, 0, 5], device=dev)
    step = torch.tensor([2, -1, 0, 4], device=dev)
    scatter_steps(dst, src, idx, step, force_triton=True)
    scatter_steps_ref(ref, src, idx, step)
    if dev == "cuda":
        assert torch.equal(dst, ref)
    else:  # the Triton 3.9 interpreter rounds fp32 -> bf16 toward zero (the GPU rounds to nearest)
        assert torch.allclose(dst.float(), ref.float(), rtol=2 ** -7, atol=0)
    for r in (1, 2):  # rows masked off (step -1) and slots no row names are bit-identical
        assert torch.equal(dst[:, r], ref[:, r])
    dst32 = randn(g, 2, 6, 3, 4, dev=dev)
    ref32 = dst32.clone()
    scatter_steps(dst32, src, idx, step, force_triton=True)
    scatter_steps_ref(ref32, src, idx, step)
    assert torch.equal(dst32, ref32)


def test_non_contiguous_pool_falls_back(dev):
    pool = randn(gen(2), 2, 4, 6, dev=dev)[:, :, ::2]
    ref = pool.clone()
    clear_slots(pool, torch.tensor([2], device=dev), force_triton=True)
    clear_slots_ref(ref, torch.tensor([2], device=dev))
    assert torch.equal(pool, ref)
