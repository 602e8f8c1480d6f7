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
  (The kernels clamp ``seq_lens`` to ``max_pages * page_size``: a wrong length never reads past a row.) A
  sequence with ``seq_lens == 0`` is padding (prefill CUDA graphs): its rows are zeros and read nothing.
- ``paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens, scale)``: ``q`` ``[B, Hq, D]``,
  one new token per sequence (already written) at position ``seq_lens[b] - 1``. Rows with
  ``seq_lens == 0`` (CUDA-graph padding) return zeros and read nothing. Returns ``[B, Hq, D]``.

Options of both attention ops: ``sliding_window=W`` (a token attends to positions ``p - W < j <= p``),
``softcap=c`` (scores ``c * tanh(s / c)`` before the softmax, Gemma-2 style). Scores, softmax and the
weighted sum are fp32 whatever the inputs' dtype (fp32 / fp16 / bf16); the output has ``q``'s dtype.

Each op has its pure-torch reference beside it (``<op>_ref``, same signature); the launchers run the
Triton kernels (``paged_attention_kernels``: how they work) on CUDA, the references on CPU or under
``MAMBASERVE_KERNELS=ref``; ``force_triton`` and ``tiles`` (over ``PREFILL_TILES`` / ``DECODE_TILES``)
are for tests and benchmark sweeps.
"""

from __future__ import annotations

import torch

from mambaserve.kernels._dispatch import (HAS_TRITON, Target, next_pow2, pdl_args, seq_block, target, tl, triton,
                                          use_triton)

if HAS_TRITON:
    from mambaserve.kernels.paged_attention_kernels import (_decode_kernel, _decode_reduce_kernel, _prefill_kernel,
                                                            _write_kv_kernel)

    _TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


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
        if n == 0 or L == 0:  # (L == 0: a padding sequence, zeros, as in the kernel)
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

LOG2E = 1.4426950408889634
# Tiles on a GPU (benchmarks/paged_attention.py sweeps them with ``tiles=``). Prefill: 128 rows (tokens x the
# group's heads) by 64 keys, 8 warps, the flash-attention shape for head_dim 128; decode: 64 keys a step, 4 warps.
# Three stages: compiled for sm_90, two leave the block-table loads synchronous in the key loop (each tile's K/V
# addresses wait on them); with three the pipeliner issues them through cp.async a stage ahead as well.
PREFILL_TILES = {"rows": 128, "block_n": 64, "num_warps": 8, "num_stages": 3}
DECODE_TILES = {"block_n": 64, "num_warps": 4, "num_stages": 3, "splits": None}
# Under the interpreter: the smallest tiles tl.dot takes, so tiny test shapes still cross several tiles.
_INTERPRET_TILES = {"rows": 16, "block_n": 16, "num_warps": 1, "num_stages": 1}


def _dot_types(q: torch.Tensor, cache: torch.Tensor):
    """(matrix-unit operand type, input precision). fp32 keeps fp32 products (tf32 would cost ~1e-3
    relative); the Triton 3.9 interpreter multiplies bf16 operands wrongly, so under it they go in as
    fp32 (same values, exact products)."""
    if not target(q).compiled or torch.float32 in (q.dtype, cache.dtype):
        return tl.float32, "ieee"
    return _TL_DTYPES[cache.dtype], "tf32"


def _scales(scale: float, softcap: float | None) -> tuple[float, float]:
    """(qk_scale, cap_scale) of the kernels' base-2 scores (``_attend``'s docstring)."""
    if softcap:
        return float(softcap) * LOG2E, float(scale) / float(softcap)
    return float(scale) * LOG2E, 1.0


def decode_splits(batch: int, kv_heads: int, max_tokens: int, sms: int, block_n: int) -> int:
    """Splits of each row's keys (flash decoding), from shapes only, so a CUDA graph replays the same
    launch. A program per (row, KV head) fills the GPU once there are two per SM; below that, split the
    keys until there are about four per SM, but never below four key tiles a split (the partial outputs
    and the merge cost more than they save) and at most 64."""
    programs = batch * kv_heads
    if programs >= 2 * sms:
        return 1
    return max(1, min(triton.cdiv(4 * sms, programs), max_tokens // (4 * block_n), 64))


def _tiles(base: dict, t: torch.Tensor, overrides: dict | None) -> dict:
    return _target_tiles(base, target(t), overrides)


def _target_tiles(base: dict, tg: Target, overrides: dict | None) -> dict:
    return {**base, **(_INTERPRET_TILES if not tg.compiled else {}), **(overrides or {})}


def decode_split_count(batch: int, kv_heads: int, max_tokens: int, tg: Target, tiles: dict | None = None) -> int:
    """The splits of a decode launch of ``batch`` rows over block tables of ``max_tokens`` tokens on ``tg``:
    ``tiles["splits"]``, else ``decode_splits``. With more than one, the kernel is its split variant and a merge
    follows (a compile per power of two of the count: ``server/engine/warm_up.py`` runs each at start)."""
    cfg = _target_tiles(DECODE_TILES, tg, tiles)
    return cfg["splits"] or decode_splits(batch, kv_heads, max_tokens, tg.sms, cfg["block_n"])


def write_kv(k, v, k_cache, v_cache, slot_mapping, *, force_triton: bool | None = None) -> None:
    """Store new tokens' K/V into the paged caches (see the module docstring). In place, no host sync."""
    _check_cache(k_cache, v_cache)
    if not use_triton(k, force_triton):
        return write_kv_ref(k, v, k_cache, v_cache, slot_mapping)
    T, Hkv, D = k.shape
    if v.shape != k.shape or k_cache.shape[2:] != (Hkv, D) or slot_mapping.shape != (T,):
        raise ValueError(f"write_kv: k {tuple(k.shape)}, v {tuple(v.shape)}, slots {tuple(slot_mapping.shape)} "
                         f"do not fit a cache of [pages, page_size, {k_cache.shape[2]}, {k_cache.shape[3]}]")
    if T == 0:
        return None
    E = Hkv * D
    BLOCK = min(next_pow2(E), 2048)
    _write_kv_kernel[(T, triton.cdiv(E, BLOCK))](
        k, v, k_cache, v_cache, slot_mapping, E, D, k_cache.shape[1], *k.stride(), *v.stride(),
        *k_cache.stride(), *v_cache.stride(), BLOCK=BLOCK, num_warps=4, **pdl_args(k))
    return None


def paged_prefill_attention(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, scale, *,
                            sliding_window: int | None = None, softcap: float | None = None,
                            force_triton: bool | None = None, tiles: dict | None = None):
    """Packed varlen causal attention of new tokens over their sequences' cached prefix and themselves.
    Triton path: one launch, no host synchronisation. ``tiles`` overrides ``PREFILL_TILES``."""
    kw = dict(sliding_window=sliding_window, softcap=softcap)
    if not use_triton(q, force_triton):
        return paged_prefill_attention_ref(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, scale, **kw)
    _check_cache(k_cache, v_cache, q.shape[1])
    T, Hq, D = q.shape
    S = seq_lens.numel()
    if k_cache.shape[3] != D or cu_seqlens_q.numel() != S + 1 or block_table.shape[0] != S:
        raise ValueError(f"prefill: q {tuple(q.shape)}, cache {tuple(k_cache.shape)}, {S} seq_lens, "
                         f"cu_seqlens_q {tuple(cu_seqlens_q.shape)}, block_table {tuple(block_table.shape)}")
    out = torch.zeros_like(q) if T == 0 or S == 0 else torch.empty_like(q)
    if T == 0 or S == 0:
        return out
    cfg = _tiles(PREFILL_TILES, q, tiles)
    Hkv = k_cache.shape[2]
    G = Hq // Hkv
    GP = next_pow2(G)
    BLOCK_D = max(16, next_pow2(D))
    rows = cfg["rows"] if BLOCK_D <= 128 or "rows" in (tiles or {}) else min(cfg["rows"], 64)  # fp32 acc: registers
    BLOCK_T = max(1, rows // GP)
    dot_t, prec = _dot_types(q, k_cache)
    qk_scale, cap_scale = _scales(scale, softcap)
    grid = (T // BLOCK_T + 2 * S, Hkv)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, out, S, D, G, qk_scale, cap_scale,
        int(sliding_window or 0), *q.stride(), *k_cache.stride(), *v_cache.stride(), block_table.stride(0),
        block_table.shape[1] * k_cache.shape[1], *out.stride(), PAGE=k_cache.shape[1], GP=GP, BLOCK_T=BLOCK_T,
        BLOCK_N=cfg["block_n"], BLOCK_D=BLOCK_D, BLOCK_S=seq_block(S), WINDOW=sliding_window is not None,
        SOFTCAP=bool(softcap), DOT_T=dot_t, PREC=prec, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out


def paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens, scale, *,
                           sliding_window: int | None = None, softcap: float | None = None,
                           force_triton: bool | None = None, tiles: dict | None = None):
    """One query token per sequence over its pages; ``seq_lens == 0`` rows are zeros. Triton path: no
    host synchronisation and a launch fixed by the shapes (CUDA-graph capturable): split-K over
    ``decode_splits`` (or ``tiles["splits"]``) parts, then a merge kernel when there is more than one."""
    kw = dict(sliding_window=sliding_window, softcap=softcap)
    if not use_triton(q, force_triton):
        return paged_decode_attention_ref(q, k_cache, v_cache, block_table, seq_lens, scale, **kw)
    _check_cache(k_cache, v_cache, q.shape[1])
    B, Hq, D = q.shape
    if k_cache.shape[3] != D or seq_lens.shape != (B,) or block_table.shape[0] != B:
        raise ValueError(f"decode: q {tuple(q.shape)}, cache {tuple(k_cache.shape)}, seq_lens "
                         f"{tuple(seq_lens.shape)}, block_table {tuple(block_table.shape)}")
    out = torch.empty_like(q)
    if B == 0:
        return out
    cfg = _tiles(DECODE_TILES, q, tiles)
    num_pages, page_size, Hkv = k_cache.shape[:3]
    G = Hq // Hkv
    BLOCK_N, BLOCK_D = cfg["block_n"], max(16, next_pow2(D))
    splits = decode_split_count(B, Hkv, block_table.shape[1] * page_size, target(q), tiles)
    part = lse = out  # placeholders when the kernel writes the output itself
    if splits > 1:
        part = torch.empty(B, Hq, splits, BLOCK_D, dtype=torch.float32, device=q.device)
        lse = torch.empty(B, Hq, splits, dtype=torch.float32, device=q.device)
    dot_t, prec = _dot_types(q, k_cache)
    qk_scale, cap_scale = _scales(scale, softcap)
    pdl = pdl_args(q)
    _decode_kernel[(B, Hkv, splits)](
        q, k_cache, v_cache, block_table, seq_lens, out, part, lse, D, G, qk_scale, cap_scale,
        int(sliding_window or 0), *q.stride(), *k_cache.stride(), *v_cache.stride(), block_table.stride(0),
        block_table.shape[1] * k_cache.shape[1], *out.stride(), splits, PAGE=page_size, SPLIT=splits > 1,
        GP=next_pow2(G), BLOCK_M=max(16, next_pow2(G)), BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
        WINDOW=sliding_window is not None, SOFTCAP=bool(softcap), DOT_T=dot_t, PREC=prec,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl)
    if splits > 1:
        _decode_reduce_kernel[(B, Hq)](part, lse, out, splits, *out.stride(), D=D, BLOCK_SPLITS=next_pow2(splits),
                                       BLOCK_D=BLOCK_D, num_warps=4, **pdl)
    return out
