"""The token-mask kernel against its reference, and the reference against the mask's meaning."""

import torch

from mambaserve.kernels.token_mask import apply_token_mask, apply_token_mask_ref
from tests.kernels.helpers import gen, randn


def _pack(allowed: torch.Tensor) -> torch.Tensor:
    """Bool rows [R, V] packed as the kernel reads them (bit i of word w: token 32 w + i)."""
    R, V = allowed.shape
    W = -(-V // 32)
    bits = torch.zeros(R, W * 32, dtype=torch.int64)
    bits[:, :V] = allowed.long()
    words = (bits.view(R, W, 32) << torch.arange(32)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def test_reference_masks_exactly_the_cleared_bits():
    g = gen(0)
    logits = randn(g, 3, 77)
    allowed = torch.rand(2, 77, generator=g) < 0.3
    allowed[:, 31] = allowed[:, 63] = True  # (bit 31: a negative int32 word)
    out = logits.clone()
    apply_token_mask_ref(out, _pack(allowed), torch.tensor([2, 0]))
    assert torch.equal(out[1], logits[1])  # a row without a mask is untouched
    for r, row in ((0, 2), (1, 0)):
        assert torch.equal(out[row][allowed[r]], logits[row][allowed[r]])
        assert torch.isneginf(out[row][~allowed[r]]).all()


def test_kernel_matches_reference(dev):
    g = gen(1)
    V = 2500  # several blocks, the last one partial
    logits = randn(g, 5, V)
    allowed = torch.rand(3, V, generator=g) < 0.5
    mask, rows = _pack(allowed), torch.tensor([4, 1, 2])
    ref = logits.clone()
    apply_token_mask_ref(ref, mask, rows)
    out = logits.to(dev)
    apply_token_mask(out, mask.to(dev), rows.to(dev), force_triton=True)
    assert torch.equal(out.cpu(), ref)
