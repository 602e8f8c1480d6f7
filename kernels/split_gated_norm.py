"""Mamba2's gated RMSNorm when its one group is split over tensor-parallel ranks, with out_proj after it.

At ``--tensor-parallel-size N`` a rank holds ``d_inner / N`` channels of each Mamba2 mixer. With one norm
group (``n_groups = 1``: mamba2-2.7b, Granite 4.0-H, Bamba) the norm's scale needs every rank's channels, and
out_proj is row-parallel: its output is summed over the ranks anyway. The projection is linear, so each rank
projects its gated, weighted channels unscaled and the scale applies after the sum::

    split_gated_norm:        h = x * silu(z)  ->  (h * weight) [T, D]  and  sum(h^2) / group + eps / N  [T]
    (out_proj, then one all-reduce of the projections and the sums together)
    split_gated_norm_finish: out = projection * rsqrt(sum) (+ bias)

The sums ride in the projections' buffer, in their dtype: each as two values, ``hi`` (the sum rounded) and
``lo`` (what rounding left), whose sum over the ranks keeps ~16 bits of the total even in bf16, so one
all-reduce carries both. Shapes: x, z ``[T, D]`` (row stride free); weight ``[D]``; ``sums`` ``[T, 2]``;
projection ``[T, H]``.

Rounding differs from the unsplit norm (which rounds the normalised row to the dtype before the weight):
``h * weight`` is rounded once, the scale applies to the fp32-accumulated sum.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mambaserve.kernels._dispatch import HAS_TRITON, next_pow2, tl, triton, use_triton

if HAS_TRITON:

    @triton.jit
    def _split_gated_norm_kernel(x_ptr, z_ptr, w_ptr, out_ptr, sums_ptr, D, inv_group, eps_share, x_t, z_t, o_t,
                                 BLOCK: tl.constexpr):
        """Grid (T,): one row, ``BLOCK`` channels at a time; its sum of squares in fp32."""
        t = tl.program_id(0)
        ss = tl.zeros([BLOCK], dtype=tl.float32)
        for d0 in range(0, D, BLOCK):
            c = d0 + tl.arange(0, BLOCK)
            m = c < D
            xv = tl.load(x_ptr + t * x_t + c, mask=m, other=0.0).to(tl.float32)
            zv = tl.load(z_ptr + t * z_t + c, mask=m, other=0.0).to(tl.float32)
            h = xv * zv * tl.sigmoid(zv)
            ss += h * h
            w = tl.load(w_ptr + c, mask=m, other=0.0).to(tl.float32)
            tl.store(out_ptr + t * o_t + c, (h * w).to(out_ptr.dtype.element_ty), mask=m)
        total = tl.sum(ss, axis=0) * inv_group + eps_share
        hi = total.to(sums_ptr.dtype.element_ty)
        tl.store(sums_ptr + 2 * t, hi)
        tl.store(sums_ptr + 2 * t + 1, (total - hi.to(tl.float32)).to(sums_ptr.dtype.element_ty))

    @triton.jit
    def _finish_kernel(p_ptr, sums_ptr, b_ptr, out_ptr, H, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
        """Grid (T, cdiv(H, BLOCK))."""
        t, j = tl.program_id(0), tl.program_id(1)
        c = j * BLOCK + tl.arange(0, BLOCK)
        m = c < H
        r = tl.rsqrt(tl.load(sums_ptr + 2 * t).to(tl.float32) + tl.load(sums_ptr + 2 * t + 1).to(tl.float32))
        y = tl.load(p_ptr + t * H + c, mask=m, other=0.0).to(tl.float32) * r
        if HAS_BIAS:
            y += tl.load(b_ptr + c, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * H + c, y.to(out_ptr.dtype.element_ty), mask=m)


def _hi_lo(total: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    hi = total.to(dtype)
    return torch.stack([hi, (total - hi.float()).to(dtype)], dim=-1)


def split_gated_norm_ref(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int,
                         ranks: int, sums: torch.Tensor) -> torch.Tensor:
    h = x.float() * F.silu(z.float())
    sums.copy_(_hi_lo(h.pow(2).sum(-1) / group_size + eps / ranks, sums.dtype))
    return (h * weight.float()).to(x.dtype)


def split_gated_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int,
                     ranks: int, sums: torch.Tensor, *, force_triton: bool | None = None) -> torch.Tensor:
    """``h * weight`` of this rank's channels (``h = x * silu(z)``), and each row's share of the norm's mean square
    (its ``sum(h^2) / group_size + eps / ranks``) into ``sums`` ``[T, 2]`` as (hi, lo)."""
    T, D = x.shape
    if sums.shape != (T, 2) or not sums.is_contiguous():
        raise ValueError(f"sums must be a contiguous [{T}, 2], got {tuple(sums.shape)}")
    rows_ok = x.stride(-1) == 1 and z.stride(-1) == 1 and weight.stride(-1) == 1
    if not use_triton(x, force_triton) or not rows_ok:
        return split_gated_norm_ref(x, z, weight, eps, group_size, ranks, sums)
    out = torch.empty(T, D, dtype=x.dtype, device=x.device)
    if T:
        BLOCK = min(1024, next_pow2(D))
        _split_gated_norm_kernel[(T,)](x, z, weight, out, sums, D, 1.0 / group_size, float(eps) / ranks, x.stride(0),
                                       z.stride(0), out.stride(0), BLOCK=BLOCK, num_warps=4)
    return out


def split_gated_norm_finish_ref(projection: torch.Tensor, sums: torch.Tensor,
                                bias: torch.Tensor | None = None) -> torch.Tensor:
    out = projection.float() * torch.rsqrt(sums.float().sum(-1, keepdim=True))
    return (out + bias.float() if bias is not None else out).to(projection.dtype)


def split_gated_norm_finish(projection: torch.Tensor, sums: torch.Tensor, bias: torch.Tensor | None = None, *,
                            force_triton: bool | None = None) -> torch.Tensor:
    """``projection * rsqrt(hi + lo)`` per row (the sums over the ranks), plus ``bias``."""
    if not use_triton(projection, force_triton) or not projection.is_contiguous():
        return split_gated_norm_finish_ref(projection, sums, bias)
    T, H = projection.shape
    out = torch.empty_like(projection)
    if T:
        BLOCK = min(1024, next_pow2(H))
        _finish_kernel[(T, triton.cdiv(H, BLOCK))](projection, sums, bias if bias is not None else projection, out, H,
                                                   HAS_BIAS=bias is not None, BLOCK=BLOCK, num_warps=4)
    return out
