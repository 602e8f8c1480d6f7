"""Chunked SSD scan (Mamba2) for prefill over packed variable-length sequences.

Shapes (``T`` packed tokens, ``S`` sequences, ``H`` heads, ``P`` head dim, ``G`` groups, ``N`` state):
  x ``[T, H, P]``, dt ``[T, H]`` (raw, before bias/softplus), A ``[H]`` (negative), B and C
  ``[T, G, N]``, D ``[H]``, dt_bias ``[H]``, cu_seqlens ``[S+1]`` offsets of each sequence in T,
  ssm_state pool ``[slots, H, P, N]``, state_indices ``[S]`` (slot of each sequence),
  has_initial_state ``[S]`` (read the slot, or start from zero), seq_start_pos ``[S]`` (absolute
  position of each sequence's first token in its whole history).

Each sequence's final state is written back to its slot. Chunks are aligned to *absolute* positions
(multiples of ``chunk_size`` in the sequence's history, not in this call), so a sequence resumed
mid-chunk emits the same boundary states as one pass would; the states at every absolute multiple of
``chunk_size`` that this call crosses are returned when asked (the radix cache's tracked snapshots).
Positions are counted in tokens covered: a boundary state at position ``k`` is the state after the
first ``k`` tokens of the history.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


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
) -> tuple[torch.Tensor, BoundaryStates | None]:
    T, H, P = x.shape
    G = B.shape[1]
    dt = process_dt(dt, dt_bias, dt_softplus, dt_limit)
    A = A.float()
    y = torch.empty(T, H, P, dtype=x.dtype, device=x.device)
    bounds = cu_seqlens.tolist()
    slots = state_indices.tolist()
    has_init = has_initial_state.tolist()
    starts = seq_start_pos.tolist() if seq_start_pos is not None else [0] * len(slots)
    b_states, b_seq, b_pos = [], [], []
    for i, slot in enumerate(slots):
        s, e = bounds[i], bounds[i + 1]
        xs = x[s:e].float()
        Bs = B[s:e].float().repeat_interleave(H // G, dim=1)
        Cs = C[s:e].float().repeat_interleave(H // G, dim=1)
        init = ssm_state[slot].float() if has_init[i] else xs.new_zeros(H, P, ssm_state.shape[-1])
        offset = starts[i] % chunk_size
        ys, final, ends, n_full = _scan_one(xs, dt[s:e], A, Bs, Cs, init, offset, chunk_size)
        if D is not None:
            ys = ys + D.float()[:, None] * xs
        y[s:e] = ys.to(x.dtype)
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
    return y, boundary


def ssd_scan_varlen(x, dt, A, B, C, *, chunk_size, cu_seqlens, ssm_state, state_indices,
                    has_initial_state, seq_start_pos=None, D=None, dt_bias=None, dt_softplus=True,
                    dt_limit=(0.0, float("inf")), return_boundary_states=False,
                    force_triton: bool | None = None):
    """Prefill scan: see the module docstring. Mutates ``ssm_state`` in place."""
    if x.shape[1] % B.shape[1]:
        raise ValueError(f"heads {x.shape[1]} not divisible by groups {B.shape[1]}")
    del force_triton  # the Triton kernel lands with the kernels issue
    return ssd_scan_varlen_ref(
        x, dt, A, B, C, chunk_size=chunk_size, cu_seqlens=cu_seqlens, ssm_state=ssm_state,
        state_indices=state_indices, has_initial_state=has_initial_state, seq_start_pos=seq_start_pos,
        D=D, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit,
        return_boundary_states=return_boundary_states)
