"""The fused top-k + softmax router (``kernels/topk_softmax.py``) against its torch reference."""

import pytest
import torch
import torch.nn.functional as F

from mambaserve.kernels.topk_softmax import (rmsnorm_topk_softmax, rmsnorm_topk_softmax_ref, topk_softmax,
                                             topk_softmax_ref)
from tests.kernels.helpers import TOL, assert_close, gen, randn


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,E,k", [(1, 64, 6), (9, 5, 2), (4, 130, 8), (3, 4, 4), (2, 16, 1)])
def test_matches_reference(dev, dtype, T, E, k):
    logits = randn(gen(T * E + k), T, E, dtype=dtype, dev=dev, scale=3.0)
    ids, w = topk_softmax(logits, k, torch.float32 if dtype == torch.float32 else dtype, force_triton=True)
    ids_ref, w_ref = topk_softmax_ref(logits, k, w.dtype)
    assert ids.shape == w.shape == (T, k) and ids.dtype == torch.int32
    # descending, as torch.topk: the same logits in the same order (bf16 ties may swap equal ones' experts)
    assert torch.equal(logits.gather(1, ids.long()), logits.gather(1, ids_ref))
    assert all(len(set(row)) == k for row in ids.tolist())  # k distinct experts a row
    assert_close(w, w_ref, TOL[dtype])
    assert_close(w.float().sum(-1), torch.ones(T, device=dev), TOL[dtype])


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the NaN row, in the interpreter
def test_ties_pick_the_lower_expert_and_nan_rows_stay_in_range(dev):
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [float("nan")] * 4], device=dev)
    ids, _ = topk_softmax(logits, 2, force_triton=True)
    assert ids[0].tolist() == [1, 2]
    assert ((ids[1] >= 0) & (ids[1] < 4)).all()


@pytest.mark.parametrize("always", [1, 2, 3])
def test_always_columns_follow_the_routed_ones(dev, always):
    """Experts every token takes (a shared MLP folded in as more experts): E, E + 1, ... with weight 1, after the
    k routed ones, which are unchanged."""
    logits = randn(gen(7), 5, 16, dtype=torch.bfloat16, dev=dev, scale=3.0)
    ids, w = topk_softmax(logits, 4, torch.bfloat16, always=always, force_triton=True)
    ids_ref, w_ref = topk_softmax_ref(logits, 4, torch.bfloat16, always=always)
    base_ids, base_w = topk_softmax(logits, 4, torch.bfloat16, force_triton=True)
    assert ids.shape == w.shape == (5, 4 + always)
    assert torch.equal(ids[:, :4], base_ids) and torch.equal(w[:, :4], base_w)
    assert ids[:, 4:].tolist() == [list(range(16, 16 + always))] * 5 and (w[:, 4:] == 1).all()
    assert torch.equal(ids_ref[:, 4:].to(ids.dtype), ids[:, 4:]) and torch.equal(w_ref[:, 4:], w[:, 4:])


def test_bad_arguments_and_no_tokens(dev):
    with pytest.raises(ValueError):
        topk_softmax(torch.zeros(2, 4, device=dev), 5)
    ids, w = topk_softmax(torch.zeros(0, 8, device=dev), 2, force_triton=True)
    assert ids.shape == w.shape == (0, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,D,E,k,always,residual,scale,tiles", [
    (1, 48, 16, 6, 2, True, 0.25, None), (5, 64, 10, 3, 0, True, 1.0, None),
    (3, 40, 16, 4, 1, False, 0.5, {"BLOCK_E": 16}), (19, 48, 20, 6, 2, True, 0.25, None)])  # (19: the wide tiles)
def test_the_norm_router_and_top_k_in_one_launch_match_the_three(dev, dtype, T, D, E, k, always, residual, scale,
                                                                 tiles):
    """``rmsnorm_topk_softmax`` (Granite's decode: the layer's residual-add norm, the router's projection, the top-k
    softmax) against ``kernels.rmsnorm``'s reference, ``F.linear`` and ``topk_softmax``'s reference, twice on the same
    counters. E = 10 and 16 split over 3 and 4 programs a row, or one program a row (``tiles``); D = 48 and 40 leave
    part of a column step masked."""
    g = gen(T * D + E)
    x, res = randn(g, T, D, dtype=dtype, dev=dev), randn(g, T, D, dtype=dtype, dev=dev, scale=2.0)
    nw, rw = randn(g, D, dtype=dtype, dev=dev), randn(g, E, D, dtype=dtype, dev=dev, scale=0.3)
    counters = torch.zeros(T + 1, dtype=torch.int32, device=dev)
    outs = [rmsnorm_topk_softmax(x, res if residual else None, nw, 1e-5, scale, rw, k, dtype, always=always,
                                 counters=counters, force_triton=True, tiles=tiles) for _ in range(2)]
    assert not counters.any()  # each row's last program leaves its counter at 0 for the next launch
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    ref = rmsnorm_topk_softmax_ref(x, res if residual else None, nw, 1e-5, scale, rw, k, dtype, always)
    normed, new_res, ids, w = outs[0]
    if dtype == torch.float32:  # the same add, rounded once (the interpreter truncates its bf16 casts)
        assert torch.equal(new_res, ref[1])
    assert_close(new_res, ref[1], TOL[dtype])
    assert_close(normed, ref[0], TOL[dtype])
    assert ids.shape == w.shape == (T, k + always) and ids.dtype == torch.int32
    logits = F.linear(ref[0], rw).float()  # the chosen experts' logits, in order (not their ids: ties may swap)
    assert torch.allclose(logits.gather(1, ids[:, :k].long()), logits.gather(1, ref[2][:, :k]), rtol=TOL[dtype])
    assert torch.equal(ids[:, k:].long(), ref[2][:, k:])
    assert_close(w, ref[3], TOL[dtype])


def test_the_fused_router_runs_the_reference_where_its_layout_does_not_fit(dev):
    x = torch.randn(2, 16, device=dev).t().contiguous().t()  # column-major rows
    nw, rw = torch.ones(16, device=dev), torch.randn(8, 16, device=dev)
    out = rmsnorm_topk_softmax(x, None, nw, 1e-5, 1.0, rw, 2, force_triton=True)
    ref = rmsnorm_topk_softmax_ref(x, None, nw, 1e-5, 1.0, rw, 2)
    assert all(torch.equal(a, b) for a, b in zip(out, ref))
    with pytest.raises(ValueError, match="counters"):
        rmsnorm_topk_softmax(x.contiguous(), None, nw, 1e-5, 1.0, rw, 2, counters=torch.zeros(1, dtype=torch.int32,
                             device=dev), force_triton=True)
