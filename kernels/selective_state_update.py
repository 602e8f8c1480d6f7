"""Selective state update (Mamba2 decode): one token per row, states read/written by slot index.

Shapes (``B`` rows): state pool ``[slots, H, P, N]``; x ``[B, H, P]``; dt ``[B, H]`` (raw);
A ``[H]``; B and C ``[B, G, N]``; D ``[H]``; z ``[B, H, P]`` (optional gate); dt_bias ``[H]``;
state_indices ``[B]`` (``-1`` = padding row: output zero, no slot touched); dst_state_indices
``[B]`` optional: write the new state there instead of back to the source slot.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mambaserve.kernels._dispatch import (HAS_TRITON, dt_prologue, next_pow2, pdl_args, pdl_trigger, pdl_wait, tl,
                                         triton, use_triton)
from mambaserve.kernels.config import DEFAULT, KernelConfig
from mambaserve.kernels.ssd_scan import process_dt

if HAS_TRITON:

    @triton.jit
    def _selective_state_update_kernel(
        state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr, idx_ptr, dst_ptr, out_ptr,
        P, N, heads_per_group, dt_lo, dt_hi,
        s_slot, s_h, s_p, s_n, x_b, x_h, x_p, dt_b, dt_h, B_b, B_g, B_n, C_b, C_g, C_n,
        z_b, z_h, z_p, o_b, o_h, o_p,
        HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_DST: tl.constexpr,
        SOFTPLUS: tl.constexpr, CLAMP: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
        USE_PDL: tl.constexpr = False, EARLY_STATE: tl.constexpr = False,
    ):
        """Grid (cdiv(P, BLOCK_P), H, rows). One program: a [BLOCK_P, N] tile of one row's head state,
        read once and written once (the state is >95% of the bytes). Heads before rows in launch order,
        so programs running together stream one slot's contiguous [H, P, N] block: with rows first they
        hit one head's tile in many slots at once (mamba2-2.7b, slots 2.6 MB apart: 77-82% of copy
        bandwidth at batch 128-512 against 96-98%, H100). Padding rows (slot -1) mask every state access,
        so they cost no bandwidth and leave all slots untouched; their output is 0.

        EARLY_STATE (under PDL): the slot index and the state tile are read before waiting for the previous
        kernel, so their latency overlaps its tail. Safe because nothing that can still be running then
        writes them: the kernels before this one in the PDL chain (projections, conv steps, other layers'
        state updates) never touch this layer's state pool, slot copies and clears run as ordinary launches
        that the chain's first kernel waited for, and the slot indices are written before the step."""
        pdl_trigger(USE_PDL)
        if not EARLY_STATE:
            pdl_wait(USE_PDL)
        pid_p, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        slot = tl.load(idx_ptr + b).to(tl.int64)
        valid = slot >= 0
        if HAS_DST:
            dst = tl.load(dst_ptr + b).to(tl.int64)
        else:
            dst = slot
        slot = tl.maximum(slot, 0)
        dst = tl.maximum(dst, 0)
        p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
        n = tl.arange(0, BLOCK_N)
        mp, mn = p < P, n < N
        tile = (p[:, None] * s_p + n[None, :] * s_n)
        mask2 = (p < tl.where(valid, P, 0))[:, None] & mn[None, :]  # scalar flag folded into a bound
        s = tl.load(state_ptr + slot * s_slot + h * s_h + tile, mask=mask2, other=0.0).to(tl.float32)
        if EARLY_STATE:
            pdl_wait(USE_PDL)
        x = tl.load(x_ptr + b * x_b + h * x_h + p * x_p, mask=mp, other=0.0).to(tl.float32)
        dt = dt_prologue(tl.load(dt_ptr + b * dt_b + h * dt_h).to(tl.float32), bias_ptr + h, dt_lo, dt_hi,
                         HAS_BIAS, SOFTPLUS, CLAMP)
        A = tl.load(A_ptr + h).to(tl.float32)
        g = h // heads_per_group
        Bv = tl.load(B_ptr + b * B_b + g * B_g + n * B_n, mask=mn, other=0.0).to(tl.float32)
        Cv = tl.load(C_ptr + b * C_b + g * C_g + n * C_n, mask=mn, other=0.0).to(tl.float32)
        s = s * tl.exp(dt * A) + (dt * x)[:, None] * Bv[None, :]
        tl.store(state_ptr + dst * s_slot + h * s_h + tile, s.to(state_ptr.dtype.element_ty), mask=mask2)
        y = tl.sum(s * Cv[None, :], axis=1)
        if HAS_D:
            y += tl.load(D_ptr + h).to(tl.float32) * x
        if HAS_Z:
            zv = tl.load(z_ptr + b * z_b + h * z_h + p * z_p, mask=mp, other=0.0).to(tl.float32)
            y = y * zv * tl.sigmoid(zv)
        y = tl.where(valid, y, 0.0)
        tl.store(out_ptr + b * o_b + h * o_h + p * o_p, y.to(out_ptr.dtype.element_ty), mask=mp)


def state_update_tiles(P: int, N: int, rows_x_heads: int, small: tuple[int, int]) -> tuple[int, int]:
    """(BLOCK_P, num_warps). 4K state elements per program (32 x 128 at N = 128), within 1% of the best of a
    6-config sweep on an H100 for batch x heads >= 2560 in most shapes (benchmarks/README.md), in 2 warps: on an
    H200 (nemotron-h-8b's and granite-4.0-h-tiny's heads, batch 64 and 256, graph-replayed) 0.90-0.96 of the copy
    bandwidth against 0.88-0.95 in 4 warps, the best of 7 tiles at 3 of the 4 and 0.2% from it at the fourth.
    Under 256 rows x heads (batch 1) more, smaller programs fill the GPU: 4-row
    tiles on one warp gave the fastest whole mamba2-2.7b and -130m decode steps of 9 (BLOCK_P, warps)
    pairs (H100, benchmarks/decode_step.py --variants; benchmarks/README.md)."""
    if rows_x_heads < 256:
        return min(small[0], next_pow2(P)), small[1]
    return max(1, min(next_pow2(P), 4096 // next_pow2(N))), 2


def selective_state_update_ref(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    *,
    state_indices: torch.Tensor,
    dst_state_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    H = x.shape[1]
    G = B.shape[1]
    valid = state_indices >= 0
    out = torch.zeros_like(x)
    src = state_indices[valid]
    if src.numel() == 0:
        return out
    dst = dst_state_indices[valid] if dst_state_indices is not None else src
    dtv = process_dt(dt[valid], dt_bias, dt_softplus, dt_limit)  # [b, H]
    xv = x[valid].float()
    Bv = B[valid].float().repeat_interleave(H // G, dim=1)  # [b, H, N]
    Cv = C[valid].float().repeat_interleave(H // G, dim=1)
    s = state[src].float()  # [b, H, P, N]
    s = torch.exp(dtv * A.float())[..., None, None] * s + (dtv[..., None] * xv)[..., None] * Bv[:, :, None, :]
    y = torch.einsum("bhpn,bhn->bhp", s, Cv)
    if D is not None:
        y = y + D.float()[:, None] * xv
    if z is not None:
        y = y * F.silu(z[valid].float())
    state[dst] = s.to(state.dtype)
    out[valid] = y.to(x.dtype)
    return out


def decode_runs_triton(t: torch.Tensor) -> bool:
    """The decode step's kernels (this state update, the conv step, ``write_kv`` and the paged decode attention)
    run Triton for tensors where ``t`` lives; their references index rows with boolean masks (``state_indices >=
    0``, ``slot_mapping >= 0``), a host synchronisation, so only the Triton step can be captured in a CUDA graph."""
    return use_triton(t, None)


def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=True,
                           dt_limit=(0.0, float("inf")), *, state_indices, dst_state_indices=None,
                           force_triton: bool | None = None, block_p: int | None = None,
                           num_warps: int | None = None, config: KernelConfig | None = None):
    """Decode step: see the module docstring. Mutates ``state`` in place.

    With ``dst_state_indices``, a destination slot must not be another row's source slot (the rows
    run concurrently). ``block_p`` / ``num_warps`` override the tile choice (benchmark sweeps);
    ``config``: the small-batch tiles and whether the state is read before the PDL wait.
    """
    config = config or DEFAULT
    if not use_triton(x, force_triton):
        return selective_state_update_ref(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit,
                                          state_indices=state_indices, dst_state_indices=dst_state_indices)
    Bsz, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    if H % G:
        raise ValueError(f"heads {H} not divisible by groups {G}")
    if state.shape[1:] != (H, P, N):
        raise ValueError(f"state {tuple(state.shape)} does not match [slots, {H}, {P}, {N}]")
    out = torch.empty_like(x)
    if Bsz == 0:
        return out
    BP, warps = state_update_tiles(P, N, Bsz * H, config.state_update_small_tiles)
    BP, warps = block_p or BP, num_warps or warps
    lo, hi = dt_limit
    clamp = lo > 0.0 or hi != float("inf")
    dst = dst_state_indices if dst_state_indices is not None else state_indices
    zz = z if z is not None else x
    grid = (triton.cdiv(P, BP), H, Bsz)
    pdl = pdl_args(x)
    if pdl and config.early_state:
        pdl["EARLY_STATE"] = True
    _selective_state_update_kernel[grid](
        state, x, dt, A, B, C, D if D is not None else A, zz, dt_bias if dt_bias is not None else A,
        state_indices, dst, out, P, N, H // G, float(lo), float(min(hi, 3.0e38)),
        *state.stride(), *x.stride(), *dt.stride(), *B.stride(), *C.stride(), *zz.stride(), *out.stride(),
        HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=dt_bias is not None,
        HAS_DST=dst_state_indices is not None, SOFTPLUS=dt_softplus, CLAMP=clamp,
        BLOCK_P=BP, BLOCK_N=next_pow2(N), num_warps=warps, **pdl)
    return out
