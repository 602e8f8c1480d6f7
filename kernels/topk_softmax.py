"""Top-k routing with a softmax over the chosen logits (Granite 4.0-H's router): one launch for what torch runs as a
cast, a top-k (two kernels) and a softmax with its cast, five launches per MoE layer of a decode step.

Shapes: ``logits`` ``[T, E]`` (any float dtype, rows contiguous), ``k <= E``. Returns ``(ids [T, k + always],
weights [T, k + always])``: each row's k largest logits in descending order (ties: the lower expert first), and the
softmax of those k logits computed in fp32 and rounded to ``dtype`` (default the logits'); then ``always`` (default 0)
more columns, experts ``E, E + 1, ...`` with weight 1: experts every token takes (a shared MLP folded into the MoE op
as more experts, Granite's decode). The reference is those torch ops (its ids int64, the kernel's int32:
``kernels.moe`` takes either). A row with NaN logits still gets ids in ``[0, E)``.
"""

from __future__ import annotations

import torch

from mambaserve.kernels._dispatch import HAS_TRITON, next_pow2, pdl_args, pdl_start, tl, triton, use_triton

if HAS_TRITON:

    @triton.jit
    def _topk_softmax_kernel(x_ptr, ids_ptr, w_ptr, E, x_t, K: tl.constexpr, KP: tl.constexpr, EP: tl.constexpr,
                             ALWAYS: tl.constexpr = 0, USE_PDL: tl.constexpr = False):
        """Grid (T,): one row; k rounds of (max, its lowest index, masked out); then the ``ALWAYS`` fixed columns."""
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
        row = t * (K + ALWAYS)
        tl.store(ids_ptr + row + j, top_i, mask=j < K)
        tl.store(w_ptr + row + j, (p / tl.sum(p, 0)).to(w_ptr.dtype.element_ty), mask=j < K)
        if ALWAYS > 0:
            a = tl.arange(0, triton.next_power_of_2(ALWAYS))
            tl.store(ids_ptr + row + K + a, E + a, mask=a < ALWAYS)
            tl.store(w_ptr + row + K + a, tl.full(a.shape, 1.0, w_ptr.dtype.element_ty), mask=a < ALWAYS)


def topk_softmax_ref(logits: torch.Tensor, k: int, dtype: torch.dtype | None = None, always: int = 0):
    vals, ids = logits.float().topk(k, dim=-1)
    w = torch.softmax(vals, dim=-1).to(dtype or logits.dtype)
    if always:
        T, E = logits.shape
        ids = torch.cat([ids, torch.arange(E, E + always, device=ids.device).expand(T, always)], 1)
        w = torch.cat([w, w.new_ones(T, always)], 1)
    return ids, w


def topk_softmax(logits: torch.Tensor, k: int, dtype: torch.dtype | None = None, *, always: int = 0,
                 force_triton: bool | None = None):
    """``(ids, weights)`` of each row's top ``k`` logits, then ``always`` fixed experts (module docstring). One
    launch, no host synchronisation."""
    if logits.dim() != 2 or not 0 < k <= logits.shape[1] or always < 0:
        raise ValueError(f"topk_softmax: logits {tuple(logits.shape)} must be [T, E] with 0 < k={k} <= E "
                         f"(always={always} >= 0)")
    if not use_triton(logits, force_triton) or logits.stride(-1) != 1:
        return topk_softmax_ref(logits, k, dtype, always)
    T, E = logits.shape
    ids = torch.empty(T, k + always, dtype=torch.int32, device=logits.device)
    w = torch.empty(T, k + always, dtype=dtype or logits.dtype, device=logits.device)
    if T:
        _topk_softmax_kernel[(T,)](logits, ids, w, E, logits.stride(0), K=k, KP=next_pow2(k), EP=max(16, next_pow2(E)),
                                   ALWAYS=always, num_warps=1, **pdl_args(logits))
    return ids, w
