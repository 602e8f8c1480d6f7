"""The fused top-k + softmax router (``kernels/topk_softmax.py``) against its torch reference."""

import pytest
import torch

from mambaserve.kernels.topk_softmax import topk_softmax, topk_softmax_ref
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


def test_bad_arguments_and_no_tokens(dev):
    with pytest.raises(ValueError):
        topk_softmax(torch.zeros(2, 4, device=dev), 5)
    ids, w = topk_softmax(torch.zeros(0, 8, device=dev), 2, force_triton=True)
    assert ids.shape == w.shape == (0, 2)
