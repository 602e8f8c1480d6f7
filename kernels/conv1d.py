"""Depthwise causal conv1d over packed variable-length sequences, and its decode update.

Shapes: x ``[T, D]`` (packed tokens of several sequences, ``cu_seqlens [S+1]`` their offsets) or
``[B, D]`` (one token per row for decode); weight ``[D, K]``; bias ``[D]``; the conv state pool
``[slots, D, K-1]`` holds, per slot, the last ``K-1`` inputs seen (oldest first). x may have any
strides (the model passes a column slice of the in_proj output, read in place); the output is
contiguous, except where the decode update is given ``out`` (the model writes it over its input).

Prefill reads each sequence's initial conv state from its slot (or zeros when
``has_initial_state`` is false) and writes the last ``K-1`` inputs back to the same slot. Decode rows
with slot index ``-1`` are padding: their output is zero and no slot is touched; prefill sequences with
slot ``-1`` (padding of the prefill CUDA graphs, ``has_initial_state`` false) are computed and their
state is dropped, and empty sequences touch nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mambaserve.kernels._dispatch import (HAS_TRITON, locate_block, pdl_args, pdl_start, seq_block, tl,
                                         triton, use_triton)
from mambaserve.kernels.config import DEFAULT, KernelConfig

MAX_DECODE_WIDTH = 4  # the decode step keeps the window in registers: Mamba2 and Nemotron-H use 4
_BLOCK_D = 256
_WARPS = 4  # 128 threads over 256 channels: no replicated element, so in-place state updates are safe
# The decode step: a thread a channel (granite-4.0-h-tiny's 3,328 channels on an H200, graph-replayed over 36 layers'
# pools: 6.25 against 7.69 us at 256 rows, 2.82 against 3.60 at 64; the best of 11 tiles of 64 to 1,024 channels in 2
# to 16 warps but at 64 rows, where 512 channels in 16 warps took 2.72)
_UPDATE_WARPS = 8

if HAS_TRITON:

    @triton.jit
    def _window_input(x_ptr, state_ptr, u, beg, slot, has_init, d, m, Dm, x_t, x_d, st_s, st_d, st_k,
                      K: tl.constexpr):
        """Input at position u of the sequence starting at beg, channels d (``m``: those to read): x, or
        before the sequence the slot's conv state (column ``u - beg + K - 1``, oldest first; zeros without
        an initial state), in fp32."""
        xv = tl.load(x_ptr + u * x_t + d * x_d, mask=m & (d < tl.where(u >= beg, Dm, 0)), other=0.0)
        sv = tl.load(state_ptr + slot * st_s + d * st_d + (u - beg + K - 1) * st_k,
                     mask=m & (d < tl.where((u < beg) & has_init, Dm, 0)), other=0.0)
        return tl.where(u >= beg, xv.to(tl.float32), sv.to(tl.float32))

    # S (sequences of the call) bounds masks only: not specialised (== 1, % 16), one compile for every batch
    @triton.jit(do_not_specialize=["S"])
    def _causal_conv1d_varlen_kernel(
        x_ptr, w_ptr, bias_ptr, state_ptr, cu_ptr, slot_ptr, init_ptr, out_ptr, S, Dm,
        x_t, x_d, w_d, w_k, st_s, st_d, st_k, o_t, o_d,
        K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_T: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, STAGES: tl.constexpr,
    ):
        """Grid (T // BLOCK_T + S, cdiv(D, BLOCK_D)): one block of one sequence's tokens (blocks never
        cross sequences), walked token by token with the last K - 1 inputs in registers, so each input
        is read once. The window starts from the K - 1 inputs before the block: x, or before the
        sequence's first token its slot's conv state."""
        seq, _j, tok0, tok1 = locate_block(tl.program_id(0), cu_ptr, cu_ptr, S, BLOCK_T, False, BLOCK_S)
        d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        md = d < Dm
        seq_c = tl.minimum(seq, S - 1)
        beg = tl.load(cu_ptr + seq_c).to(tl.int32)
        slot = tl.maximum(tl.load(slot_ptr + seq_c).to(tl.int64), 0)
        has_init = tl.load(init_ptr + seq_c) != 0
        live = d < tl.where(tok1 > tok0, Dm, 0)  # an empty block past the last sequence reads nothing
        # taps by lag (the input t - lag); lags past the width have zero taps and never-read inputs
        tap = w_ptr + d * w_d
        w0 = tl.load(tap + (K - 1) * w_k, mask=md, other=0.0).to(tl.float32)
        w1 = tl.load(tap + (K - 2) * w_k, mask=md, other=0.0).to(tl.float32)
        w2 = tl.load(tap + (K - 3) * w_k, mask=md & (K > 2), other=0.0).to(tl.float32)
        w3 = tl.load(tap + (K - 4) * w_k, mask=md & (K > 3), other=0.0).to(tl.float32)
        r1 = _window_input(x_ptr, state_ptr, tok0 - 1, beg, slot, has_init, d, live, Dm, x_t, x_d,
                           st_s, st_d, st_k, K)
        r2 = _window_input(x_ptr, state_ptr, tok0 - 2, beg, slot, has_init, d, live & (K > 2), Dm, x_t, x_d,
                           st_s, st_d, st_k, K)
        r3 = _window_input(x_ptr, state_ptr, tok0 - 3, beg, slot, has_init, d, live & (K > 3), Dm, x_t, x_d,
                           st_s, st_d, st_k, K)
        if HAS_BIAS:
            b = tl.load(bias_ptr + d, mask=md, other=0.0).to(tl.float32)
        else:
            b = tl.zeros([BLOCK_D], dtype=tl.float32)
        for t in tl.range(tok0, tok1, num_stages=STAGES):
            xv = tl.load(x_ptr + t * x_t + d * x_d, mask=md, other=0.0).to(tl.float32)
            acc = b + w3 * r3 + w2 * r2 + w1 * r1 + w0 * xv
            if SILU:
                acc = acc * tl.sigmoid(acc)
            tl.store(out_ptr + t * o_t + d * o_d, acc.to(out_ptr.dtype.element_ty), mask=md)
            r3, r2, r1 = r2, r1, xv

    @triton.jit
    def _conv_state_write_kernel(
        x_ptr, state_ptr, cu_ptr, slot_ptr, init_ptr, snap_ptr, snap_len_ptr, Dm, x_t, x_d, st_s, st_d, st_k,
        K: tl.constexpr, SNAP: tl.constexpr, SNAP_LEN: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        """Grid (S, cdiv(D, BLOCK_D)), after the conv: slot <- last K-1 inputs of [old state, x]; with
        ``SNAP``, the snapshot slot (``snap_ptr``, -1: none) <- the K-1 inputs before the last token (``SNAP_LEN``:
        before token ``snap_len[s]`` of this call)."""
        s = tl.program_id(0)
        d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        beg = tl.load(cu_ptr + s).to(tl.int32)
        L = tl.load(cu_ptr + s + 1).to(tl.int32) - beg
        slot = tl.load(slot_ptr + s).to(tl.int64)
        has_init = tl.load(init_ptr + s) != 0
        m = d < tl.where((L > 0) & (slot >= 0), Dm, 0)  # slot -1: a padding sequence, no state
        base = state_ptr + slot * st_s + d * st_d
        # Load every new column before storing any: new column j is the input at position L + j - (K - 1),
        # an old column when the sequence is shorter than the window. 1-D tiles keep all columns of
        # channel d in one thread.
        u = beg + L - (K - 1)
        if SNAP:  # an earlier window, read before the slot's old columns are overwritten
            snap = tl.load(snap_ptr + s).to(tl.int64)
            ms = m & (d < tl.where(snap >= 0, Dm, 0))
            u_snap = u - 1
            if SNAP_LEN:
                u_snap = beg + tl.load(snap_len_ptr + s).to(tl.int32) - (K - 1)
            _write_window(x_ptr, state_ptr, state_ptr + tl.maximum(snap, 0) * st_s + d * st_d, u_snap, beg, slot,
                          has_init, d, ms, Dm, x_t, x_d, st_s, st_d, st_k, K)
        _write_window(x_ptr, state_ptr, base, u, beg, slot, has_init, d, m, Dm, x_t, x_d, st_s, st_d, st_k, K)

    @triton.jit
    def _write_window(x_ptr, state_ptr, dst, u, beg, slot, has_init, d, m, Dm, x_t, x_d, st_s, st_d, st_k,
                      K: tl.constexpr):
        """dst <- the K-1 inputs from position u on (``_window_input``), all loaded before any store."""
        n0 = _window_input(x_ptr, state_ptr, u, beg, slot, has_init, d, m, Dm, x_t, x_d, st_s, st_d, st_k, K)
        if K > 2:
            n1 = _window_input(x_ptr, state_ptr, u + 1, beg, slot, has_init, d, m, Dm, x_t, x_d, st_s, st_d, st_k, K)
        if K > 3:
            n2 = _window_input(x_ptr, state_ptr, u + 2, beg, slot, has_init, d, m, Dm, x_t, x_d, st_s, st_d, st_k, K)
        tl.store(dst, n0.to(state_ptr.dtype.element_ty), mask=m)
        if K > 2:
            tl.store(dst + st_k, n1.to(state_ptr.dtype.element_ty), mask=m)
        if K > 3:
            tl.store(dst + 2 * st_k, n2.to(state_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def conv_load(base, w_ptr, bias_ptr, d, m, md, w_d, w_k, st_k, K: tl.constexpr, HAS_BIAS: tl.constexpr):
        """What one decode conv step of channels ``d`` reads besides its input: the window at ``base``
        (``K - 1`` <= 3 columns ``st_k`` apart, oldest first; ``m``: channels whose state is touched),
        the taps and the bias (``md``: channels that exist), read column by column (a [channels, K-1]
        tile made the batch-8 conv kernel 1.7x slower on an H100). Returns the columns the shift keeps,
        the window's part of the sum and the last tap. Separate from ``conv_finish`` so a kernel can
        issue these reads early."""
        c0 = tl.load(base, mask=m, other=0.0)
        c1 = tl.load(base + st_k, mask=m & (K > 2), other=0.0)
        c2 = tl.load(base + 2 * st_k, mask=m & (K > 3), other=0.0)
        tap = w_ptr + d * w_d
        acc = tl.load(tap, mask=md, other=0.0).to(tl.float32) * c0.to(tl.float32)
        acc += tl.load(tap + w_k, mask=md & (K > 2), other=0.0).to(tl.float32) * c1.to(tl.float32)
        acc += tl.load(tap + 2 * w_k, mask=md & (K > 3), other=0.0).to(tl.float32) * c2.to(tl.float32)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + d, mask=md, other=0.0).to(tl.float32)
        last = tl.load(tap + (K - 1) * w_k, mask=md, other=0.0).to(tl.float32)
        return c1, c2, acc, last

    @triton.jit
    def conv_finish(xv, c1, c2, acc, last, base, m, st_k, K: tl.constexpr, SILU: tl.constexpr,
                    REPLICATED: tl.constexpr):
        """The conv output for fp32 input ``xv`` (activated; ``acc``: the window's part from
        ``conv_load``), and the window shifted in place by one column. With ``REPLICATED`` (several
        warps hold the same channel) a barrier keeps every read of the window before any write."""
        acc += last * xv
        if REPLICATED:
            tl.debug_barrier()
        newest = xv.to(base.dtype.element_ty)
        if K == 2:
            tl.store(base, newest, mask=m)
        elif K == 3:
            tl.store(base, c1, mask=m)
            tl.store(base + st_k, newest, mask=m)
        else:
            tl.store(base, c1, mask=m)
            tl.store(base + st_k, c2, mask=m)
            tl.store(base + 2 * st_k, newest, mask=m)
        if SILU:
            acc = acc * tl.sigmoid(acc)
        return acc

    @triton.jit
    def _causal_conv1d_update_kernel(
        x_ptr, state_ptr, w_ptr, bias_ptr, idx_ptr, out_ptr, Dm,
        x_b, x_d, st_s, st_d, st_k, w_d, w_k, o_b, o_d,
        K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_D: tl.constexpr,
        USE_PDL: tl.constexpr = False,
    ):
        """Grid (rows, cdiv(D, BLOCK_D)). Slot -1: output 0, no state access."""
        pdl_start(USE_PDL)
        b = tl.program_id(0)
        d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        slot = tl.load(idx_ptr + b).to(tl.int64)
        valid = slot >= 0
        slot = tl.maximum(slot, 0)
        md = d < Dm
        m = d < tl.where(valid, Dm, 0)
        xv = tl.load(x_ptr + b * x_b + d * x_d, mask=m, other=0.0).to(tl.float32)
        base = state_ptr + slot * st_s + d * st_d
        c1, c2, acc, last = conv_load(base, w_ptr, bias_ptr, d, m, md, w_d, w_k, st_k, K, HAS_BIAS)
        acc = conv_finish(xv, c1, c2, acc, last, base, m, st_k, K, SILU, False)
        acc = tl.where(valid, acc, 0.0)
        tl.store(out_ptr + b * o_b + d * o_d, acc.to(out_ptr.dtype.element_ty), mask=md)


def _silu_flag(activation: str | None) -> bool:
    if activation in ("silu", "swish"):
        return True
    if activation is None:
        return False
    raise ValueError(f"unsupported activation {activation!r}")




def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation in ("silu", "swish"):
        return F.silu(y)
    if activation is None:
        return y
    raise ValueError(f"unsupported activation {activation!r}")


def causal_conv1d_varlen_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    activation: str | None = "silu",
    snap_slots: torch.Tensor | None = None,
    snap_len: torch.Tensor | None = None,
) -> torch.Tensor:
    D, K = weight.shape
    out = x.new_empty(x.shape)
    bounds = cu_seqlens.tolist()
    slots = state_indices.tolist()
    has_init = has_initial_state.tolist()
    snaps = snap_slots.tolist() if snap_slots is not None else [-1] * len(slots)
    snap_lens = snap_len.tolist() if snap_len is not None else None
    for i, slot in enumerate(slots):
        start, end = bounds[i], bounds[i + 1]
        if end == start:
            continue  # an empty sequence: no output, its slot untouched
        seq = x[start:end].t().float()  # [D, L]
        if has_init[i]:
            prev = conv_state[slot].float()
        else:
            prev = seq.new_zeros(D, K - 1)
        full = torch.cat([prev, seq], dim=1)  # [D, K-1+L]
        y = F.conv1d(full.unsqueeze(0), weight.float().unsqueeze(1), bias.float() if bias is not None else None, groups=D)[0]
        out[start:end] = _activate(y, activation).t().to(x.dtype)
        if snaps[i] >= 0:  # the window before token j of this call (the last one unless snap_len says)
            j = snap_lens[i] if snap_lens is not None else end - start - 1
            conv_state[snaps[i]] = full[:, j:j + K - 1].to(conv_state.dtype)
        if slot >= 0:
            conv_state[slot] = full[:, full.shape[1] - (K - 1):].to(conv_state.dtype)
    return out


def causal_conv1d_update_ref(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    state_indices: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    valid = state_indices >= 0
    idx = state_indices[valid]
    out = x.new_zeros(x.shape)
    if idx.numel() == 0:
        return out
    window = torch.cat([conv_state[idx].float(), x[valid].float().unsqueeze(-1)], dim=-1)  # [b, D, K]
    y = (window * weight.float()).sum(-1)
    if bias is not None:
        y = y + bias.float()
    out[valid] = _activate(y, activation).to(x.dtype)
    conv_state[idx] = window[:, :, 1:].to(conv_state.dtype)
    return out


def conv_varlen_runs_triton(width: int, t: torch.Tensor, force_triton: bool | None = None) -> bool:
    """The Triton path (no host synchronisation) for tensors where ``t`` lives; else the reference. The
    kernels unroll up to 3 state columns (Mamba2 uses width 4)."""
    return 2 <= width <= 4 and use_triton(t, force_triton)


def causal_conv1d_varlen(x, weight, bias, conv_state, cu_seqlens, state_indices, has_initial_state,
                         activation="silu", *, snap_slots: torch.Tensor | None = None,
                         snap_len: torch.Tensor | None = None, force_triton: bool | None = None,
                         config: KernelConfig | None = None):
    """Prefill conv: see the module docstring. Mutates ``conv_state`` in place. Two launches (the
    state write-back must follow every read of the old state); no host synchronisation. Tiles from
    ``config.conv_varlen_tiles`` (the default: KernelConfig says how it was chosen).

    ``snap_slots`` ``[S]``: where to write each sequence's conv state *before its last token* (the
    radix cache's snapshot of the prompt minus its last token, taken in the same pass); -1: none. ``snap_len``
    ``[S]``: instead, the conv state after each sequence's first ``snap_len`` tokens of this call."""
    if not conv_varlen_runs_triton(weight.shape[1], x, force_triton):
        return causal_conv1d_varlen_ref(x, weight, bias, conv_state, cu_seqlens, state_indices,
                                        has_initial_state, activation, snap_slots, snap_len)
    silu = _silu_flag(activation)
    T, Dm = x.shape
    K = weight.shape[1]
    S = state_indices.numel()
    out = x.new_empty(x.shape)
    if T == 0 or S == 0:
        return out
    b = bias if bias is not None else weight
    tiles = (config or DEFAULT).conv_varlen_tiles
    grid = (T // tiles["BLOCK_T"] + S, triton.cdiv(Dm, tiles["BLOCK_D"]))
    _causal_conv1d_varlen_kernel[grid](
        x, weight, b, conv_state, cu_seqlens, state_indices, has_initial_state, out, S, Dm,
        *x.stride(), *weight.stride(), *conv_state.stride(), *out.stride(),
        K=K, HAS_BIAS=bias is not None, SILU=silu, BLOCK_S=seq_block(S), **tiles)
    _conv_state_write_kernel[(S, triton.cdiv(Dm, _BLOCK_D))](
        x, conv_state, cu_seqlens, state_indices, has_initial_state,
        snap_slots if snap_slots is not None else state_indices, snap_len if snap_len is not None else state_indices,
        Dm, *x.stride(), *conv_state.stride(), K=K, SNAP=snap_slots is not None, SNAP_LEN=snap_len is not None,
        BLOCK_D=_BLOCK_D, num_warps=_WARPS)
    return out


def causal_conv1d_update(x, conv_state, weight, bias, state_indices, activation="silu", *, out=None,
                         force_triton: bool | None = None):
    """Decode conv step for one token per row. Mutates ``conv_state`` in place. One launch.
    ``out``: where to write the output (``x`` itself is allowed: each channel is read before it is
    written, by the same thread); a new tensor by default."""
    if not use_triton(x, force_triton):
        y = causal_conv1d_update_ref(x, conv_state, weight, bias, state_indices, activation)
        return y if out is None else out.copy_(y)
    silu = _silu_flag(activation)
    Bsz, Dm = x.shape
    K = weight.shape[1]
    out = x.new_empty(x.shape) if out is None else out
    if Bsz == 0:
        return out
    if not 2 <= K <= MAX_DECODE_WIDTH:
        raise ValueError(f"conv width {K}: the decode kernel takes 2 to {MAX_DECODE_WIDTH}")
    b = bias if bias is not None else weight
    _causal_conv1d_update_kernel[(Bsz, triton.cdiv(Dm, _BLOCK_D))](
        x, conv_state, weight, b, state_indices, out, Dm, *x.stride(), *conv_state.stride(),
        *weight.stride(), *out.stride(), K=K, HAS_BIAS=bias is not None, SILU=silu, BLOCK_D=_BLOCK_D,
        num_warps=_UPDATE_WARPS, **pdl_args(x))
    return out
