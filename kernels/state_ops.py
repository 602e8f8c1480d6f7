"""Batched operations on state slots, all layers at once.

A pool tensor is ``[L, slots, ...]`` (layer-major, slot second). These are the scheduler's deferred
state mutations, executed on the forward stream at the start of a batch: copy-on-write from a tree
snapshot into a request's slot, zeroing a fresh slot, and the masked scatter that writes tracked
intermediate states into snapshot slots.
"""

from __future__ import annotations

import torch


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


def copy_slots(pool, src, dst, *, force_triton: bool | None = None) -> None:
    del force_triton  # the Triton kernels land with the kernels issue
    copy_slots_ref(pool, src, dst)


def clear_slots(pool, idx, *, force_triton: bool | None = None) -> None:
    del force_triton
    clear_slots_ref(pool, idx)


def scatter_steps(dst, src, idx, step, *, force_triton: bool | None = None) -> None:
    del force_triton
    scatter_steps_ref(dst, src, idx, step)
