"""Squared ReLU in one launch (``kernels/relu2.py``) against torch's two ops: the same values (bit for bit in fp32; in
bf16 within a rounding, as Triton's interpreter rounds to bf16 its own way), NaN and infinities as torch passes them."""

import pytest
import torch

from mambaserve.kernels.relu2 import BLOCK, relu2, relu2_ref
from tests.kernels.helpers import TOL, assert_close, gen, randn


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 8), (3, BLOCK + 5), (0, 16)])  # one block, a partial second block, empty
def test_matches_reference(dev, dtype, shape):
    x = randn(gen(shape[1]), *shape, dtype=dtype, dev=dev, scale=3.0)
    if x.numel():
        x[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0], dtype=dtype)
    out = relu2(x, force_triton=True)
    assert out.dtype == dtype and out.shape == x.shape
    ref = relu2_ref(x)
    assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(out.isinf(), ref.isinf())
    finite = ref.isfinite()
    if dtype == torch.float32:
        assert torch.equal(out[finite], ref[finite])
    else:
        assert_close(out[finite].float(), ref[finite].float(), TOL[dtype])


def test_a_strided_input_runs_the_reference(dev):
    x = randn(gen(1), 4, 32, dev=dev)[:, ::2]
    assert torch.equal(relu2(x, force_triton=True), relu2_ref(x))
