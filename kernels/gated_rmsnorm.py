"""Gated RMSNorm with groups: ``norm(x * silu(z)) * weight``, normalised per group.

Mamba2 normalises after the gate (``norm_before_gate=False``) and per group of
``group_size = d_inner / n_groups`` channels: the original implementation does so, and it is what
``n_groups > 1`` checkpoints were trained with.

Shapes: x, z ``[T, D]``; weight ``[D]``; ``D % group_size == 0``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mambaserve.kernels._dispatch import HAS_TRITON, next_pow2, pdl_args, pdl_start, tl, triton, use_triton
from mambaserve.kernels.config import DEFAULT, KernelConfig

if HAS_TRITON:

    @triton.jit
    def _gated_rmsnorm_kernel(x_ptr, z_ptr, w_ptr, out_ptr, group_size, eps, x_t, z_t, o_t,
                              HAS_Z: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
        """Grid (T, D // group_size): one group of one row, normalised in fp32. Rounds like the
        reference: the normalised value is cast to x's dtype before the weight multiplies it."""
        pdl_start(USE_PDL)
        t, g = tl.program_id(0), tl.program_id(1)
        c = g * group_size + tl.arange(0, BLOCK)
        m = tl.arange(0, BLOCK) < group_size
        h = tl.load(x_ptr + t * x_t + c, mask=m, other=0.0).to(tl.float32)
        if HAS_Z:
            zv = tl.load(z_ptr + t * z_t + c, mask=m, other=0.0).to(tl.float32)
            h = h * zv * tl.sigmoid(zv)
        r = tl.rsqrt(tl.sum(h * h, axis=0) / group_size + eps)
        y = (h * r).to(x_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + c, mask=m, other=0.0).to(out_ptr.dtype.element_ty).to(tl.float32)
        # the fp32 product of two bf16/fp16 values is exact: one rounding, as torch's elementwise mul
        tl.store(out_ptr + t * o_t + c, (y * w).to(out_ptr.dtype.element_ty), mask=m)


def gated_rmsnorm_ref(
    x: torch.Tensor,
    z: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    group_size: int,
) -> torch.Tensor:
    dtype = x.dtype
    h = x.float()
    if z is not None:
        h = h * F.silu(z.float())
    T, D = h.shape
    g = h.view(T, D // group_size, group_size)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    return weight * g.view(T, D).to(dtype)


def gated_rmsnorm(x, z, weight, eps: float, group_size: int, *, force_triton: bool | None = None,
                  config: KernelConfig | None = None):
    """Under programmatic dependent launch unless ``config.gated_norm_pdl`` is off: in decode the state
    update ahead of it lets it launch early."""
    if x.shape[-1] % group_size:
        raise ValueError(f"width {x.shape[-1]} is not a multiple of group_size {group_size}")
    rows_ok = x.stride(-1) == 1 and (z is None or z.stride(-1) == 1) and weight.stride(-1) == 1
    if not use_triton(x, force_triton) or not rows_ok or x.dim() != 2:
        return gated_rmsnorm_ref(x, z, weight, eps, group_size)
    T, D = x.shape
    out = torch.empty(T, D, dtype=torch.result_type(weight, x), device=x.device)
    if T == 0:
        return out
    BLOCK = next_pow2(group_size)
    zz = z if z is not None else x
    pdl = pdl_args(x) if (config or DEFAULT).gated_norm_pdl else {}
    _gated_rmsnorm_kernel[(T, D // group_size)](
        x, zz, weight, out, group_size, float(eps), x.stride(0), zz.stride(0), out.stride(0),
        HAS_Z=z is not None, BLOCK=BLOCK, num_warps=min(16, max(1, BLOCK // 256)), **pdl)
    return out
