"""Paged attention at real shapes on a GPU: the attention layers of nemotron-h-8b (32 query heads, 8 KV
heads, head_dim 128) and granite-4.0-h-tiny (12 / 4 / 128), bf16 as the engine runs them, the GPU tiles
and split counts, CUDA-graph capture and replay. Skipped without CUDA; tolerances are relative norms."""

import pytest
import torch
import torch.nn.functional as F

from mambaserve.kernels.paged_attention import (decode_splits, paged_decode_attention, paged_decode_attention_ref,
                                                paged_prefill_attention, paged_prefill_attention_ref, write_kv,
                                                write_kv_ref)
from tests.kernels.helpers import assert_close
from tests.kernels.paged_cases import paged_case

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BF = torch.bfloat16
SHAPES = {"nemotron-h-8b": (32, 8), "granite-4.0-h-tiny": (12, 4)}
D = 128
SCALE = D ** -0.5


def _prefill_args(c):
    return c.q, c.k_cache, c.v_cache, c.block_table, c.cu_seqlens_q, c.seq_lens, SCALE


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_prefill_real_shapes(shape, page_size):
    Hq, Hkv = SHAPES[shape]
    # a long prompt, chunks after cached prefixes (one ending mid-page), one-token chunks, a q_len-0 row
    lens, q_lens = [2053, 700, 1, 4096, 333, 90], [2053, 100, 1, 512, 0, 1]
    c = paged_case(lens, q_lens, Hq=Hq, Hkv=Hkv, D=D, page_size=page_size, dtype=BF, dev="cuda", seed=page_size)
    out = paged_prefill_attention(*_prefill_args(c))
    assert_close(out, paged_prefill_attention_ref(*_prefill_args(c)), 1e-2)
    # the whole prompt against torch's own causal attention (dense, top-left causal = ours with no prefix)
    q = c.q[:2053].transpose(0, 1)[None]
    k, v = (t.repeat_interleave(Hq // Hkv, dim=1).transpose(0, 1)[None] for t in (c.k[0], c.v[0]))
    dense = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=SCALE)[0].transpose(0, 1)
    assert_close(out[:2053], dense, 1e-2)


@pytest.mark.parametrize("kw", [dict(sliding_window=1000), dict(softcap=30.0)])
def test_prefill_window_softcap_real_shapes(kw):
    c = paged_case([3000, 1500], [800, 1500], Hq=32, Hkv=8, D=D, page_size=16, dtype=BF, dev="cuda", seed=1)
    assert_close(paged_prefill_attention(*_prefill_args(c), **kw),
                 paged_prefill_attention_ref(*_prefill_args(c), **kw), 1e-2)


def test_chunked_prefill_equals_one_pass():
    """The same prompt prefilled at once and in three chunks (each over the pages the last one wrote)."""
    L, cuts = 1800, [0, 513, 1200, 1800]
    c = paged_case([L], [L], Hq=32, Hkv=8, D=D, page_size=16, dtype=BF, dev="cuda", seed=4)
    one = paged_prefill_attention(*_prefill_args(c))
    parts = []
    for a, b in zip(cuts, cuts[1:]):
        cu = torch.tensor([0, b - a], dtype=torch.int32, device="cuda")
        lens = torch.tensor([b], dtype=torch.int32, device="cuda")
        parts.append(paged_prefill_attention(c.q[a:b], c.k_cache, c.v_cache, c.block_table, cu, lens, SCALE))
    assert_close(torch.cat(parts), one, 1e-2)  # other tile cuts: other bf16 roundings of P


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("batch", [1, 7, 96])  # split-K (many splits / a few) and one program per (row, KV head)
def test_decode_real_shapes(shape, page_size, batch):
    Hq, Hkv = SHAPES[shape]
    g = torch.Generator().manual_seed(batch)
    lens = torch.randint(1, 5000 if batch < 64 else 1500, (batch,), generator=g).tolist()
    lens[len(lens) // 2] = 0  # CUDA-graph padding row
    c = paged_case(lens, [0] * batch, Hq=Hq, Hkv=Hkv, D=D, page_size=page_size, dtype=BF, dev="cuda", seed=batch)
    q = torch.randn(batch, Hq, D, generator=g).to(BF).cuda()
    args = (q, c.k_cache, c.v_cache, c.block_table, c.seq_lens, SCALE)
    out = paged_decode_attention(*args)
    assert_close(out, paged_decode_attention_ref(*args), 1e-2)
    assert not out[len(lens) // 2].any()
    for splits in (1, 5):  # the split count changes the summation order only
        assert_close(paged_decode_attention(*args, tiles={"splits": splits}), out, 1e-2)


def _graph(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out


@pytest.mark.parametrize("batch", [1, 64])
def test_decode_cuda_graph_replays_new_lengths_and_pages(batch):
    """Captured once with a block table sized for 4096 (batch 1) / 2048 tokens; replayed with other lengths
    (0 included), other pages and other queries, as the engine's decode graphs are."""
    Hq, Hkv, ps, max_pages = 32, 8, 16, 256 if batch == 1 else 128
    num_pages = batch * max_pages + 8
    g = torch.Generator().manual_seed(batch)
    k_cache = torch.randn(num_pages, ps, Hkv, D, generator=g).to(BF).cuda()
    v_cache = torch.randn(num_pages, ps, Hkv, D, generator=g).to(BF).cuda()
    q = torch.zeros(batch, Hq, D, dtype=BF, device="cuda")
    table = torch.zeros(batch, max_pages, dtype=torch.int32, device="cuda")
    lens = torch.zeros(batch, dtype=torch.int32, device="cuda")
    graph, out = _graph(lambda: paged_decode_attention(q, k_cache, v_cache, table, lens, SCALE))
    if batch == 1:
        assert decode_splits(batch, Hkv, max_pages * ps, torch.cuda.get_device_properties(0).multi_processor_count,
                             64) > 1  # the captured launch is the split one
    for trial in range(3):
        new_lens = torch.randint(0, max_pages * ps + 1, (batch,), generator=g)
        new_lens[trial % batch] = 0 if batch > 1 else new_lens[0]
        lens.copy_(new_lens.to(torch.int32))
        table.copy_(torch.randperm(num_pages, generator=g)[:batch * max_pages].view(batch, max_pages).to(torch.int32))
        q.copy_(torch.randn(batch, Hq, D, generator=g).to(BF))
        graph.replay()
        assert_close(out, paged_decode_attention_ref(q, k_cache, v_cache, table, lens, SCALE), 1e-2)


def test_prefill_and_write_kv_capture_in_a_graph():
    """No host synchronisation in prefill or write_kv: they capture, and a replay sees new contents."""
    lens, q_lens = [700, 90, 1], [300, 90, 1]
    c = paged_case(lens, q_lens, Hq=12, Hkv=4, D=D, page_size=16, dtype=BF, dev="cuda", seed=3)
    T = sum(q_lens)
    k_new = torch.zeros(T, 4, D, dtype=BF, device="cuda")
    v_new = torch.zeros_like(k_new)
    new_slots = torch.cat([c.slot_mapping[400:700], c.slot_mapping[700:790], c.slot_mapping[790:791]])

    def step():
        write_kv(k_new, v_new, c.k_cache, c.v_cache, new_slots)
        return paged_prefill_attention(*_prefill_args(c))

    graph, out = _graph(step)
    k_new.copy_(torch.randn_like(k_new))
    v_new.copy_(torch.randn_like(v_new))
    k_ref, v_ref = c.k_cache.clone(), c.v_cache.clone()
    graph.replay()
    write_kv_ref(k_new, v_new, k_ref, v_ref, new_slots)
    # slots nobody owns hold NaN (paged_case): equal where both are NaN too
    assert torch.equal(c.k_cache.nan_to_num(), k_ref.nan_to_num())
    assert torch.equal(c.v_cache.nan_to_num(), v_ref.nan_to_num())
    assert_close(out, paged_prefill_attention_ref(*_prefill_args(c)), 1e-2)
