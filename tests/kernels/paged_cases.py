"""Paged KV cache scenarios and the dense attention oracle for the paged attention tests.

A case scatters each sequence's pages at random over the pool, fills every slot no sequence owns with
NaN (a kernel that reads one poisons its output) and puts garbage (-1, far out of range) in the block
table past each sequence's pages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mambaserve.kernels.paged_attention import write_kv_ref


@dataclass
class PagedCase:
    q: torch.Tensor  # [T, Hq, D]: the new tokens, packed
    k: list  # per sequence [L, Hkv, D]: the whole sequence's keys (prefix + new)
    v: list
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor  # int32 [B, max_pages]
    cu_seqlens_q: torch.Tensor  # int32 [B + 1]
    seq_lens: torch.Tensor  # int32 [B]
    slot_mapping: torch.Tensor  # int64 [sum L]: every token's slot, sequence by sequence
    q_lens: list
    lens: list


def paged_case(lens, q_lens, *, Hq=4, Hkv=2, D=16, page_size=4, dtype=torch.float32, dev="cpu", seed=0,
               spare_pages=3, spare_columns=2) -> PagedCase:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    B = len(lens)
    need = [-(-L // page_size) for L in lens]
    num_pages = sum(need) + spare_pages
    order = torch.randperm(num_pages, generator=g).tolist()
    max_pages = max(need + [1]) + spare_columns
    table = torch.full((B, max_pages), -1, dtype=torch.int32)
    table[:, 1::2] = num_pages + 1000  # out of range: must never be dereferenced
    slots = []
    for b, n in enumerate(need):
        pages, order = order[:n], order[n:]
        if n:
            table[b, :n] = torch.tensor(pages, dtype=torch.int32)
        slots += [pages[i // page_size] * page_size + i % page_size for i in range(lens[b])]
    k = [r(L, Hkv, D).to(dtype) for L in lens]
    v = [r(L, Hkv, D).to(dtype) for L in lens]
    k_cache = torch.full((num_pages, page_size, Hkv, D), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    write_kv_ref(torch.cat(k), torch.cat(v), k_cache, v_cache, slot_mapping)
    q = r(sum(q_lens), Hq, D).to(dtype)
    cu = torch.tensor([0] + torch.tensor(q_lens, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32)
    to = lambda t: t.to(dev)  # noqa: E731
    return PagedCase(to(q), [to(t) for t in k], [to(t) for t in v], to(k_cache), to(v_cache), to(table), to(cu),
                     to(torch.tensor(lens, dtype=torch.int32)), to(slot_mapping), list(q_lens), list(lens))


def dense_attention(q, k, v, scale, *, sliding_window=None, softcap=None):
    """One sequence, fp64: q ``[n, Hq, D]`` are the last n of the L tokens of k, v ``[L, Hkv, D]``.
    ``torch.nn.functional.scaled_dot_product_attention`` with an explicit causal (bottom-right) mask;
    with a softcap (which SDPA has no argument for) the same sum written out."""
    n, L = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    qh = q.double().transpose(0, 1)  # [Hq, n, D]
    kh = k.double().repeat_interleave(group, dim=1).transpose(0, 1)
    vh = v.double().repeat_interleave(group, dim=1).transpose(0, 1)
    qpos = torch.arange(L - n, L, device=q.device)[:, None]
    kpos = torch.arange(L, device=q.device)[None, :]
    mask = kpos <= qpos
    if sliding_window is not None:
        mask &= kpos > qpos - sliding_window
    if softcap is None:
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    else:
        s = softcap * torch.tanh(qh @ kh.transpose(1, 2) * scale / softcap)
        o = torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ vh
    return o.transpose(0, 1)


def prefill_oracle(case: PagedCase, scale, **kw) -> torch.Tensor:
    out = torch.zeros(case.q.shape, dtype=torch.float64, device=case.q.device)
    t = 0
    for b, n in enumerate(case.q_lens):
        if n:
            out[t:t + n] = dense_attention(case.q[t:t + n], case.k[b], case.v[b], scale, **kw)
        t += n
    return out
