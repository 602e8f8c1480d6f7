"""Attention over a paged KV cache: the attention layers of hybrid models (Nemotron-H, Granite 4.0-H).

Shapes (one attention layer): ``k_cache``, ``v_cache`` ``[num_pages, page_size, Hkv, D]``; a token's
cache slot is ``page * page_size + offset``. Queries ``q`` have ``Hq`` heads, ``Hq % Hkv == 0``; query
head ``h`` reads KV head ``h // (Hq // Hkv)`` (Hugging Face's ``repeat_kv`` order).
``block_table`` int32 ``[B, max_pages]``: sequence ``b``'s pages in order; entries past the pages its
length needs are never read (they may hold anything, -1 included).

- ``write_kv(k, v, k_cache, v_cache, slot_mapping)``: ``k``, ``v`` ``[T, Hkv, D]`` into the caches at
  ``slot_mapping`` int64 ``[T]``; slot ``-1`` is padding and writes nothing.
- ``paged_prefill_attention(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, scale)``:
  ``q`` ``[T, Hq, D]`` packs the new tokens of B sequences (``cu_seqlens_q`` int32 ``[B+1]``);
  ``seq_lens`` int32 ``[B]`` is each sequence's total length, cached prefix + new tokens, whose K/V
  are already in the cache. New token ``i`` of sequence ``b`` sits at absolute position
  ``seq_lens[b] - q_len_b + i`` and attends to every position up to its own. Returns ``[T, Hq, D]``.
- ``paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens, scale)``: ``q`` ``[B, Hq, D]``,
  one new token per sequence (already written) at position ``seq_lens[b] - 1``. Rows with
  ``seq_lens == 0`` (CUDA-graph padding) return zeros and read nothing. Returns ``[B, Hq, D]``.

Options of both attention ops: ``sliding_window=W`` (a token attends to positions ``p - W < j <= p``),
``softcap=c`` (scores ``c * tanh(s / c)`` before the softmax, Gemma-2 style). Scores, softmax and the
weighted sum are fp32 whatever the inputs' dtype (fp32 / fp16 / bf16); the output has ``q``'s dtype.
"""

from __future__ import annotations

import torch

from mambaserve.kernels._dispatch import use_triton


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, q_heads: int | None = None) -> None:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must both be "
                         "[num_pages, page_size, num_kv_heads, head_dim]")
    if q_heads is not None and q_heads % k_cache.shape[2]:
        raise ValueError(f"query heads {q_heads} not a multiple of KV heads {k_cache.shape[2]}")


def _softcap(s: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return s if not softcap else softcap * torch.tanh(s / softcap)


# ---------------------------------------------------------------------------------------------- references


def write_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """``cache[slot // page_size, slot % page_size] = k / v`` for every token with ``slot >= 0``."""
    _check_cache(k_cache, v_cache)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    page_size = k_cache.shape[1]
    pages, offs = slots // page_size, slots % page_size
    k_cache[pages, offs] = k[keep].to(k_cache.dtype)
    v_cache[pages, offs] = v[keep].to(v_cache.dtype)


def _gather_pages(cache: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """``cache``'s pages ``[..., n]`` as tokens ``[..., n * page_size, Hkv, D]`` (fp32)."""
    g = cache[pages.long()].float()
    return g.reshape(*pages.shape[:-1], -1, *cache.shape[2:])


def _attend_ref(q, k, v, q_pos, k_pos, k_valid, scale, sliding_window, softcap):
    """Rows of one or many sequences. q ``[..., M, Hq, D]``; k, v ``[..., N, Hkv, D]``; q_pos ``[..., M]``;
    k_pos, k_valid ``[..., N]``. Rows with no visible key are 0."""
    group = q.shape[-2] // k.shape[-2]
    k = k.repeat_interleave(group, dim=-2)
    v = v.repeat_interleave(group, dim=-2)
    s = torch.einsum("...mhd,...nhd->...hmn", q.float(), k) * scale
    s = _softcap(s, softcap)
    vis = k_valid[..., None, :] & (k_pos[..., None, :] <= q_pos[..., :, None])  # [..., M, N]
    if sliding_window is not None:
        vis = vis & (k_pos[..., None, :] > q_pos[..., :, None] - sliding_window)
    vis = vis.unsqueeze(-3)  # over heads
    s = s.masked_fill(~vis, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # all-masked rows: nan -> 0
    return torch.einsum("...hmn,...nhd->...mhd", p, v)


def paged_prefill_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_table: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                                scale: float, *, sliding_window: int | None = None,
                                softcap: float | None = None) -> torch.Tensor:
    """One sequence at a time (host synchronisation: lengths on the host)."""
    _check_cache(k_cache, v_cache, q.shape[1])
    out = torch.zeros_like(q)
    page_size = k_cache.shape[1]
    cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    for b, L in enumerate(lens):
        t0, t1 = cu[b], cu[b + 1]
        n = t1 - t0
        if n == 0:
            continue
        if n > L:
            raise ValueError(f"sequence {b}: {n} new tokens but total length {L}")
        pages = block_table[b, :-(-L // page_size)]
        k = _gather_pages(k_cache, pages)[:L]
        v = _gather_pages(v_cache, pages)[:L]
        k_pos = torch.arange(L, device=q.device)
        o = _attend_ref(q[t0:t1], k, v, torch.arange(L - n, L, device=q.device), k_pos,
                        torch.ones(L, dtype=torch.bool, device=q.device), scale, sliding_window, softcap)
        out[t0:t1] = o.to(q.dtype)
    return out


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                               sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """All rows at once over every page of ``block_table`` (entries past a row's length clamped into
    range and masked off): no host synchronisation, so it is CUDA-graph capturable too."""
    _check_cache(k_cache, v_cache, q.shape[1])
    B, max_pages = block_table.shape
    num_pages, page_size = k_cache.shape[:2]
    n = max_pages * page_size
    k_pos = torch.arange(n, device=q.device).expand(B, n)
    lens = seq_lens.long()
    valid = k_pos < lens[:, None]
    pages = block_table.long().clamp(0, num_pages - 1)
    k, v = _gather_pages(k_cache, pages), _gather_pages(v_cache, pages)  # [B, n, Hkv, D]
    # slots past a row's length hold anything (NaN included): zero them, or 0 * NaN would leak through
    k, v = (torch.where(valid[..., None, None], t, 0.0) for t in (k, v))
    o = _attend_ref(q[:, None], k, v, (lens - 1)[:, None], k_pos, valid, scale, sliding_window, softcap)
    return o[:, 0].to(q.dtype)


# ---------------------------------------------------------------------------------------------- launchers


def write_kv(k, v, k_cache, v_cache, slot_mapping, *, force_triton: bool | None = None) -> None:
    """Store new tokens' K/V into the paged caches (see the module docstring). In place, no host sync."""
    _check_cache(k_cache, v_cache)
    return write_kv_ref(k, v, k_cache, v_cache, slot_mapping)


def paged_prefill_attention(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, scale, *,
                            sliding_window: int | None = None, softcap: float | None = None,
                            force_triton: bool | None = None):
    """Packed varlen causal attention of new tokens over their sequences' cached prefix and themselves."""
    return paged_prefill_attention_ref(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, scale,
                                       sliding_window=sliding_window, softcap=softcap)


def paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens, scale, *,
                           sliding_window: int | None = None, softcap: float | None = None,
                           force_triton: bool | None = None):
    """One query token per sequence over its pages; ``seq_lens == 0`` rows are zeros."""
    return paged_decode_attention_ref(q, k_cache, v_cache, block_table, seq_lens, scale,
                                      sliding_window=sliding_window, softcap=softcap)

