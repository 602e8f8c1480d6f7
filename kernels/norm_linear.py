"""Norm + projection fused for one-token decode: ``linear(norm(x))`` in one launch.

Every projection of a Mamba2 block follows a norm: in_proj after the block's residual-add RMSNorm,
out_proj after the gated RMSNorm, lm_head after the final norm. At batch 1 each projection is a
matrix-vector product bound by streaming its weight, and the norm before it is a tiny one-row kernel
that costs ~2 us of launch and latency (benchmarks/decode_step.py profiled 2.7b at 18 kernels per
layer, then 6). Here every program recomputes the row's norm from the (L2-resident) input while it
streams its few output columns' weight rows: one launch, no norm kernel, wide contiguous weight loads
with fp32 sums (cuBLAS split mamba2-2.7b's out_proj into two kernels at 63% of copy bandwidth).

One pass: the weight streams from the first step while the row's mean square accumulates beside
the product, and the per-row 1/rms scales the sums at the end (a first pass for the norm left each
program idle for a memory round trip: no faster than two kernels). So the normalised row is not
rounded to the input dtype before the product as the unfused path rounds it: results differ from
it by that rounding (relative ~1e-3 in bf16); the new residual is the same add, bit for bit. Only
one row (decode batch 1) and a single norm group take this path; anything else runs the unfused
kernels, whose results are then exactly the unfused ones.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mambaserve.kernels._dispatch import HAS_TRITON, next_pow2, pdl_args, pdl_start, tl, triton, use_triton
from mambaserve.kernels.gated_rmsnorm import gated_rmsnorm
from mambaserve.kernels.rmsnorm import new_residual, rmsnorm

RESIDUAL, GATED = 1, 2  # the prologue: residual-add RMSNorm, or gated RMSNorm (x * silu(z))
FUSED = True  # read per call: benchmarks/decode_step.py --unfused clears it before capturing (A/B)

if HAS_TRITON:

    @triton.jit
    def _pre_norm(x_ptr, r_ptr, z_ptr, k, mk, PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr,
                  res_t: tl.constexpr):
        """(value to normalise, new residual) at columns k, in fp32, rounded as the references round."""
        x = tl.load(x_ptr + k, mask=mk, other=0.0).to(tl.float32)
        if PROLOGUE == 1:
            r = x
            if HAS_RES:
                r += tl.load(r_ptr + k, mask=mk, other=0.0).to(tl.float32)
            r = r.to(res_t)  # the new residual, in its dtype (torch's add rounds once)
            h = r.to(x_ptr.dtype.element_ty).to(tl.float32)
        else:
            zv = tl.load(z_ptr + k, mask=mk, other=0.0).to(tl.float32)
            h = x * zv * tl.sigmoid(zv)
            r = h
        return h, r

    @triton.jit
    def _norm_linear_kernel(x_ptr, r_ptr, z_ptr, nw_ptr, w_ptr, b_ptr, y_ptr, res_out_ptr, N, K, eps,
                            PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr, STORE_RES: tl.constexpr,
                            HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            USE_PDL: tl.constexpr = False):
        """Grid (cdiv(N, BLOCK_N),): one row; program pid owns output columns [pid * BLOCK_N, ...).

        One pass: the weight streams from the first iteration while the row's mean square
        accumulates beside the product; rstd, a per-row scalar, scales the sums at the end."""
        pdl_start(USE_PDL)
        pid = tl.program_id(0)
        rk = tl.arange(0, BLOCK_K)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        mn = rn < N
        ss = tl.zeros([BLOCK_K], dtype=tl.float32)
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + rk
            mk = k < K
            w = tl.load(w_ptr + rn[:, None] * K + k[None, :], mask=mn[:, None] & mk[None, :], other=0.0)
            h, r = _pre_norm(x_ptr, r_ptr, z_ptr, k, mk, PROLOGUE, HAS_RES, res_out_ptr.dtype.element_ty)
            if STORE_RES:
                if pid == 0:
                    tl.store(res_out_ptr + k, r, mask=mk)
            ss += h * h
            nw = tl.load(nw_ptr + k, mask=mk, other=0.0).to(tl.float32)
            acc += tl.sum(w.to(tl.float32) * (h * nw)[None, :], axis=1)
        acc *= tl.rsqrt(tl.sum(ss, axis=0) / K + eps)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=mn, other=0.0).to(tl.float32)
        tl.store(y_ptr + rn, acc.to(y_ptr.dtype.element_ty), mask=mn)


def _tiles(K: int) -> dict:
    """Tiles from an H100 sweep at batch 1 (benchmarks/decode_step.py --projections): 4 output columns
    per program; 512-wide K steps and 4 warps for K = 2560, 1024 and 8 warps for K = 5120."""
    wide = K >= 4096
    return {"BLOCK_N": 4, "BLOCK_K": min(1024 if wide else 512, max(16, next_pow2(K))), "num_warps": 8 if wide else 4}


def _fits(x: torch.Tensor, weight: torch.Tensor, force_triton: bool | None, *others) -> bool:
    return (FUSED and x.dim() == 2 and x.shape[0] == 1 and weight.is_contiguous() and weight.dtype == x.dtype
            and all(t is None or t.is_contiguous() for t in (x, *others)) and use_triton(x, force_triton))


def _launch(prologue, x, r, z, norm_weight, eps, weight, bias, res_out, store_res, config):
    N, K = weight.shape
    y = torch.empty(1, N, dtype=x.dtype, device=x.device)
    tiles = {**_tiles(K), **(config or {})}
    _norm_linear_kernel[(triton.cdiv(N, tiles["BLOCK_N"]),)](
        x, r if r is not None else x, z if z is not None else x, norm_weight, weight,
        bias if bias is not None else weight, y, res_out, N, K, float(eps),
        PROLOGUE=prologue, HAS_RES=r is not None, STORE_RES=store_res, HAS_BIAS=bias is not None, **tiles,
        **pdl_args(x))
    return y


def rmsnorm_linear_ref(x, residual, norm_weight, eps, residual_in_fp32, weight, bias=None):
    h, residual = rmsnorm(x, residual, norm_weight, eps, residual_in_fp32)
    return F.linear(h, weight, bias), residual


def rmsnorm_linear(x, residual, norm_weight, eps: float, residual_in_fp32: bool, weight, bias=None, *,
                   force_triton: bool | None = None, config: dict | None = None):
    """``(linear(norm(residual + x)), residual + x)``: kernels.rmsnorm then the projection.
    ``config`` overrides the tiles (benchmark sweeps)."""
    if not _fits(x, weight, force_triton, residual) or norm_weight.dtype != x.dtype:
        return rmsnorm_linear_ref(x, residual, norm_weight, eps, residual_in_fp32, weight, bias)
    res_out = new_residual(x, residual, residual_in_fp32)
    return _launch(RESIDUAL, x, residual, None, norm_weight, eps, weight, bias, res_out, res_out is not x,
                   config), res_out


def gated_rmsnorm_linear_ref(x, z, norm_weight, eps, group_size, weight, bias=None):
    return F.linear(gated_rmsnorm(x, z, norm_weight, eps, group_size).to(x.dtype), weight, bias)


def gated_rmsnorm_linear(x, z, norm_weight, eps: float, group_size: int, weight, bias=None, *,
                         force_triton: bool | None = None, config: dict | None = None):
    """``linear(gated_rmsnorm(x, z))``; fused for one row and a single norm group."""
    if (not _fits(x, weight, force_triton, z) or z is None or group_size != x.shape[-1]
            or norm_weight.dtype != x.dtype):
        return gated_rmsnorm_linear_ref(x, z, norm_weight, eps, group_size, weight, bias)
    return _launch(GATED, x, None, z, norm_weight, eps, weight, bias, x, False, config)
