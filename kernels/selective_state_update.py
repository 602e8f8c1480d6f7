"""Selective state update (Mamba2 decode): one token per row, states read/written by slot index.

Shapes (``B`` rows): state pool ``[slots, H, P, N]``; x ``[B, H, P]``; dt ``[B, H]`` (raw);
A ``[H]``; B and C ``[B, G, N]``; D ``[H]``; z ``[B, H, P]`` (optional gate); dt_bias ``[H]``;
state_indices ``[B]`` (``-1`` = padding row: output zero, no slot touched); dst_state_indices
``[B]`` optional: write the new state there instead of back to the source slot.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mambaserve.kernels.ssd_scan import process_dt


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


def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=True,
                           dt_limit=(0.0, float("inf")), *, state_indices, dst_state_indices=None,
                           force_triton: bool | None = None):
    """Decode step: see the module docstring. Mutates ``state`` in place."""
    del force_triton  # the Triton kernel lands with the kernels issue
    return selective_state_update_ref(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit,
                                      state_indices=state_indices, dst_state_indices=dst_state_indices)
