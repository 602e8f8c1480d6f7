"""Triton paged attention and KV writes against the references and a dense SDPA oracle, tiny shapes
(interpreter on CPU). Every case fills the slots no sequence owns with NaN and the block table past each
sequence's pages with -1 / out-of-range pages: a kernel that reads either poisons its output."""

import pytest
import torch

from mambaserve.kernels.paged_attention import (decode_splits, paged_decode_attention, paged_decode_attention_ref,
                                                paged_prefill_attention, paged_prefill_attention_ref, write_kv,
                                                write_kv_ref)
from tests.kernels.helpers import TOL, assert_close, gen, randn
from tests.kernels.paged_cases import dense_attention, paged_case, prefill_oracle

BF = torch.bfloat16
# ragged: a whole prompt, prefix + new tokens across several key and query tiles, a q_len-0 row (nothing
# to compute), a one-token chunk after a cached prefix, a zero-length row, a chunk ending mid-page
LENS, Q_LENS = [5, 41, 9, 18, 0, 30], [5, 23, 0, 1, 0, 7]


def _prefill(c, scale, **kw):
    args = (c.q, c.k_cache, c.v_cache, c.block_table, c.cu_seqlens_q, c.seq_lens, scale)
    return paged_prefill_attention(*args, force_triton=True, **kw), paged_prefill_attention_ref(*args, **kw)


# every page size with a group of 3 (padded to 4 rows), MHA and MQA once
@pytest.mark.parametrize("page_size,Hq,Hkv", [(1, 6, 2), (4, 6, 2), (16, 6, 2), (4, 2, 2), (1, 8, 1)])
def test_prefill_matches_reference_and_oracle(dev, page_size, Hq, Hkv):
    c = paged_case(LENS, Q_LENS, Hq=Hq, Hkv=Hkv, page_size=page_size, dev=dev, seed=page_size * 10 + Hq)
    out, ref = _prefill(c, 0.25)
    assert_close(out, ref, TOL[torch.float32])
    assert_close(out, prefill_oracle(c, 0.25), TOL[torch.float32])


@pytest.mark.parametrize("dtype", [BF, torch.float16])
def test_prefill_half_precision(dev, dtype):
    c = paged_case(LENS, Q_LENS, Hq=4, Hkv=2, D=24, page_size=4, dtype=dtype, dev=dev, seed=7)  # D padded to 32
    out, ref = _prefill(c, 24 ** -0.5)
    assert out.dtype == dtype
    assert_close(out, ref, TOL[dtype])
    assert_close(out, prefill_oracle(c, 24 ** -0.5), TOL[dtype])


@pytest.mark.parametrize("kw", [dict(sliding_window=6), dict(softcap=3.0), dict(sliding_window=1, softcap=1.5)])
def test_prefill_window_and_softcap(dev, kw):
    c = paged_case(LENS, Q_LENS, Hq=4, Hkv=2, page_size=4, dev=dev, seed=11)
    out, ref = _prefill(c, 0.5, **kw)
    assert_close(out, ref, TOL[torch.float32])
    assert_close(out, prefill_oracle(c, 0.5, **kw), TOL[torch.float32])


def test_prefill_empty_rows_and_batches(dev):
    c = paged_case([3, 0, 6], [0, 0, 2], Hq=2, Hkv=1, page_size=4, dev=dev, seed=2)
    out, ref = _prefill(c, 1.0)
    assert_close(out, ref, TOL[torch.float32])
    none = c.q[:0]
    cu0 = torch.zeros(4, dtype=torch.int32, device=dev)
    empty = paged_prefill_attention(none, c.k_cache, c.v_cache, c.block_table, cu0, c.seq_lens, 1.0, force_triton=True)
    assert empty.shape == (0, 2, 16)


def _decode(q, c, scale, **kw):
    args = (q, c.k_cache, c.v_cache, c.block_table, c.seq_lens, scale)
    return paged_decode_attention(*args, force_triton=True, **kw), paged_decode_attention_ref(*args, **{
        k: v for k, v in kw.items() if k != "tiles"})


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_matches_reference_and_oracle(dev, page_size, splits):
    lens = [37, 0, 1, 16, 0, 50, 5]
    c = paged_case(lens, [0] * len(lens), Hq=6, Hkv=2, page_size=page_size, dev=dev, seed=page_size + splits)
    q = randn(gen(splits), len(lens), 6, 16, dev=dev)
    out, ref = _decode(q, c, 0.25, tiles={"splits": splits})
    assert_close(out, ref, TOL[torch.float32])
    for b, L in enumerate(lens):
        if L == 0:  # CUDA-graph padding rows: exact zeros
            assert not out[b].any()
        else:
            assert_close(out[b], dense_attention(q[b:b + 1], c.k[b], c.v[b], 0.25)[0], TOL[torch.float32])


@pytest.mark.parametrize("dtype", [BF, torch.float16])
@pytest.mark.parametrize("kw", [{}, dict(sliding_window=7, softcap=2.0)])
def test_decode_half_precision_window_softcap(dev, dtype, kw):
    lens = [29, 3, 0, 44]
    c = paged_case(lens, [0] * 4, Hq=8, Hkv=2, D=24, page_size=4, dtype=dtype, dev=dev, seed=5)
    q = randn(gen(6), 4, 8, 24, dtype=dtype, dev=dev)
    for splits in (1, 4):  # 4 splits of a 3-token row: most splits are empty
        out, ref = _decode(q, c, 0.2, tiles={"splits": splits}, **kw)
        assert out.dtype == dtype
        assert_close(out, ref, TOL[dtype])
        assert not out[2].any()


def test_decode_equals_prefill_of_the_last_token(dev):
    """The two kernels agree: a decode step is a prefill of one token."""
    lens = [40, 7, 19]
    c = paged_case(lens, [1, 1, 1], Hq=4, Hkv=2, page_size=4, dev=dev, seed=9)
    dec, _ = _decode(c.q, c, 0.3, tiles={"splits": 2})
    pre, _ = _prefill(c, 0.3)
    assert_close(dec, pre, 1e-6)


@pytest.mark.parametrize("cache_dtype", [torch.float32, BF])
def test_write_kv_matches_reference(dev, cache_dtype):
    g = gen(3)
    qkv = randn(g, 6, 3 * 2 * 24, dev=dev)  # k, v as column slices of a fused projection: strided rows
    k, v = qkv[:, 48:96].view(6, 2, 24), qkv[:, 96:].view(6, 2, 24)
    k_cache = randn(g, 5, 4, 2, 24, dtype=cache_dtype, dev=dev)
    v_cache = randn(g, 5, 4, 2, 24, dtype=cache_dtype, dev=dev)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([7, -1, 0, 19, -1, 12], device=dev)
    write_kv(k, v, k_cache, v_cache, slots, force_triton=True)
    write_kv_ref(k, v, k_ref, v_ref, slots)
    if cache_dtype == torch.float32 or dev == "cuda":
        assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    else:  # the Triton 3.9 interpreter rounds fp32 -> bf16 toward zero (the GPU rounds to nearest)
        assert torch.allclose(k_cache.float(), k_ref.float(), rtol=2 ** -7, atol=0)
        assert torch.allclose(v_cache.float(), v_ref.float(), rtol=2 ** -7, atol=0)
    untouched = torch.ones(20, dtype=torch.bool, device=dev)
    untouched[[7, 0, 19, 12]] = False  # padding rows (-1) wrote nowhere
    assert torch.equal(k_cache.view(20, 2, 24)[untouched], k_ref.view(20, 2, 24)[untouched])


def test_decode_splits_follow_the_shapes():
    # a GPU-filling batch runs unsplit; batch 1 splits until ~4 programs per SM, 4 key tiles a split at least
    assert decode_splits(64, 8, 32768, 132, 64) == 1
    assert decode_splits(1, 8, 32768, 132, 64) == 64
    assert decode_splits(1, 8, 4096, 132, 64) == 16
    assert decode_splits(1, 8, 128, 132, 64) == 1
    assert decode_splits(4, 8, 65536, 132, 64) == 17


def test_int64_index_tensors(dev):
    """Callers may hold lengths, offsets and page tables as int64: same results."""
    c = paged_case([20, 6], [4, 6], Hq=4, Hkv=2, page_size=4, dev=dev, seed=12)
    out, ref = _prefill(c, 0.3)
    assert_close(out, ref, TOL[torch.float32])
    wide = paged_prefill_attention(c.q, c.k_cache, c.v_cache, c.block_table.long(), c.cu_seqlens_q.long(),
                                   c.seq_lens.long(), 0.3, force_triton=True)
    assert torch.equal(wide, out)
    q = c.q[:2]
    dec = paged_decode_attention(q, c.k_cache, c.v_cache, c.block_table, c.seq_lens, 0.3, force_triton=True,
                                 tiles={"splits": 2})
    dec64 = paged_decode_attention(q, c.k_cache, c.v_cache, c.block_table.long(), c.seq_lens.long(), 0.3,
                                   force_triton=True, tiles={"splits": 2})
    assert torch.equal(dec, dec64)
    assert_close(dec, paged_decode_attention_ref(q, c.k_cache, c.v_cache, c.block_table, c.seq_lens, 0.3),
                 TOL[torch.float32])


def test_lengths_past_the_block_table_read_only_its_pages(dev):
    """A length longer than the block table's row is cut to the row's pages (no read past it)."""
    c = paged_case([12, 8], [4, 8], Hq=4, Hkv=2, page_size=4, dev=dev, seed=13, spare_columns=0)
    width = c.block_table.shape[1] * 4  # 12 tokens
    q = c.q[:2]
    long = torch.tensor([width + 9, 8], dtype=torch.int32, device=dev)
    cut = torch.tensor([width, 8], dtype=torch.int32, device=dev)
    a = paged_decode_attention(q, c.k_cache, c.v_cache, c.block_table, long, 0.3, force_triton=True)
    b = paged_decode_attention(q, c.k_cache, c.v_cache, c.block_table, cut, 0.3, force_triton=True)
    assert torch.equal(a, b) and torch.isfinite(a).all()


def test_decode_kernels_take_the_pdl_launch_arguments(dev, monkeypatch):
    """write_kv, the decode kernel and the merge all launch with ``pdl_args`` (PDL on Hopper)."""
    from mambaserve.kernels import paged_attention as pa

    launches = []

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kw):
                launches.append((self.kernel.__name__, "USE_PDL" in kw))
                return self.kernel[grid](*args, **kw)
            return launch

    for name in ("_write_kv_kernel", "_decode_kernel", "_decode_reduce_kernel"):
        monkeypatch.setattr(pa, name, Recorder(getattr(pa, name)))
    monkeypatch.setattr(pa, "pdl_args", lambda t: {"USE_PDL": False})  # what it gives off Hopper, made visible
    c = paged_case([9], [1], Hq=2, Hkv=1, page_size=4, dev=dev, seed=14)
    write_kv(c.k[0][-1:], c.v[0][-1:], c.k_cache, c.v_cache, c.slot_mapping[-1:], force_triton=True)
    paged_decode_attention(c.q, c.k_cache, c.v_cache, c.block_table, c.seq_lens, 0.3, force_triton=True,
                           tiles={"splits": 2})
    assert launches == [("_write_kv_kernel", True), ("_decode_kernel", True), ("_decode_reduce_kernel", True)]
