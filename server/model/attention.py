"""Attention layers of hybrid models over a paged KV cache (``mambaserve.kernels.paged_attention``).

A step's tokens are packed ``[T, hidden]``; each attention layer projects them, turns q and k by RoPE
where the family has it, writes the new k/v into their pages (``BatchTensors.slot_mapping``) and
attends over each sequence's pages (``block_table``, ``kv_lens``): varlen causal for prefill chunks
(the chunk's own tokens and every earlier token of the sequence already in pages), one row per
sequence for decode. Parameter names are Hugging Face's (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from mambaserve.kernels import paged_attention as pa
from mambaserve.server.model.hybrid_config import AttentionDims
from mambaserve.server.model.inputs import BatchTensors, ForwardMode
from mambaserve.server.model.parallel import FIRST, SINGLE, TP, Slices, attention_shard


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float, dtype: torch.dtype):
    """``cos, sin`` ``[T, rotary_dim]`` for absolute positions, computed in fp32 and rounded to ``dtype``
    (Hugging Face's rounding)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=positions.device)
                                / rotary_dim))
    freqs = positions.float()[:, None] * inv_freq[None]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` channels of each head of ``x`` ``[T, H, D]`` (rotate-half layout);
    the rest pass through (partial rotary)."""
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    half = r // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    out = rot * cos[:, None] + rotated * sin[:, None]
    return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out


def local_attention(a: AttentionDims, tp: TP) -> AttentionDims:
    """The attention dims a rank's layers and KV pool have: its query heads and KV heads."""
    s = attention_shard(a.num_heads, a.num_kv_heads, tp)
    return dataclasses.replace(a, num_heads=len(s.heads), num_kv_heads=len(s.kv_heads))


class PagedAttention(nn.Module):
    """Attention over the paged KV cache, or a tensor-parallel rank's heads of it (``parallel.attention_shard``):
    q/k/v column-parallel by heads, o_proj row-parallel, its output summed over the ranks."""

    def __init__(self, hidden_size: int, a: AttentionDims, tp: TP = SINGLE):
        super().__init__()
        self.tp = tp
        self.a = local_attention(a, tp)
        self.q_proj = nn.Linear(hidden_size, self.a.num_heads * a.head_dim, bias=a.bias)
        self.k_proj = nn.Linear(hidden_size, self.a.num_kv_heads * a.head_dim, bias=a.bias)
        self.v_proj = nn.Linear(hidden_size, self.a.num_kv_heads * a.head_dim, bias=a.bias)
        self.o_proj = nn.Linear(self.a.num_heads * a.head_dim, hidden_size, bias=a.bias)
        if tp.size > 1:
            s, D = attention_shard(a.num_heads, a.num_kv_heads, tp), a.head_dim
            q = Slices.of(0, range(s.heads.start * D, s.heads.stop * D))
            kv = Slices.of(0, range(s.kv_heads.start * D, s.kv_heads.stop * D))
            self.tp_slices = {"q_proj.weight": q, "k_proj.weight": kv, "v_proj.weight": kv,
                              "o_proj.weight": Slices(1, q.ranges)}
            if a.bias:
                self.tp_slices |= {"q_proj.bias": q, "k_proj.bias": kv, "v_proj.bias": kv, "o_proj.bias": FIRST}

    def forward(self, x: torch.Tensor, bt: BatchTensors, k_cache: torch.Tensor, v_cache: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """``x`` ``[T, hidden]`` (normalised); ``k_cache``/``v_cache`` ``[pages, page_size, Hkv, D]`` of this
        layer, written at ``bt.slot_mapping``; ``rope``: this step's ``(cos, sin)`` or None."""
        a, T = self.a, x.shape[0]
        q = self.q_proj(x).view(T, a.num_heads, a.head_dim)
        k = self.k_proj(x).view(T, a.num_kv_heads, a.head_dim)
        v = self.v_proj(x).view(T, a.num_kv_heads, a.head_dim)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        pa.write_kv(k, v, k_cache, v_cache, bt.slot_mapping)
        if bt.mode is ForwardMode.DECODE:
            o = pa.paged_decode_attention(q, k_cache, v_cache, bt.block_table, bt.kv_lens, a.scale)
        else:
            o = pa.paged_prefill_attention(q, k_cache, v_cache, bt.block_table, bt.cu_seqlens, bt.kv_lens, a.scale)
        return self.tp.all_reduce(self.o_proj(o.reshape(T, a.num_heads * a.head_dim)))
