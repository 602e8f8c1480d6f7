"""Token masks applied to logits in one pass: what structured outputs, ``allowed_token_ids`` and
``bad_words`` leave to be sampled.

``mask`` ``[R, ceil(V / 32)]`` int32 holds one packed row of allowed tokens per constrained request: bit
``i`` of word ``w`` allows token ``32 * w + i`` (least significant bit first, the layout llguidance and
xgrammar fill). ``rows`` ``[R]`` long: the logits row each mask row is for. Every disallowed logit of those
rows becomes ``-inf`` in place; other rows are not touched. The Triton kernel writes only the masked
entries (it reads the mask, never the logits).
"""

from __future__ import annotations

import torch

from mambaserve.kernels._dispatch import HAS_TRITON, tl, triton, use_triton

BLOCK = 1024

if HAS_TRITON:

    @triton.jit
    def _token_mask_kernel(logits_ptr, mask_ptr, rows_ptr, V, stride_l, stride_m, BLOCK: tl.constexpr):
        """Grid (R, cdiv(V, BLOCK)): one block of one constrained row."""
        r = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < V
        row = tl.load(rows_ptr + r).to(tl.int64)
        words = tl.load(mask_ptr + r * stride_m + cols // 32, mask=inside, other=-1)
        masked = ((words >> (cols % 32)) & 1) == 0
        tl.store(logits_ptr + row * stride_l + cols, tl.full([BLOCK], float("-inf"), tl.float32),
                 mask=inside & masked)


def apply_token_mask_ref(logits: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor) -> None:
    V = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=mask.device)
    allowed = ((mask.unsqueeze(-1) >> shifts) & 1).reshape(mask.shape[0], -1)[:, :V].bool()
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def apply_token_mask(logits: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor,
                     force_triton: bool | None = None) -> None:
    """Set the logits of ``rows`` to ``-inf`` where their ``mask`` bit is 0 (in place; fp32 ``[B, V]``)."""
    if mask.shape[1] * 32 < logits.shape[-1]:
        raise ValueError(f"a mask of {mask.shape[1]} words covers {mask.shape[1] * 32} tokens, not {logits.shape[-1]}")
    if not rows.numel():
        return
    if not use_triton(logits, force_triton):
        apply_token_mask_ref(logits, mask, rows)
        return
    assert logits.dtype == torch.float32 and logits.stride(-1) == 1 and mask.stride(-1) == 1
    V = logits.shape[-1]
    _token_mask_kernel[(rows.numel(), triton.cdiv(V, BLOCK))](logits, mask, rows, V, logits.stride(0),
                                                              mask.stride(0), BLOCK=BLOCK)
