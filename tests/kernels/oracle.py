"""fp64 sequential recurrences: the ground truth every kernel reference is checked against."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def ssm_recurrence(x, dt, A, B, C, D=None, init=None, dt_bias=None):
    """One sequence, token by token. x [L,H,P], dt [L,H] raw, B/C [L,G,N].

    Returns (y [L,H,P], states [L,H,P,N]: the state after each token), all float64.
    """
    L, H, P = x.shape
    G, N = B.shape[1:]
    x, B, C = x.double(), B.double(), C.double()
    dt = dt.double() + (dt_bias.double() if dt_bias is not None else 0.0)
    dt = F.softplus(dt)
    state = init.double().clone() if init is not None else x.new_zeros(H, P, N)
    ys, states = [], []
    for t in range(L):
        Bt = B[t].repeat_interleave(H // G, dim=0)  # [H, N]
        Ct = C[t].repeat_interleave(H // G, dim=0)
        state = torch.exp(dt[t] * A.double())[:, None, None] * state + (dt[t][:, None] * x[t])[..., None] * Bt[:, None, :]
        y = torch.einsum("hpn,hn->hp", state, Ct)
        if D is not None:
            y = y + D.double()[:, None] * x[t]
        ys.append(y)
        states.append(state)
    return torch.stack(ys), torch.stack(states)


def conv_recurrence(x, weight, bias, init=None):
    """One sequence. x [L, D], weight [D, K], init [D, K-1] oldest first. Returns silu(conv) float64."""
    L, Dm = x.shape
    K = weight.shape[1]
    hist = init.double() if init is not None else x.new_zeros(Dm, K - 1, dtype=torch.float64)
    full = torch.cat([hist, x.double().t()], dim=1)
    out = []
    for t in range(L):
        y = (full[:, t:t + K] * weight.double()).sum(-1)
        if bias is not None:
            y = y + bias.double()
        out.append(F.silu(y))
    return torch.stack(out), full[:, full.shape[1] - (K - 1):]
