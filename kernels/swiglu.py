"""SwiGLU's activation over a fused gate-and-up projection: ``silu(gate) * up`` in one launch.

Shapes: ``x`` ``[T, 2n]`` (rows may be strided: a column slice of a wider projection), gate columns ``[0, n)``
first, then up ``[n, 2n)`` (Granite's ``shared_mlp.input_linear``). Returns ``[T, n]`` in ``x``'s dtype, rounded as
the reference's two torch ops round: ``silu(gate)`` to the dtype, then the product.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mambaserve.kernels._dispatch import HAS_TRITON, next_pow2, pdl_args, pdl_start, tl, triton, use_triton

if HAS_TRITON:

    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, n, x_t, o_t, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
        """Grid (T, cdiv(n, BLOCK))."""
        pdl_start(USE_PDL)
        t, c = tl.program_id(0).to(tl.int64), tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = c < n
        g = tl.load(x_ptr + t * x_t + c, mask=m, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + t * x_t + n + c, mask=m, other=0.0).to(tl.float32)
        act = (g * tl.sigmoid(g)).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + t * o_t + c, (act * u).to(out_ptr.dtype.element_ty), mask=m)


def silu_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_mul(x: torch.Tensor, *, force_triton: bool | None = None) -> torch.Tensor:
    """``silu(x[:, :n]) * x[:, n:]`` (module docstring); two torch launches become one."""
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"silu_mul: x {tuple(x.shape)} must be [T, 2n]")
    if not use_triton(x, force_triton) or x.stride(-1) != 1:
        return silu_mul_ref(x)
    T, n = x.shape[0], x.shape[1] // 2
    out = torch.empty(T, n, dtype=x.dtype, device=x.device)
    if T:
        BLOCK = min(1024, next_pow2(n))
        _silu_mul_kernel[(T, triton.cdiv(n, BLOCK))](x, out, n, x.stride(0), out.stride(0), BLOCK=BLOCK, num_warps=4,
                                                     **pdl_args(x))
    return out
