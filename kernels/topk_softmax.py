"""Top-k routing with a softmax over the chosen logits (Granite 4.0-H's router): one launch for what torch runs as a
cast, a top-k (two kernels) and a softmax with its cast, five launches per MoE layer of a decode step.

Shapes: ``logits`` ``[T, E]`` (any float dtype, rows contiguous), ``k <= E``. Returns ``(ids [T, k], weights [T, k])``:
each row's k largest logits in descending order (ties: the lower expert first), and the softmax of those k logits
computed in fp32 and rounded to ``dtype`` (default the logits'). The reference is those torch ops (its ids int64,
the kernel's int32: ``kernels.moe`` takes either). A row with NaN logits still gets ids in ``[0, E)``.
"""

from __future__ import annotations

import torch

from mambaserve.kernels._dispatch import HAS_TRITON, next_pow2, pdl_args, pdl_start, tl, triton, use_triton

if HAS_TRITON:

    @triton.jit
    def _topk_softmax_kernel(x_ptr, ids_ptr, w_ptr, E, x_t, K: tl.constexpr, KP: tl.constexpr, EP: tl.constexpr,
                             USE_PDL: tl.constexpr = False):
        """Grid (T,): one row; k rounds of (max, its lowest index, masked out)."""
        pdl_start(USE_PDL)
        t = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, EP)
        v = tl.load(x_ptr + t * x_t + e, mask=e < E, other=float("-inf")).to(tl.float32)
        j = tl.arange(0, KP)
        top_v = tl.full([KP], float("-inf"), dtype=tl.float32)
        top_i = tl.zeros([KP], dtype=tl.int32)
        for r in tl.static_range(K):
            m = tl.max(v, 0)
            i = tl.minimum(tl.min(tl.where(v == m, e, EP), 0), E - 1)  # (E - 1: a NaN row picks a real expert)
            top_v = tl.where(j == r, m, top_v)
            top_i = tl.where(j == r, i, top_i)
            v = tl.where(e == i, float("-inf"), v)
        p = tl.where(j < K, tl.exp(top_v - tl.max(top_v, 0)), 0.0)
        tl.store(ids_ptr + t * K + j, top_i, mask=j < K)
        tl.store(w_ptr + t * K + j, (p / tl.sum(p, 0)).to(w_ptr.dtype.element_ty), mask=j < K)


def topk_softmax_ref(logits: torch.Tensor, k: int, dtype: torch.dtype | None = None):
    vals, ids = logits.float().topk(k, dim=-1)
    return ids, torch.softmax(vals, dim=-1).to(dtype or logits.dtype)


def topk_softmax(logits: torch.Tensor, k: int, dtype: torch.dtype | None = None, *,
                 force_triton: bool | None = None):
    """``(ids, weights)`` of each row's top ``k`` logits (module docstring). One launch, no host synchronisation."""
    if logits.dim() != 2 or not 0 < k <= logits.shape[1]:
        raise ValueError(f"topk_softmax: logits {tuple(logits.shape)} must be [T, E] with 0 < k={k} <= E")
    if not use_triton(logits, force_triton) or logits.stride(-1) != 1:
        return topk_softmax_ref(logits, k, dtype)
    T, E = logits.shape
    ids = torch.empty(T, k, dtype=torch.int32, device=logits.device)
    w = torch.empty(T, k, dtype=dtype or logits.dtype, device=logits.device)
    if T:
        _topk_softmax_kernel[(T,)](logits, ids, w, E, logits.stride(0), K=k, KP=next_pow2(k), EP=max(16, next_pow2(E)),
                                   num_warps=1, **pdl_args(logits))
    return ids, w
