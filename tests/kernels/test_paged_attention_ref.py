"""The paged attention references against a dense causal scaled_dot_product_attention oracle."""

import pytest
import torch

from mambaserve.kernels.paged_attention import (paged_decode_attention, paged_decode_attention_ref,
                                                paged_prefill_attention, paged_prefill_attention_ref, write_kv,
                                                write_kv_ref)
from tests.kernels.paged_cases import dense_attention, paged_case, prefill_oracle

LENS, Q_LENS = [5, 1, 0, 17, 9, 3], [5, 1, 0, 4, 0, 1]  # whole prompt, prefix + new, empty, cached-only rows


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (6, 2), (4, 1)])
def test_prefill_ref_matches_dense_oracle(page_size, Hq, Hkv):
    c = paged_case(LENS, Q_LENS, Hq=Hq, Hkv=Hkv, page_size=page_size, seed=page_size + Hq)
    out = paged_prefill_attention(c.q, c.k_cache, c.v_cache, c.block_table, c.cu_seqlens_q, c.seq_lens, 0.3)
    torch.testing.assert_close(out.double(), prefill_oracle(c, 0.3), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kw", [dict(sliding_window=3), dict(softcap=2.0), dict(sliding_window=1, softcap=5.0)])
def test_prefill_ref_window_and_softcap(kw):
    c = paged_case([12, 7], [6, 7], Hq=4, Hkv=2, page_size=4, seed=3)
    out = paged_prefill_attention_ref(c.q, c.k_cache, c.v_cache, c.block_table, c.cu_seqlens_q, c.seq_lens, 0.5,
                                      **kw)
    torch.testing.assert_close(out.double(), prefill_oracle(c, 0.5, **kw), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_decode_ref_matches_dense_oracle_and_pads_with_zeros(page_size):
    lens = [5, 0, 17, 1, 0, 33]
    c = paged_case(lens, [1 if L else 0 for L in lens], Hq=6, Hkv=2, page_size=page_size, seed=page_size)
    q = torch.randn(len(lens), 6, 16, generator=torch.Generator().manual_seed(9))
    out = paged_decode_attention(q, c.k_cache, c.v_cache, c.block_table, c.seq_lens, 0.25)
    for b, L in enumerate(lens):
        if L == 0:
            assert torch.equal(out[b], torch.zeros_like(out[b]))
        else:
            want = dense_attention(q[b:b + 1], c.k[b], c.v[b], 0.25)[0]
            torch.testing.assert_close(out[b].double(), want, atol=1e-5, rtol=1e-5)


def test_decode_ref_equals_prefill_of_the_last_token():
    c = paged_case([9, 4, 21], [1, 1, 1], Hq=4, Hkv=2, page_size=4, seed=5)
    for kw in ({}, dict(sliding_window=4, softcap=3.0)):
        dec = paged_decode_attention_ref(c.q, c.k_cache, c.v_cache, c.block_table, c.seq_lens, 0.4, **kw)
        pre = paged_prefill_attention_ref(c.q, c.k_cache, c.v_cache, c.block_table, c.cu_seqlens_q, c.seq_lens,
                                          0.4, **kw)
        torch.testing.assert_close(dec, pre, atol=1e-6, rtol=1e-6)


def test_write_kv_ref_skips_padding_and_casts():
    k_cache = torch.zeros(3, 4, 2, 8, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    k, v = torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    write_kv(k, v, k_cache, v_cache, torch.tensor([5, -1, 0, 11]))
    assert torch.equal(k_cache[1, 1], k[0].bfloat16()) and torch.equal(v_cache[2, 3], v[3].bfloat16())
    assert torch.equal(k_cache[0, 0], k[2].bfloat16())
    written = torch.zeros(3, 4, dtype=torch.bool)
    written[1, 1] = written[0, 0] = written[2, 3] = True
    assert not k_cache[~written].any() and not v_cache[~written].any()


def test_bad_shapes_are_rejected():
    c = paged_case([4], [4], Hq=4, Hkv=2)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        paged_prefill_attention_ref(c.q[:, :3], c.k_cache, c.v_cache, c.block_table, c.cu_seqlens_q,
                                    c.seq_lens, 1.0)
    with pytest.raises(ValueError, match="num_pages, page_size"):
        write_kv_ref(c.k[0], c.v[0], c.k_cache[0], c.v_cache[0], c.slot_mapping)
