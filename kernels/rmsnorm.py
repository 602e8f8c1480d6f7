"""Residual add + RMSNorm, fused: the pre-norm of every Mamba2 block and the final norm.

Hugging Face semantics: the new residual is ``residual + x`` (``x`` itself for the first block), kept
in fp32 when ``residual_in_fp32`` and otherwise in ``x``'s dtype; the norm reads the new residual cast
to ``x``'s dtype, normalises it in fp32, casts the result back to ``x``'s dtype, then multiplies by
the weight: ``weight * (h * rsqrt(mean(h^2) + eps)).to(x.dtype)`` with ``h = residual.to(x.dtype)``.

Shapes: x ``[T, D]`` (the previous block's output, or the embeddings before the first block);
residual ``[T, D]`` or None (first block); weight ``[D]``. Returns ``(out, residual)``: ``out`` in
``x``'s dtype (``result_type(weight, x)``) and the new residual.
"""

from __future__ import annotations

import torch

from mambaserve.kernels._dispatch import HAS_TRITON, next_pow2, tl, triton, use_triton

if HAS_TRITON:

    @triton.jit
    def add_residual(x_ptrs, r_ptrs, mask, scale, HAS_RES: tl.constexpr, res_t: tl.constexpr):
        """(new residual, the value the norm reads) at ``x_ptrs``: ``x * scale (+ r)`` summed in fp32 and rounded once
        to ``res_t`` (torch's add), then that in x's dtype, as fp32."""
        r = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32) * scale
        if HAS_RES:
            r += tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)
        r = r.to(res_t)
        return r, r.to(x_ptrs.dtype.element_ty).to(tl.float32)

    @triton.jit
    def _rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, D, eps, scale, x_t, r_t, o_t, ro_t,
                        HAS_RES: tl.constexpr, STORE_RES: tl.constexpr, BLOCK: tl.constexpr):
        """Grid (T,): one row. Rounds where the reference rounds: the sum in fp32 then once to the
        residual's dtype (torch's add), the residual to x's dtype, the normalised value to x's dtype."""
        t = tl.program_id(0)
        c = tl.arange(0, BLOCK)
        m = c < D
        r, h = add_residual(x_ptr + t * x_t + c, res_ptr + t * r_t + c, m, scale, HAS_RES, res_out_ptr.dtype.element_ty)
        if STORE_RES:
            tl.store(res_out_ptr + t * ro_t + c, r, mask=m)
        inv = tl.rsqrt(tl.sum(h * h, axis=0) / D + eps)
        y = (h * inv).to(x_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + c, mask=m, other=0.0).to(out_ptr.dtype.element_ty).to(tl.float32)
        # the fp32 product of two bf16/fp16 values is exact: one rounding, as torch's elementwise mul
        tl.store(out_ptr + t * o_t + c, (y * w).to(out_ptr.dtype.element_ty), mask=m)


def _residual_dtype(x: torch.Tensor, residual: torch.Tensor | None, residual_in_fp32: bool) -> torch.dtype:
    dtype = torch.float32 if residual_in_fp32 else x.dtype
    if residual is not None and residual.dtype != dtype:
        raise ValueError(f"residual is {residual.dtype}, expected {dtype} (residual_in_fp32={residual_in_fp32})")
    return dtype


def new_residual(x: torch.Tensor, residual: torch.Tensor | None, residual_in_fp32: bool) -> torch.Tensor:
    """The buffer a kernel writes ``residual + x`` into; ``x`` itself when there is nothing to add and
    no dtype to change (the kernel then writes nothing: store only when the result ``is not x``)."""
    rdtype = _residual_dtype(x, residual, residual_in_fp32)
    if residual is None and rdtype == x.dtype:
        return x
    return torch.empty(x.shape, dtype=rdtype, device=x.device)


def rmsnorm_ref(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    residual_in_fp32: bool = False,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    rdtype = _residual_dtype(x, residual, residual_in_fp32)
    if scale != 1.0:  # one rounding of residual + x * scale, as the kernel
        residual = ((x.float() * scale) + (0.0 if residual is None else residual.float())).to(rdtype)
    else:
        residual = x.to(rdtype) if residual is None else residual + x
    h = residual.to(x.dtype).float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype), residual


def rmsnorm(x, residual, weight, eps: float, residual_in_fp32: bool = False, scale: float = 1.0, *,
            force_triton: bool | None = None):
    """Residual add + RMSNorm: see the module docstring. One launch; with no residual in x's dtype
    the new residual is ``x`` itself (nothing written). ``scale``: the new residual is ``residual + x * scale``
    (Granite's ``residual_multiplier``), rounded once."""
    rows_ok = (x.dim() == 2 and x.stride(-1) == 1 and weight.stride(-1) == 1
               and (residual is None or (residual.shape == x.shape and residual.stride(-1) == 1)))
    if not use_triton(x, force_triton) or not rows_ok:
        return rmsnorm_ref(x, residual, weight, eps, residual_in_fp32, scale)
    T, D = x.shape
    out = torch.empty(T, D, dtype=torch.result_type(weight, x), device=x.device)
    res_out = new_residual(x, residual, residual_in_fp32) if scale == 1.0 else torch.empty(
        x.shape, dtype=_residual_dtype(x, residual, residual_in_fp32), device=x.device)
    if T == 0:
        return out, res_out
    BLOCK = next_pow2(D)
    res = residual if residual is not None else x
    _rmsnorm_kernel[(T,)](
        x, res, weight, out, res_out, D, float(eps), float(scale), x.stride(0), res.stride(0), out.stride(0),
        res_out.stride(0),
        HAS_RES=residual is not None, STORE_RES=res_out is not x, BLOCK=BLOCK, num_warps=min(16, max(1, BLOCK // 256)))
    return out, res_out
