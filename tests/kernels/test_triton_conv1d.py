"""Triton causal conv1d (varlen prefill, decode update) against the references, tiny shapes."""

import pytest
import torch

from mambaserve.kernels.conv1d import (causal_conv1d_update, causal_conv1d_update_ref, causal_conv1d_varlen,
                                       causal_conv1d_varlen_ref)
from tests.kernels.helpers import TOL, assert_close, gen, randn


@pytest.mark.parametrize("width", [2, 3, 4])
def test_varlen_matches_reference_incl_sequences_shorter_than_width(dev, width):
    lengths, Dm = [1, 2, 5, 40, 3], 12  # 40 spans several token blocks
    g = gen(width)
    x = randn(g, sum(lengths), Dm, dev=dev)
    w, b = randn(g, Dm, width, dev=dev), randn(g, Dm, dev=dev)
    pool = randn(g, 8, Dm, width - 1, dev=dev)
    ref_pool, before = pool.clone(), pool.clone()
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    slots = torch.tensor([6, 1, 3, 2, 7], device=dev)
    has = torch.tensor([True, True, False, True, False], device=dev)
    out = causal_conv1d_varlen(x, w, b, pool, cu, slots, has, force_triton=True)
    ref = causal_conv1d_varlen_ref(x, w, b, ref_pool, cu, slots, has)
    assert_close(out, ref, 1e-6)
    assert_close(pool, ref_pool, 1e-6)
    assert torch.equal(pool[0], before[0]) and torch.equal(pool[4], before[4])


@pytest.mark.parametrize("width", [2, 4])
def test_prefill_then_decode_equals_long_prefill_and_padding_rows(dev, width):
    Dm, L = 10, 6
    g = gen(10 + width)
    x = randn(g, L + 1, Dm, dtype=torch.bfloat16, dev=dev)
    w, b = randn(g, Dm, width, dev=dev), None
    long_pool = torch.zeros(3, Dm, width - 1, device=dev)
    one = torch.tensor([1], device=dev)
    no = torch.tensor([False], device=dev)
    long = causal_conv1d_varlen(x, w, b, long_pool, torch.tensor([0, L + 1], device=dev), one, no,
                                force_triton=True)
    pool = torch.zeros(3, Dm, width - 1, device=dev)
    pool[2] = 7.0
    causal_conv1d_varlen(x[:L], w, b, pool, torch.tensor([0, L], device=dev), one, no, force_triton=True)
    rows = torch.cat([x[L:], x[:1]])  # second row is padding
    step = causal_conv1d_update(rows, pool, w, b, torch.tensor([1, -1], device=dev), force_triton=True)
    assert step.dtype == torch.bfloat16
    assert_close(step[:1], long[L:], TOL[torch.bfloat16])
    assert not step[1].any()
    assert torch.equal(pool[1], long_pool[1]) and (pool[2] == 7.0).all() and not pool[0].any()


@pytest.mark.parametrize("width", [2, 3, 4])
def test_update_matches_reference(dev, width):
    Dm, rows = 300, 4  # more than one channel block
    g = gen(20 + width)
    x = randn(g, rows, Dm, dev=dev)
    w, b = randn(g, Dm, width, dev=dev), randn(g, Dm, dev=dev)
    pool = randn(g, 6, Dm, width - 1, dev=dev)
    ref_pool = pool.clone()
    idx = torch.tensor([5, -1, 0, 2], device=dev)
    out = causal_conv1d_update(x, pool, w, b, idx, activation=None, force_triton=True)
    ref = causal_conv1d_update_ref(x, ref_pool, w, b, idx, activation=None)
    assert_close(out, ref, 1e-6)
    assert torch.equal(pool, ref_pool)
