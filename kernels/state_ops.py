"""Batched operations on state slots, all layers at once.

A pool tensor is ``[L, slots, ...]`` (layer-major, slot second). These are the scheduler's deferred
state mutations, executed on the forward stream at the start of a batch: copy-on-write from a tree
snapshot into a request's slot, zeroing a fresh slot, and the masked scatter that writes tracked
intermediate states into snapshot slots.
"""

from __future__ import annotations

import torch

from mambaserve.kernels._dispatch import HAS_TRITON, tl, triton, use_triton

# 4096 elements per program: 16 KB of fp32 each way, enough loads in flight per SM to stay near the copy
# bandwidth; a slot of a 2.7b layer (80x64x128 fp32) is 160 programs per (layer, slot).
_BLOCK = 4096
_WARPS = 8


def copy_slots_ref(pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """``pool[:, dst[i]] = pool[:, src[i]]``. Destinations are distinct from every source."""
    if src.numel():
        pool[:, dst] = pool[:, src]


def clear_slots_ref(pool: torch.Tensor, idx: torch.Tensor) -> None:
    """``pool[:, idx] = 0``."""
    if idx.numel():
        pool[:, idx] = 0


def scatter_steps_ref(dst: torch.Tensor, src: torch.Tensor, idx: torch.Tensor, step: torch.Tensor) -> None:
    """``dst[:, idx[r]] = src[:, r, step[r]]`` for every row ``r`` with ``step[r] >= 0``.

    dst ``[L, slots, ...]``; src ``[L, R, steps, ...]``; idx, step ``[R]``.
    """
    rows = (step >= 0).nonzero().flatten()
    if rows.numel():
        dst[:, idx[rows]] = src[:, rows, step[rows]].to(dst.dtype)



if HAS_TRITON:

    @triton.jit
    def _copy_slots_kernel(pool_ptr, src_ptr, dst_ptr, E, stride_l, stride_s, BLOCK: tl.constexpr):
        """Grid (cdiv(E, BLOCK), L, n): ``pool[l, dst[i], e] = pool[l, src[i], e]``."""
        pid_e, layer, i = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        offs = pid_e * BLOCK + tl.arange(0, BLOCK)
        mask = offs < E
        base = pool_ptr + layer.to(tl.int64) * stride_l
        src = tl.load(src_ptr + i).to(tl.int64)
        dst = tl.load(dst_ptr + i).to(tl.int64)
        vals = tl.load(base + src * stride_s + offs, mask=mask)
        tl.store(base + dst * stride_s + offs, vals, mask=mask)

    @triton.jit
    def _clear_slots_kernel(pool_ptr, idx_ptr, E, stride_l, stride_s, BLOCK: tl.constexpr):
        """Grid (cdiv(E, BLOCK), L, n): ``pool[l, idx[i], e] = 0``."""
        pid_e, layer, i = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        offs = pid_e * BLOCK + tl.arange(0, BLOCK)
        slot = tl.load(idx_ptr + i).to(tl.int64)
        ptrs = pool_ptr + layer.to(tl.int64) * stride_l + slot * stride_s + offs
        tl.store(ptrs, tl.zeros([BLOCK], dtype=pool_ptr.dtype.element_ty), mask=offs < E)

    @triton.jit
    def _scatter_steps_kernel(dst_ptr, src_ptr, idx_ptr, step_ptr, E, stride_dl, stride_ds, stride_sl,
                              stride_sr, stride_st, BLOCK: tl.constexpr):
        """Grid (cdiv(E, BLOCK), L, R): rows with ``step[r] < 0`` load and store nothing (masked)."""
        pid_e, layer, r = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        step = tl.load(step_ptr + r).to(tl.int64)
        slot = tl.load(idx_ptr + r).to(tl.int64)
        offs = pid_e * BLOCK + tl.arange(0, BLOCK)
        mask = offs < tl.where(step >= 0, E, 0)  # scalar flag folded into the bound
        step = tl.maximum(step, 0)
        slot = tl.maximum(slot, 0)
        src = src_ptr + layer.to(tl.int64) * stride_sl + r.to(tl.int64) * stride_sr + step * stride_st + offs
        vals = tl.load(src, mask=mask)
        dst = dst_ptr + layer.to(tl.int64) * stride_dl + slot * stride_ds + offs
        tl.store(dst, vals.to(dst_ptr.dtype.element_ty), mask=mask)


def _flat(t: torch.Tensor, lead: int) -> torch.Tensor | None:
    """View ``t`` as ``[*t.shape[:lead], E]`` with contiguous trailing elements, or None."""
    try:
        v = t.view(*t.shape[:lead], -1)
    except RuntimeError:
        return None
    return v if v.stride(-1) == 1 else None


def _grid(E: int, *rest: int):
    return (triton.cdiv(E, _BLOCK), *rest)


def copy_slots(pool, src, dst, *, force_triton: bool | None = None) -> None:
    """``pool[:, dst[i]] = pool[:, src[i]]`` for all layers, one launch, no host sync."""
    flat = _flat(pool, 2)
    if not use_triton(pool, force_triton) or flat is None:
        return copy_slots_ref(pool, src, dst)
    n = src.numel()
    if n == 0:
        return None
    L, _, E = flat.shape
    _copy_slots_kernel[_grid(E, L, n)](flat, src, dst, E, flat.stride(0), flat.stride(1), BLOCK=_BLOCK,
                                       num_warps=_WARPS)
    return None


def clear_slots(pool, idx, *, force_triton: bool | None = None) -> None:
    """``pool[:, idx] = 0`` for all layers, one launch."""
    flat = _flat(pool, 2)
    if not use_triton(pool, force_triton) or flat is None:
        return clear_slots_ref(pool, idx)
    n = idx.numel()
    if n == 0:
        return None
    L, _, E = flat.shape
    _clear_slots_kernel[_grid(E, L, n)](flat, idx, E, flat.stride(0), flat.stride(1), BLOCK=_BLOCK,
                                        num_warps=_WARPS)
    return None


def scatter_steps(dst, src, idx, step, *, force_triton: bool | None = None) -> None:
    """Fused masked scatter (see ``scatter_steps_ref``): one launch over every row, masked rows move
    no bytes, no host synchronisation, so it is safe inside a CUDA graph."""
    d, s = _flat(dst, 2), _flat(src, 3)
    if not use_triton(dst, force_triton) or d is None or s is None:
        return scatter_steps_ref(dst, src, idx, step)
    R = idx.numel()
    if R == 0:
        return None
    L, _, E = d.shape
    _scatter_steps_kernel[_grid(E, L, R)](d, s, idx, step, E, d.stride(0), d.stride(1), s.stride(0),
                                          s.stride(1), s.stride(2), BLOCK=_BLOCK, num_warps=_WARPS)
    return None
