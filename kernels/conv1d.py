"""Depthwise causal conv1d over packed variable-length sequences, and its decode update.

Shapes: x ``[T, D]`` (packed tokens of several sequences, ``cu_seqlens [S+1]`` their offsets) or
``[B, D]`` (one token per row for decode); weight ``[D, K]``; bias ``[D]``; the conv state pool
``[slots, D, K-1]`` holds, per slot, the last ``K-1`` inputs seen (oldest first).

Prefill reads each sequence's initial conv state from its slot (or zeros when
``has_initial_state`` is false) and writes the last ``K-1`` inputs back to the same slot. Decode rows
with slot index ``-1`` are padding: their output is zero and no slot is touched.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
) -> torch.Tensor:
    D, K = weight.shape
    out = torch.empty_like(x)
    bounds = cu_seqlens.tolist()
    slots = state_indices.tolist()
    has_init = has_initial_state.tolist()
    for i, slot in enumerate(slots):
        start, end = bounds[i], bounds[i + 1]
        seq = x[start:end].t().float()  # [D, L]
        if has_init[i]:
            prev = conv_state[slot].float()
        else:
            prev = seq.new_zeros(D, K - 1)
        full = torch.cat([prev, seq], dim=1)  # [D, K-1+L]
        y = F.conv1d(full.unsqueeze(0), weight.float().unsqueeze(1), bias.float() if bias is not None else None, groups=D)[0]
        out[start:end] = _activate(y, activation).t().to(x.dtype)
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
    out = torch.zeros_like(x)
    if idx.numel() == 0:
        return out
    window = torch.cat([conv_state[idx].float(), x[valid].float().unsqueeze(-1)], dim=-1)  # [b, D, K]
    y = (window * weight.float()).sum(-1)
    if bias is not None:
        y = y + bias.float()
    out[valid] = _activate(y, activation).to(x.dtype)
    conv_state[idx] = window[:, :, 1:].to(conv_state.dtype)
    return out


def causal_conv1d_varlen(x, weight, bias, conv_state, cu_seqlens, state_indices, has_initial_state,
                         activation="silu", *, force_triton: bool | None = None):
    """Prefill conv: see the module docstring. Mutates ``conv_state`` in place."""
    del force_triton  # the Triton kernel lands with the kernels issue
    return causal_conv1d_varlen_ref(x, weight, bias, conv_state, cu_seqlens, state_indices,
                                    has_initial_state, activation)


def causal_conv1d_update(x, conv_state, weight, bias, state_indices, activation="silu", *,
                         force_triton: bool | None = None):
    """Decode conv step for one token per row. Mutates ``conv_state`` in place."""
    del force_triton
    return causal_conv1d_update_ref(x, conv_state, weight, bias, state_indices, activation)
