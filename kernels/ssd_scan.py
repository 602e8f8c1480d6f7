"""Chunked SSD scan (Mamba2) for prefill over packed variable-length sequences.

Shapes (``T`` packed tokens, ``S`` sequences, ``H`` heads, ``P`` head dim, ``G`` groups, ``N`` state):
  x ``[T, H, P]``, dt ``[T, H]`` (raw, before bias/softplus), A ``[H]`` (negative), B and C
  ``[T, G, N]``, D ``[H]``, dt_bias ``[H]``, cu_seqlens ``[S+1]`` offsets of each sequence in T,
  ssm_state pool ``[slots, H, P, N]``, state_indices ``[S]`` (slot of each sequence),
  has_initial_state ``[S]`` (read the slot, or start from zero), seq_start_pos ``[S]`` (absolute
  position of each sequence's first token in its whole history).

Each sequence's final state is written back to its slot (slot -1: a padding sequence, whose state is
neither read nor written; the prefill CUDA graphs pad with them). Chunks are aligned to *absolute* positions
(multiples of ``chunk_size`` in the sequence's history, not in this call), so a sequence resumed
mid-chunk emits the same boundary states as one pass would; the states at every absolute multiple of
``chunk_size`` that this call crosses are returned when asked (the radix cache's tracked snapshots).
Positions are counted in tokens covered: a boundary state at position ``k`` is the state after the
first ``k`` tokens of the history.

This module holds the launcher (its host planning and tiles) and the pure-torch reference
``ssd_scan_varlen_ref``; the four jitted kernels are in ``ssd_scan_kernels``, whose docstring says what each does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mambaserve.kernels._dispatch import (HAS_TRITON, Target, interpreting, next_pow2, seq_block, target, tl,
                                          tma_descriptor, triton, use_triton)
from mambaserve.kernels.config import DEFAULT, KernelConfig

if HAS_TRITON:
    from mambaserve.kernels.ssd_scan_kernels import (_ssd_bmm_kernel, _ssd_chunk_scan_kernel, _ssd_prep_kernel,
                                                     _ssd_states_kernel)


@dataclass
class BoundaryStates:
    """States at absolute chunk boundaries crossed by a call (fp32)."""

    states: torch.Tensor  # [K, H, P, N]
    seq_idx: torch.Tensor  # [K] which sequence of the call
    positions: torch.Tensor  # [K] tokens of history covered by the state


def process_dt(dt: torch.Tensor, dt_bias: torch.Tensor | None, dt_softplus: bool,
               dt_limit: tuple[float, float]) -> torch.Tensor:
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    lo, hi = dt_limit
    if lo > 0.0 or hi != float("inf"):
        dt = dt.clamp(min=lo, max=hi)
    return dt


def _segsum(a: torch.Tensor) -> torch.Tensor:
    """``out[..., i, j] = sum(a[..., j+1:i+1])`` for ``j <= i``, ``-inf`` above the diagonal.

    Summing masked copies (not differencing a cumsum) keeps it exact at extreme decays.
    """
    Q = a.shape[-1]
    a = a[..., None].expand(*a.shape, Q)  # [..., i, j] = a[i]
    strict = torch.tril(torch.ones(Q, Q, dtype=torch.bool, device=a.device), diagonal=-1)
    s = torch.cumsum(a.masked_fill(~strict, 0.0), dim=-2)
    lower = torch.tril(torch.ones(Q, Q, dtype=torch.bool, device=a.device))
    return s.masked_fill(~lower, float("-inf"))


def _scan_one(x, dt, A, B, C, init, offset, Q):
    """One sequence, fp32. x [L,H,P], dt [L,H], B/C [L,H,N] (already per head), init [H,P,N].

    ``offset`` = absolute start position mod Q: that many zero-dt tokens are prepended, which leave
    the state unchanged (decay exp(0) = 1, input dt*x = 0), so chunk c ends at an absolute boundary.
    Returns (y [L,H,P], final state, chunk-end states [nc,H,P,N], number of full chunks crossed).
    """
    L, H, P = x.shape
    total = offset + L
    nc = -(-total // Q)
    pad = (offset, nc * Q - total)

    def chunks(t):  # [L, ...] -> [nc, Q, ...] padded with zeros
        t = torch.cat([t.new_zeros(pad[0], *t.shape[1:]), t, t.new_zeros(pad[1], *t.shape[1:])])
        return t.view(nc, Q, *t.shape[1:])

    xdt, a, Bc, Cc = chunks(x * dt[..., None]), chunks(dt * A), chunks(B), chunks(C)
    a = a.permute(0, 2, 1)  # [nc, H, Q]
    a_cum = torch.cumsum(a, dim=-1)
    # Within a chunk: attention-like form with the decay mask.
    decay = torch.exp(_segsum(a))  # [nc, H, Q(l), Q(s)]
    scores = torch.einsum("clhn,cshn->chls", Cc, Bc) * decay
    y = torch.einsum("chls,cshp->clhp", scores, xdt)
    # Each chunk's own contribution to the state at its end, from zero.
    to_end = torch.exp(a_cum[..., -1:] - a_cum)  # [nc, H, Q]
    chunk_states = torch.einsum("clhn,chl,clhp->chpn", Bc, to_end, xdt)
    # Across chunks: a short sequential recurrence over chunk states.
    state = init
    starts, ends = [], []
    chunk_decay = torch.exp(a_cum[..., -1])  # [nc, H]
    for c in range(nc):
        starts.append(state)
        state = chunk_decay[c][:, None, None] * state + chunk_states[c]
        ends.append(state)
    start_states = torch.stack(starts)
    y = y + torch.einsum("clhn,chpn->clhp", Cc, start_states) * torch.exp(a_cum).permute(0, 2, 1)[..., None]
    y = y.reshape(nc * Q, H, P)[offset:offset + L]
    return y, state, torch.stack(ends), total // Q


def ssd_scan_varlen_ref(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    chunk_size: int,
    cu_seqlens: torch.Tensor,
    ssm_state: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    seq_start_pos: torch.Tensor | None = None,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    return_boundary_states: bool = False,
    track: list[tuple[int, int]] | None = None,
    snap_slots: torch.Tensor | None = None,
    snap_len: torch.Tensor | None = None,
) -> tuple[torch.Tensor, BoundaryStates | None]:
    return_boundary_states = return_boundary_states or track is not None
    T, H, P = x.shape
    G = B.shape[1]
    dt = process_dt(dt, dt_bias, dt_softplus, dt_limit)
    A = A.float()
    y = torch.empty(T, H, P, dtype=x.dtype, device=x.device)
    bounds = cu_seqlens.tolist()
    slots = state_indices.tolist()
    has_init = has_initial_state.tolist()
    starts = seq_start_pos.tolist() if seq_start_pos is not None else [0] * len(slots)
    snaps = snap_slots.tolist() if snap_slots is not None else [-1] * len(slots)
    snap_lens = snap_len.tolist() if snap_len is not None else None
    b_states, b_seq, b_pos = [], [], []
    for i, slot in enumerate(slots):
        s, e = bounds[i], bounds[i + 1]
        if e == s:
            continue  # an empty sequence: no output, its slot untouched
        xs = x[s:e].float()
        Bs = B[s:e].float().repeat_interleave(H // G, dim=1)
        Cs = C[s:e].float().repeat_interleave(H // G, dim=1)
        init = ssm_state[slot].float() if has_init[i] else xs.new_zeros(H, P, ssm_state.shape[-1])
        offset = starts[i] % chunk_size
        if snaps[i] >= 0:  # the state after the first j tokens (all but the last): the same scan over them
            j = snap_lens[i] if snap_lens is not None else e - s - 1
            before = _scan_one(xs[:j], dt[s:s + j], A, Bs[:j], Cs[:j], init, offset, chunk_size)[1] if j else init
            ssm_state[snaps[i]] = before.to(ssm_state.dtype)
        ys, final, ends, n_full = _scan_one(xs, dt[s:e], A, Bs, Cs, init, offset, chunk_size)
        if D is not None:
            ys = ys + D.float()[:, None] * xs
        y[s:e] = ys.to(x.dtype)
        if slot >= 0:
            ssm_state[slot] = final.to(ssm_state.dtype)
        if return_boundary_states and n_full:
            b_states.append(ends[:n_full])
            b_seq += [i] * n_full
            first = starts[i] - offset
            b_pos += [first + (c + 1) * chunk_size for c in range(n_full)]
    boundary = None
    if return_boundary_states:
        N = ssm_state.shape[-1]
        boundary = BoundaryStates(
            states=torch.cat(b_states) if b_states else x.new_zeros(0, H, P, N, dtype=torch.float32),
            seq_idx=torch.tensor(b_seq, dtype=torch.long),
            positions=torch.tensor(b_pos, dtype=torch.long),
        )
        if track is not None:
            boundary = BoundaryStates(states=boundary.states[_track_index(b_seq, b_pos, track)],
                                      seq_idx=torch.tensor([int(i) for i, _ in track], dtype=torch.long),
                                      positions=torch.tensor([int(q) for _, q in track], dtype=torch.long))
    return y, boundary


def _track_index(b_seq: list[int], b_pos: list[int], track: list[tuple[int, int]]) -> list[int]:
    """Where each tracked (sequence, absolute position) is among a call's boundaries (b_seq, b_pos)."""
    index = {(i, q): k for k, (i, q) in enumerate(zip(b_seq, b_pos))}
    ks = [index.get((int(i), int(q)), -1) for i, q in track]
    for (i, q), k in zip(track, ks):
        if k < 0:
            raise ValueError(f"tracked state ({i}, {q}): not a chunk boundary this call crosses")
    if len(set(ks)) < len(ks):
        raise ValueError("tracked states listed twice")
    return ks


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16} if HAS_TRITON else {}

# Tiles of the kernels, picked from H100 sweeps at 2.7b dims, 8x2048 and 1x16384 tokens (KernelConfig.scan_tiles
# and a call's tiles= override them). chunk: the kernels work on chunks of this many tokens when the model's chunk
# size is larger (boundary states stay at the model's multiples): half of Q = 256 halves the causal products
# inside a chunk and doubles the start states written and read, a net gain. Output kernel: block_m rows x
# block_p columns per program, block_k tokens per step, the start-state product over N in block_n slices, 4 warps
# capped at maxnreg registers (80: 5-6 programs per SM instead of 4 at the uncapped 128; 275 vs 309 us at
# 8x2048). State kernel: a [state_block_p, state_block_n] tile per program on state_warps warps, state_block_k
# tokens per step, the token blocks unrolled and the chunk loop pipelined (state_unroll). The tile follows the
# number of walks: with fewer than state_small_per_sm programs per SM at state_small_p rows (one or two long
# sequences) it is state_small_p rows on state_small_warps warps (1x16384: 439 vs 460 us for the scan at 64
# rows); with at least state_wide_per_sm per SM at state_wide_n columns (many sequences) it spans those columns
# (x read once and B half as often); between, the default tile (the best of an H100 sweep); overrides naming
# the tile or the warps get exactly that.
# tma / state_tma: tiles read through TMA tensor descriptors where the layout allows (Hopper or newer, and the
# interpreter) and the call has at least tma_min_tokens tokens: with descriptors at every size the 2.7b 2k-token
# TTFT was 52.5 ms against 43.4 through pointers (most likely their host time per launch), while from 8k tokens
# up TMA wins (prefill 8x2048: 82.6k vs 76.9k tok/s).
SCAN_CONFIG = {"chunk": 128, "block_m": 64, "block_k": 64, "block_p": 64, "block_n": 128, "num_warps": 4,
               "num_stages": 2, "maxnreg": 80, "state_block_p": 64, "state_block_n": 64, "state_block_k": 64,
               "state_warps": 4, "state_stages": 3, "state_unroll": True, "state_wide_n": 128,
               "state_wide_per_sm": 4, "state_small_p": 16, "state_small_warps": 1, "state_small_per_sm": 8,
               "cb_tile": 64, "cb_warps": 4, "prep_heads": 16, "tma": True, "state_tma": True, "tma_min_tokens": 4096}


def _rows_of(t: torch.Tensor, inner: int):
    """[T, A, inner] with the last two dims packed (stride inner, 1): its row stride, else None."""
    return t.stride(0) if t.stride(2) == 1 and t.stride(1) == inner else None


def state_tiles(S: int, H: int, P: int, N: int, tg: Target, overrides: dict | None = None) -> tuple[int, int, int]:
    """(block_p, block_n, warps) of the state kernel for ``S`` sequences (SCAN_CONFIG's note): a shape's one
    variant per class of S, so ``server/engine/warm_up.py`` compiles each class at start."""
    cfg = {**SCAN_CONFIG, **(overrides or {})}
    BP, BN = max(16, next_pow2(P)), max(16, next_pow2(N))
    SBP, SBN, warps = min(cfg["state_block_p"], BP), min(cfg["state_block_n"], BN), cfg["state_warps"]
    if tg.compiled and not {"state_block_p", "state_block_n", "state_warps"} & set(overrides or {}):
        small_p = min(cfg["state_small_p"], BP)
        if S * H * triton.cdiv(P, small_p) * triton.cdiv(N, SBN) < cfg["state_small_per_sm"] * tg.sms:
            SBP, warps = small_p, cfg["state_small_warps"]  # few sequences: many small one-warp walks
        elif S * H * triton.cdiv(P, SBP) * triton.cdiv(N, cfg["state_wide_n"]) >= cfg["state_wide_per_sm"] * tg.sms:
            SBN = min(cfg["state_wide_n"], BN)  # enough sequences to fill the GPU with the wider tile
    return SBP, SBN, warps


def tma_tokens(tg: Target, overrides: dict | None = None) -> int | None:
    """The fewest tokens of a call whose tiles are read through TMA descriptors on ``tg`` (a variant of the state and
    output kernels each), None where none is (not Hopper, or the config turns it off)."""
    cfg = {**SCAN_CONFIG, **(overrides or {})}
    if not (cfg["tma"] or cfg["state_tma"]) or not (tg.hopper if tg.compiled else interpreting()):
        return None
    return cfg["tma_min_tokens"]


def _ssd_scan_triton(x, dt, A, B, C, *, chunk_size, cu_seqlens, ssm_state, state_indices, has_initial_state,
                     seq_start_pos, D, dt_bias, dt_softplus, dt_limit, return_boundary_states, track, snap_slots,
                     snap_len, overrides):
    cfg = {**SCAN_CONFIG, **overrides}
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    S = state_indices.numel()
    Q = chunk_size
    QI = min(cfg["chunk"], Q)  # the kernels' chunks; boundary states stay at multiples of Q
    if QI < 16 or QI & (QI - 1):
        raise ValueError(f"scan config chunk={cfg['chunk']}: a power of two >= 16 is needed")
    dev = x.device
    y = torch.empty(T, H, P, dtype=x.dtype, device=dev)
    NC = T // QI + 2 * S
    BLOCK_S = seq_block(S)
    BP, BN = max(16, next_pow2(P)), max(16, next_pow2(N))
    has_pos = seq_start_pos is not None
    pos = seq_start_pos if has_pos else cu_seqlens
    lo, hi = dt_limit
    clamp = lo > 0.0 or hi != float("inf")
    # fp32 inputs keep fp32 products (tf32 would cost ~1e-3 relative); bf16/fp16 use the tensor cores.
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    # Matrix-unit operand type: the inputs' (bf16/fp16/fp32). The Triton 3.9 interpreter multiplies
    # bf16 operands wrongly, so under it the operands go in as fp32 (same values, exact products).
    tg = target(x)
    dot_t = tl.float32 if not tg.compiled or x.dtype == torch.float32 else _TL_DTYPES[x.dtype]
    # Start states and C B^T are only ever matrix-unit operands: stored in the inputs' 16-bit type when
    # they have one (half the bytes, no precision lost: the output kernel's products take them in it), else fp32.
    op_dtype = x.dtype if x.dtype in _TL_DTYPES else torch.float32
    dtp = torch.empty(H, T, dtype=torch.float32, device=dev)
    cs = torch.empty(H, T, dtype=torch.float32, device=dev)
    ws = torch.empty(H, T, dtype=torch.float32, device=dev)
    meta = torch.empty(NC, 2, dtype=torch.int32, device=dev)
    start = torch.empty(NC, H, P, N, dtype=op_dtype, device=dev)
    cb = torch.empty(NC, G, QI, QI, dtype=op_dtype, device=dev)

    boundary = None
    bnd = bnd_dest = start  # placeholder pointers when no boundary output
    return_boundary_states = return_boundary_states or track is not None
    if return_boundary_states:
        # The one host synchronisation: the number of boundaries sizes the output.
        bounds = cu_seqlens.tolist()
        starts = seq_start_pos.tolist() if has_pos else [0] * S
        b_seq, b_pos = [], []
        for i in range(S):
            L = bounds[i + 1] - bounds[i]
            first = (starts[i] // Q + 1) * Q
            for q in range(first, starts[i] + L + 1, Q):
                b_seq.append(i)
                b_pos.append(q)
        # where each boundary's state goes: all of them, or only the tracked ones (the others are not written)
        dest = list(range(len(b_pos)))
        if track is not None:
            dest = [-1] * len(b_pos)
            for j, k in enumerate(_track_index(b_seq, b_pos, track)):
                dest[k] = j
            b_seq, b_pos = [int(i) for i, _ in track], [int(q) for _, q in track]
        bnd_dest = torch.tensor(dest, dtype=torch.int32).to(dev, non_blocking=True)
        bnd = torch.empty(len(b_pos), H, P, N, dtype=torch.float32, device=dev)
        boundary = BoundaryStates(states=bnd, seq_idx=torch.tensor(b_seq, dtype=torch.long),
                                  positions=torch.tensor(b_pos, dtype=torch.long))
    PH = cfg["prep_heads"]
    _ssd_prep_kernel[(NC, triton.cdiv(H, PH))](
        dt, dt_bias if dt_bias is not None else A, A, cu_seqlens, pos, dtp, cs, ws, meta, S, T, H,
        float(lo), float(min(hi, 3.0e38)), *dt.stride(),
        Q=QI, HAS_POS=has_pos, HAS_BIAS=dt_bias is not None, SOFTPLUS=dt_softplus, CLAMP=clamp,
        BLOCK_Q=QI, BLOCK_S=BLOCK_S, BLOCK_H=PH, num_warps=4)
    SBP, SBN, state_warps = state_tiles(S, H, P, N, tg, overrides)
    SBK = min(cfg["state_block_k"], QI)
    x_rows, B_rows, C_rows = _rows_of(x, P), _rows_of(B, N), _rows_of(C, N)
    sx_desc = sB_desc = None
    # TMA descriptors only where the GPU work is big (SCAN_CONFIG's note: short prompts' TTFT)
    tma_ok = (least := tma_tokens(tg, overrides)) is not None and T >= least
    if tma_ok and cfg["state_tma"] and x_rows and B_rows and P % SBP == 0 and N % SBN == 0:
        sx_desc = tma_descriptor(x, T, H * P, x_rows, [SBK, SBP])
        sB_desc = tma_descriptor(B, T, G * N, B_rows, [SBK, SBN])
    state_tma = sx_desc is not None and sB_desc is not None
    _ssd_states_kernel[(triton.cdiv(P, SBP) * triton.cdiv(N, SBN), H, S)](
        x, B, sx_desc if state_tma else x, sB_desc if state_tma else B, ws, cs, dtp, cu_seqlens, pos, state_indices,
        has_initial_state, snap_slots if snap_slots is not None else state_indices,
        snap_len if snap_len is not None else state_indices, start, ssm_state, bnd, bnd_dest,
        S, T, H, P, N, H // G, *x.stride(), *B.stride(), *ssm_state.stride(), Q=Q, QI=QI, HAS_POS=has_pos,
        HAS_BND=return_boundary_states, SNAP=snap_slots is not None, SNAP_LEN=snap_len is not None, BLOCK_K=SBK,
        BLOCK_P=SBP, BLOCK_N=SBN,
        N_BLOCKS=triton.cdiv(N, SBN), BLOCK_S=BLOCK_S, UNROLL=cfg["state_unroll"], STAGES=cfg["state_stages"],
        CHUNK_STAGES=cfg["state_stages"] if cfg["state_unroll"] else 1, TMA=state_tma,
        PREC=prec, DOT_T=dot_t, num_warps=state_warps)
    BM = min(cfg["block_m"], QI)
    BK = min(cfg["block_k"], BM)
    OBP, OBN = min(cfg["block_p"], BP), min(cfg["block_n"], BN)
    # the output kernel reads C B^T up to each row block's end: tiles no smaller than the row blocks
    TILE = min(max(cfg["cb_tile"], BM), QI)
    _ssd_bmm_kernel[(NC * (QI // TILE) ** 2, G)](
        C, B, meta, cb, G, N, *C.stride(), *B.stride(), Q=QI, TILE=TILE, N_TILES=QI // TILE, BLOCK_N=BN,
        PREC=prec, DOT_T=dot_t, num_warps=cfg["cb_warps"])
    descs = None
    if tma_ok and cfg["tma"] and x_rows and C_rows and P % OBP == 0 and N % OBN == 0:
        descs = [tma_descriptor(x, T, H * P, x_rows, [BK, OBP]), tma_descriptor(x, T, H * P, x_rows, [BM, OBP]),
                 tma_descriptor(C, T, G * N, C_rows, [BM, OBN]), tma_descriptor(cb, NC * G * QI, QI, QI, [BM, BK]),
                 tma_descriptor(start, NC * H * P, N, N, [OBP, OBN])]
        if any(d is None for d in descs):
            descs = None
    _ssd_chunk_scan_kernel[(H * triton.cdiv(P, OBP) * NC * (QI // BM),)](
        x, C, cb, D if D is not None else A, dtp, cs, meta, start, y, *(descs or (x, x, C, cb, start)),
        T, H, G, P, N, H // G, *x.stride(), *C.stride(), *y.stride(),
        HAS_D=D is not None, Q=QI, M_BLOCKS=QI // BM, P_BLOCKS=triton.cdiv(P, OBP), BLOCK_M=BM,
        BLOCK_K=BK, BLOCK_P=OBP, BLOCK_N=OBN, N_BLOCKS=triton.cdiv(N, OBN), STAGES=cfg["num_stages"],
        TMA=descs is not None, PREC=prec, DOT_T=dot_t, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}))
    return y, boundary


def snapshot_chunk(chunk_size: int, config: KernelConfig | None = None) -> int:
    """The kernels' chunk for a model chunk size: a ``snap_len`` snapshot lies in a sequence's last chunk of these
    (chunks aligned to absolute positions), e.g. at a page boundary when the page size divides it."""
    return min({**SCAN_CONFIG, **(config or DEFAULT).scan_tiles}["chunk"], chunk_size)


def scan_runs_triton(chunk_size: int, t: torch.Tensor, force_triton: bool | None = None) -> bool:
    """The Triton path (no host synchronisation without boundary states) for tensors where ``t`` lives;
    else the reference. tl.dot tiles need a power-of-two chunk of at least 16."""
    pow2 = chunk_size >= 16 and not chunk_size & (chunk_size - 1)
    return pow2 and use_triton(t, force_triton)


def ssd_scan_varlen(x, dt, A, B, C, *, chunk_size, cu_seqlens, ssm_state, state_indices,
                    has_initial_state, seq_start_pos=None, D=None, dt_bias=None, dt_softplus=True,
                    dt_limit=(0.0, float("inf")), return_boundary_states=False, track=None, snap_slots=None,
                    snap_len=None, force_triton: bool | None = None, tiles: dict | None = None,
                    config: KernelConfig | None = None):
    """Prefill scan: see the module docstring. Mutates ``ssm_state`` in place.

    ``snap_slots`` ``[S]``: where to write each sequence's state *before its last token* (-1: none): the
    radix cache keeps the prompt minus its last token, so that the same prompt sent again still has a
    token to run, while this pass samples from the whole prompt (no separate step for its last token).
    ``snap_len`` ``[S]``: instead, the state after each sequence's first ``snap_len`` tokens of this call (the
    radix cache's page-aligned snapshot of a hybrid's prompt), a position in the sequence's last chunk of
    ``snapshot_chunk(chunk_size)`` tokens (Triton computes the snapshot there; the reference anywhere).

    ``track``: (sequence, absolute position) pairs, each a multiple of ``chunk_size`` that the call crosses:
    only those boundary states are returned (in that order) and written. Triton path: no host
    synchronisation unless boundary states are asked for (one, to size the output). Sequences must have
    distinct slots. Tiles: ``SCAN_CONFIG``, overridden by ``config.scan_tiles``, then by this call's
    ``tiles`` (benchmark sweeps).
    """
    if x.shape[1] % B.shape[1]:
        raise ValueError(f"heads {x.shape[1]} not divisible by groups {B.shape[1]}")
    kwargs = dict(chunk_size=chunk_size, cu_seqlens=cu_seqlens, ssm_state=ssm_state,
                  state_indices=state_indices, has_initial_state=has_initial_state,
                  seq_start_pos=seq_start_pos, D=D, dt_bias=dt_bias, dt_softplus=dt_softplus,
                  dt_limit=dt_limit, return_boundary_states=return_boundary_states, track=track,
                  snap_slots=snap_slots, snap_len=snap_len)
    if not scan_runs_triton(chunk_size, x, force_triton) or x.shape[0] == 0 or state_indices.numel() == 0:
        return ssd_scan_varlen_ref(x, dt, A, B, C, **kwargs)
    overrides = {**(config or DEFAULT).scan_tiles, **(tiles or {})}
    return _ssd_scan_triton(x, dt, A, B, C, overrides=overrides, **kwargs)
