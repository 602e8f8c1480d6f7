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

Two more things ride along at batch 1. in_proj's launch also runs Mamba2's conv decode step over its
xBC columns (``ConvStep``; the conv reads the rounded projection, as the unfused conv kernel would), so
a layer is three launches. Under programmatic dependent launch each program asks L2 for the start
of its weight rows before waiting for the previous kernel, so part of them is in L2 when it starts. And
on long rows the K loop is software-pipelined through shared memory (``STAGES``): with loads into
registers each program had one tile in flight, and a 2.7b layer's projections ran at ~65% of copy
bandwidth inside the step (benchmarks/README.md has the A/B of each).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from mambaserve.kernels._dispatch import (HAS_TRITON, next_pow2, pdl_args, pdl_trigger, pdl_wait, prefetch_lines,
                                         prefetch_rows, tl, triton, use_triton)
from mambaserve.kernels.config import DEFAULT, KernelConfig
from mambaserve.kernels.conv1d import MAX_DECODE_WIDTH, causal_conv1d_update
from mambaserve.kernels.gated_rmsnorm import gated_rmsnorm
from mambaserve.kernels.rmsnorm import new_residual, rmsnorm

RESIDUAL, GATED = 1, 2  # the prologue: residual-add RMSNorm, or gated RMSNorm (x * silu(z))

if HAS_TRITON:
    from mambaserve.kernels.conv1d import conv_finish, conv_load  # jitted helpers: they exist with Triton only
    from mambaserve.kernels.rmsnorm import add_residual

    @triton.jit
    def _pre_norm(x_ptr, r_ptr, z_ptr, k, mk, PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr,
                  res_t: tl.constexpr):
        """(value to normalise, new residual) at columns k, in fp32, rounded as the references round."""
        if PROLOGUE == 1:
            r, h = add_residual(x_ptr + k, r_ptr + k, mk, 1.0, HAS_RES, res_t)
        else:
            x = tl.load(x_ptr + k, mask=mk, other=0.0).to(tl.float32)
            zv = tl.load(z_ptr + k, mask=mk, other=0.0).to(tl.float32)
            h = x * zv * tl.sigmoid(zv)
            r = h
        return h, r

    @triton.jit
    def _dot_step(acc, ss, k0, pid, rk, rn, mn, x_ptr, r_ptr, z_ptr, nw_ptr, w_ptr, res_out_ptr, K,
                  PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr, STORE_RES: tl.constexpr, ACC_2D: tl.constexpr):
        """One BLOCK_K step: products into ``acc`` ([BLOCK_N, BLOCK_K] partial sums with ACC_2D, else
        [BLOCK_N] sums), squares of the normalised input into ``ss``."""
        k = k0 + rk
        mk = k < K
        w = tl.load(w_ptr + rn[:, None] * K + k[None, :], mask=mn[:, None] & mk[None, :], other=0.0)
        h, r = _pre_norm(x_ptr, r_ptr, z_ptr, k, mk, PROLOGUE, HAS_RES, res_out_ptr.dtype.element_ty)
        if STORE_RES:
            if pid == 0:
                tl.store(res_out_ptr + k, r, mask=mk)
        ss += h * h
        nw = tl.load(nw_ptr + k, mask=mk, other=0.0).to(tl.float32)
        if ACC_2D:
            acc += w.to(tl.float32) * (h * nw)[None, :]
        else:
            acc += tl.sum(w.to(tl.float32) * (h * nw)[None, :], axis=1)
        return acc, ss

    @triton.jit
    def _norm_linear_kernel(x_ptr, r_ptr, z_ptr, nw_ptr, w_ptr, b_ptr, y_ptr, res_out_ptr, N, K, eps,
                            cw_ptr, cb_ptr, cs_ptr, slot_ptr, conv_col0, conv_dim, cs_s, cs_d, cs_k, cw_d, cw_k,
                            PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr, STORE_RES: tl.constexpr,
                            HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            USE_PDL: tl.constexpr = False, PREFETCH_LINES: tl.constexpr = 0,
                            ACC_2D: tl.constexpr = False, CONV_K: tl.constexpr = 0,
                            CONV_BIAS: tl.constexpr = False, CONV_SILU: tl.constexpr = True,
                            EARLY_CONV: tl.constexpr = False, STAGES: tl.constexpr = 1):
        """Grid (cdiv(N, BLOCK_N),): one row; program pid owns output columns [pid * BLOCK_N, ...).

        One pass: the weight streams from the first iteration while the row's mean square
        accumulates beside the product; rstd, a per-row scalar, scales the sums at the end.
        PREFETCH_LINES > 0: first ask L2 for that many 128-byte lines of each of the program's weight
        rows, before waiting for the previous kernel (the weights do not depend on it).
        ACC_2D: per-column partial sums across the K loop, reduced once at the end.
        CONV_K > 0: columns [conv_col0, conv_col0 + conv_dim) then take one causal-conv decode step
        (width CONV_K; state and weights as kernels.conv1d's) of the row in slot ``slot_ptr[0]``:
        in_proj's xBC leaves the kernel convolved. EARLY_CONV: the conv's reads go out before the PDL wait
        (the kernels that can still be running never write this layer's conv state). STAGES > 1: the K loop's
        loads go through shared memory that many steps deep (cp.async); the sums are the same, bit for bit."""
        pdl_trigger(USE_PDL)
        pid = tl.program_id(0)
        rk = tl.arange(0, BLOCK_K)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        mn = rn < N
        if PREFETCH_LINES > 0:
            prefetch_rows(w_ptr, rn, N, K, K, PREFETCH_LINES)
        if not EARLY_CONV:
            pdl_wait(USE_PDL)
        if CONV_K > 0:  # the conv's reads go out now: their latency hides behind the weight stream
            c = rn - conv_col0
            mc = mn & (c >= 0) & (c < conv_dim)
            slot = tl.load(slot_ptr).to(tl.int64)
            touched = mc & (c < tl.where(slot >= 0, conv_dim, 0))  # scalar flag folded into a bound
            base = cs_ptr + tl.maximum(slot, 0) * cs_s + c * cs_d
            c1, c2, cacc, last = conv_load(base, cw_ptr, cb_ptr, c, touched, mc, cw_d, cw_k, cs_k, CONV_K, CONV_BIAS)
        if EARLY_CONV:
            pdl_wait(USE_PDL)
        ss = tl.zeros([BLOCK_K], dtype=tl.float32)
        if ACC_2D:
            acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            acc, ss = _dot_step(acc, ss, k0, pid, rk, rn, mn, x_ptr, r_ptr, z_ptr, nw_ptr, w_ptr, res_out_ptr, K,
                                PROLOGUE, HAS_RES, STORE_RES, ACC_2D)
        if ACC_2D:
            acc = tl.sum(acc, axis=1)
        acc *= tl.rsqrt(tl.sum(ss, axis=0) / K + eps)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=mn, other=0.0).to(tl.float32)
        if CONV_K > 0:
            xv = acc.to(y_ptr.dtype.element_ty).to(tl.float32)  # the conv reads in_proj's rounded output
            cv = conv_finish(xv, c1, c2, cacc, last, base, touched, cs_k, CONV_K, CONV_SILU, True)
            acc = tl.where(mc, tl.where(slot >= 0, cv, 0.0), acc)
        tl.store(y_ptr + rn, acc.to(y_ptr.dtype.element_ty), mask=mn)


def _tiles(K: int, config: KernelConfig = DEFAULT, tiles: dict | None = None) -> dict:
    """Tiles from H100 sweeps of whole decode steps at batch 1 (benchmarks/decode_step.py --variants;
    benchmarks/README.md), per-column partial sums (ACC_2D) reduced once everywhere.
    From K = 2048 (mamba2-2.7b: in_proj and lm_head 2560, out_proj 5120) two warps per program and the
    weight tiles pipelined through shared memory four K steps deep (STAGES: cp.async keeps three tiles in
    flight per program without holding them in registers): 8 columns x 512-wide steps below K = 4096,
    4 x 1024 from it. Shorter rows (mamba2-130m: 768, 1536) run two to three K steps, too few to
    pipeline: 4 columns x 512, unpipelined, two warps up to K = 1024. PREFETCH_COLS: weight columns per
    row each program asks L2 for before its PDL wait. Overridden by ``config.linear_tiles[K]``, then by
    ``tiles``."""
    if K >= 4096:
        base = {"BLOCK_N": 4, "BLOCK_K": 1024, "num_warps": 2, "STAGES": 4, "PREFETCH_COLS": 2048}
    elif K >= 2048:
        base = {"BLOCK_N": 8, "BLOCK_K": 512, "num_warps": 2, "STAGES": 4, "PREFETCH_COLS": 1024}
    else:
        base = {"BLOCK_N": 4, "BLOCK_K": min(512, max(16, next_pow2(K))), "num_warps": 2 if K <= 1024 else 4,
                "STAGES": 1, "PREFETCH_COLS": 1024}
    return {**base, "ACC_2D": True, **config.linear_tiles.get(K, {}), **(tiles or {})}


def _fits(x: torch.Tensor, weight: torch.Tensor, force_triton: bool | None, config: KernelConfig, *others) -> bool:
    return (config.fuse_norm_linear and x.dim() == 2 and x.shape[0] == 1 and weight.is_contiguous()
            and weight.dtype == x.dtype and all(t is None or t.is_contiguous() for t in (x, *others))
            and use_triton(x, force_triton))


class ConvStep(NamedTuple):
    """A causal-conv decode step (kernels.causal_conv1d_update, SiLU) over output columns ``[col0, col0 +
    D)`` of a projection: Mamba2's conv over the xBC part of in_proj's output, at decode."""
    weight: torch.Tensor  # [D, K]
    bias: torch.Tensor | None  # [D]
    state: torch.Tensor  # [slots, D, K - 1], updated in place
    slots: torch.Tensor  # [rows] slot per row, -1 = padding
    col0: int


def _launch(prologue, x, r, z, norm_weight, eps, weight, bias, res_out, store_res, config, overrides, conv=None):
    N, K = weight.shape
    y = torch.empty(1, N, dtype=x.dtype, device=x.device)
    tiles = _tiles(K, config, overrides)
    cols = min(K, tiles.pop("PREFETCH_COLS"))
    pdl = pdl_args(x)
    if pdl and cols > 0:
        pdl["PREFETCH_LINES"] = prefetch_lines(cols, weight.element_size())
    if conv is not None:
        D, CK = conv.weight.shape
        if not 2 <= CK <= MAX_DECODE_WIDTH:
            raise ValueError(f"conv width {CK}: the decode kernel takes 2 to {MAX_DECODE_WIDTH}")
        conv_args = (conv.weight, conv.bias if conv.bias is not None else conv.weight, conv.state, conv.slots,
                     conv.col0, D, *conv.state.stride(), *conv.weight.stride())
        tiles.update(CONV_K=CK, CONV_BIAS=conv.bias is not None, EARLY_CONV=config.early_conv and bool(pdl))
    else:
        conv_args = (weight, weight, weight, weight, 0, 0, 0, 0, 0, 0, 0)
    _norm_linear_kernel[(triton.cdiv(N, tiles["BLOCK_N"]),)](
        x, r if r is not None else x, z if z is not None else x, norm_weight, weight,
        bias if bias is not None else weight, y, res_out, N, K, float(eps), *conv_args,
        PROLOGUE=prologue, HAS_RES=r is not None, STORE_RES=store_res, HAS_BIAS=bias is not None, **tiles,
        **pdl)
    return y


def _conv_columns(y: torch.Tensor, conv: ConvStep | None, force_triton: bool | None = None) -> torch.Tensor:
    """The unfused conv step over ``y``'s conv columns, in place."""
    if conv is not None:
        cols = y[:, conv.col0:conv.col0 + conv.weight.shape[0]]
        causal_conv1d_update(cols, conv.state, conv.weight, conv.bias, conv.slots, out=cols, force_triton=force_triton)
    return y


def rmsnorm_linear_ref(x, residual, norm_weight, eps, residual_in_fp32, weight, bias=None, conv=None):
    return _unfused(x, residual, norm_weight, eps, residual_in_fp32, weight, bias, conv, None)


def _unfused(x, residual, norm_weight, eps, residual_in_fp32, weight, bias, conv, force_triton):
    h, residual = rmsnorm(x, residual, norm_weight, eps, residual_in_fp32, force_triton=force_triton)
    return _conv_columns(F.linear(h, weight, bias), conv, force_triton), residual


def rmsnorm_linear(x, residual, norm_weight, eps: float, residual_in_fp32: bool, weight, bias=None,
                   conv: ConvStep | None = None, *, force_triton: bool | None = None, tiles: dict | None = None,
                   config: KernelConfig | None = None):
    """``(linear(norm(residual + x)), residual + x)``: kernels.rmsnorm then the projection, then
    ``conv`` over its columns if given. ``config``: fused or not, conv step fused or not, tiles by K;
    ``tiles``: this call's tile overrides (benchmark sweeps)."""
    config = config or DEFAULT
    if not _fits(x, weight, force_triton, config, residual) or norm_weight.dtype != x.dtype:
        return _unfused(x, residual, norm_weight, eps, residual_in_fp32, weight, bias, conv, force_triton)
    res_out = new_residual(x, residual, residual_in_fp32)
    y = _launch(RESIDUAL, x, residual, None, norm_weight, eps, weight, bias, res_out, res_out is not x, config,
                tiles, conv if config.fuse_conv else None)
    return (y if config.fuse_conv else _conv_columns(y, conv, force_triton)), res_out


def gated_rmsnorm_linear_ref(x, z, norm_weight, eps, group_size, weight, bias=None):
    return F.linear(gated_rmsnorm(x, z, norm_weight, eps, group_size).to(x.dtype), weight, bias)


def gated_rmsnorm_linear(x, z, norm_weight, eps: float, group_size: int, weight, bias=None, *,
                         force_triton: bool | None = None, tiles: dict | None = None,
                         config: KernelConfig | None = None):
    """``linear(gated_rmsnorm(x, z))``; fused for one row and a single norm group. ``config`` and
    ``tiles`` as ``rmsnorm_linear``'s."""
    config = config or DEFAULT
    if (not _fits(x, weight, force_triton, config, z) or z is None or group_size != x.shape[-1]
            or norm_weight.dtype != x.dtype):
        return F.linear(gated_rmsnorm(x, z, norm_weight, eps, group_size, config=config).to(x.dtype), weight, bias)
    return _launch(GATED, x, None, z, norm_weight, eps, weight, bias, x, False, config, tiles)
