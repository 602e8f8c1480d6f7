"""Hybrid decode and prefill on the static buffers a CUDA graph captures (``engine/decode_buffers.py``,
``cuda_graphs.PrefillGraphs``), on the CPU: the function a graph records, run on its buffers with padding rows
and sequences, against the eager path (the replay itself runs in tests/server/test_gpu_engine.py)."""

import pytest
import torch

from mambaserve import kernels
from mambaserve.server.engine import warm_up
from mambaserve.server.engine.batch import ForwardBatch, ForwardMode
from mambaserve.server.engine.cuda_graphs import DecodeGraphs, PrefillGraphs
from mambaserve.server.engine.decode_buffers import DecodeBuffers
from mambaserve.server.engine.kv_pool import KVPool
from mambaserve.server.engine.model_runner import ModelRunner
from mambaserve.server.engine.state_pool import MambaStatePool
from mambaserve.server.model.inputs import ForwardMode as Mode
from mambaserve.server.model.loader import load_model
from tests.server.tiny_hybrids import make_hybrid_checkpoint

CPU = torch.device("cpu")
SLOTS, PAGES = 8, 64


def _runner(model, page_size: int) -> ModelRunner:
    """A runner on fresh pools whose state slots and KV pages hold the same noise in every runner: a slot or
    page that a padding row wrote would differ from the eager runner's."""
    pool = MambaStatePool.for_model(model, SLOTS, torch.float32, torch.float32, CPU)
    kv = KVPool.for_model(model, PAGES, page_size, torch.float32, CPU)
    g = torch.Generator().manual_seed(7)
    for t in (pool.conv, pool.ssm, kv.k, kv.v):
        t.copy_(torch.randn(t.shape, generator=g))
    return ModelRunner(model, pool, CPU, kv)


@pytest.fixture(scope="module", params=["nemotron_h_dense", "granite_dense_rope", "bamba", "granite_moe"])
def model(request, tmp_path_factory):
    """The hybrids whose decode is captured (a MoE one where its experts run the Triton kernel: on CUDA; on the
    CPU its torch expert loop runs the same static-buffer function)."""
    path = make_hybrid_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    return load_model(path, torch.float32, CPU)[0]


@pytest.fixture(scope="module")
def granite(tmp_path_factory):
    path = make_hybrid_checkpoint(tmp_path_factory.mktemp("granite"), "granite_moe")
    return load_model(path, torch.float32, CPU)[0]


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_static_decode_with_padding_rows_equals_eager(model, page_size):
    """Three sequences prefilled, then decode steps whose rows come and go and change places (a block table
    row re-uploaded each time), most in a bucket larger than the step: logits, KV pages and states of the
    static-buffer forward equal the eager path's; padding rows write no page and no slot, and pages nobody
    owns (NaN) are neither written nor read."""
    eager, static = _runner(model, page_size), _runner(model, page_size)
    alloc = eager.kv_pool.allocator
    prompts = [[3, 9, 4, 1, 7], list(range(10, 33)), [5, 6]]
    for i, p in enumerate(prompts):
        assert alloc.ensure(i, len(p) + 8)
    pages = [alloc.pages(i) for i in range(3)]
    unowned = sorted(set(range(PAGES)) - {q for ps in pages for q in ps})
    for r in (eager, static):
        r.kv_pool.k[:, unowned] = float("nan")
        r.kv_pool.v[:, unowned] = float("nan")
    slots = [2, 5, 3]
    prefill = ForwardBatch(ForwardMode.EXTEND, sum(prompts, []), [len(p) for p in prompts], [0] * 3, slots,
                           pages=pages)
    logits = [r.forward(prefill).logits for r in (eager, static)]
    torch.testing.assert_close(logits[0], logits[1], atol=0, rtol=0)
    buffers = DecodeBuffers(model, static.pool, 8, CPU, static.kv_pool, context_length=32)
    seqs = [list(p) for p in prompts]
    last = logits[0].argmax(-1).tolist()
    # (sequences in this step, in row order; bucket): one leaves and comes back, rows swap places
    for rows, b in [([0, 1, 2], 4), ([0, 1, 2], 4), ([2, 0], 8), ([1, 2, 0], 4), ([1], 1), ([0, 2, 1], 8)]:
        for i in rows:
            seqs[i].append(last[i])
        batch = ForwardBatch(ForwardMode.DECODE, [seqs[i][-1] for i in rows], [1] * len(rows),
                             [len(seqs[i]) - 1 for i in rows], [slots[i] for i in rows], pages=[pages[i] for i in rows])
        want = eager.forward(batch).logits
        buffers.load(b, torch.tensor(batch.token_ids), batch.slots, batch.start_pos, batch.pages)
        got = buffers.forward(b)
        assert got.shape[0] == b
        torch.testing.assert_close(got[:len(rows)], want, atol=1e-4, rtol=1e-4)
        for i, row in zip(rows, want.argmax(-1).tolist()):
            last[i] = row
    for name in ("k", "v"):  # the pages nobody owns are still NaN: padding rows wrote nothing
        torch.testing.assert_close(getattr(static.kv_pool, name), getattr(eager.kv_pool, name), atol=1e-4, rtol=1e-4,
                                   equal_nan=True)
    for name in ("conv", "ssm"):  # slots outside the batch as they were (noise), the batch's as eager left them
        torch.testing.assert_close(getattr(static.pool, name), getattr(eager.pool, name), atol=1e-4, rtol=1e-4)


def test_the_runner_replays_decode_graphs_for_a_hybrid(model):
    """ModelRunner.forward dispatches a hybrid's decode to its DecodeGraphs (bucket, upload, clone): on the CPU
    the recorded graph stands in by the function it captures, run on the same buffers. Greedy tokens and
    logits equal the eager runner's; a row past the block table's width (context 16) runs eagerly."""

    class Replay:  # what torch.cuda.CUDAGraph.replay does for DecodeGraphs: refill outputs[b] from the buffers
        def __init__(self, graphs, b):
            self.graphs, self.b = graphs, b

        def replay(self):
            self.graphs.outputs[self.b] = self.graphs.inputs.forward(self.b)

    eager, graphed = _runner(model, 4), _runner(model, 4)
    graphed.graphs = DecodeGraphs(model, graphed.pool, 6, CPU, graphed.kv_pool, context_length=16)
    graphed.graphs.graphs = {b: Replay(graphed.graphs, b) for b in graphed.graphs.buckets}
    alloc = eager.kv_pool.allocator
    seqs = [[1, 2, 3], [4] * 9, [8, 7, 6, 5, 4, 3, 2, 1, 9, 9, 9]]
    for i, p in enumerate(seqs):
        assert alloc.ensure(i, 40)
    pages = [alloc.pages(i) for i in range(3)]
    prefill = ForwardBatch(ForwardMode.EXTEND, sum(seqs, []), [len(p) for p in seqs], [0] * 3, [1, 2, 3], pages=pages)
    out = [r.forward(prefill).logits for r in (eager, graphed)]
    replays = 0
    while len(seqs[2]) < 20:  # sequence 2 passes 16 tokens: those steps run eagerly on the graphed runner
        nxt = out[0].argmax(-1).tolist()
        assert out[1].argmax(-1).tolist() == nxt
        for s, t in zip(seqs, nxt):
            s.append(t)
        batch = ForwardBatch(ForwardMode.DECODE, nxt, [1] * 3, [len(s) - 1 for s in seqs], [1, 2, 3], pages=pages)
        replays += graphed.graphs.fits(batch.batch_size, batch.start_pos)
        out = [r.forward(batch).logits for r in (eager, graphed)]
        torch.testing.assert_close(out[1], out[0], atol=1e-4, rtol=1e-4)
    assert replays == 16 - 11 and not graphed.graphs.fits(3, [16])


def test_a_row_the_buffers_cannot_hold_is_refused_before_anything_runs(granite):
    runner = _runner(granite, 4)
    buffers = DecodeBuffers(granite, runner.pool, 4, CPU, runner.kv_pool, context_length=10)  # 3 pages of 4
    assert buffers.max_kv_tokens == 12 and buffers.fits([0, 11]) and not buffers.fits([3, 12])
    ids = torch.tensor([1, 2])
    with pytest.raises(ValueError, match="has only 1 pages of 4"):
        buffers.load(2, ids, [0, 1], [2, 4], [[5], [6]])
    with pytest.raises(ValueError, match="does not fit the decode block table"):
        buffers.load(2, ids, [0, 1], [2, 12], [[5], [6, 7, 8, 9]])
    buffers.load(2, ids, [0, 1], [2, 4], [[5], [6, 7, 8, 9]])  # what the refused loads did not upload, this does
    assert buffers.block_table[:2].tolist() == [[5, 0, 0], [6, 7, 8]]
    assert buffers.view[:, :2].tolist() == [[2, 4], [3, 5]]
    buffers.load(2, ids, [1, 0], [1, 2], [[9], [5]])  # new rows: their pages go up, what follows is never read
    assert buffers.block_table[:2, :1].tolist() == [[9], [5]] and buffers.view[:, :2].tolist() == [[1, 2], [2, 3]]


def test_decode_capture_is_blocked_by_reference_kernels_and_the_torch_expert_loop(model, monkeypatch, tmp_path):
    """Decode is captured only where its kernels run Triton: the references (CPU, no Triton, or
    MAMBASERVE_KERNELS=ref on CUDA) index with boolean masks (a host synchronisation, which a capture refuses),
    and a MoE hybrid's torch expert loop copies row counts to the host. Pure Mamba2 as well as the hybrids."""
    from tests.server.tiny_models import make_checkpoint

    mamba2 = load_model(make_checkpoint(tmp_path / "m2"), torch.float32, CPU)[0]
    assert model.capture_blocker(Mode.EXTEND) is not None  # prefill graphs are not built for hybrids
    for m in (model, mamba2):  # here on the CPU: the references run
        assert "reference" in m.capture_blocker(Mode.DECODE)
    monkeypatch.setattr(kernels, "decode_runs_triton", lambda t: True)
    assert mamba2.capture_blocker(Mode.DECODE) is None
    if model.dims.moe is None:
        assert model.capture_blocker(Mode.DECODE) is None
    else:  # the experts still run the torch loop, which syncs with the host; the Triton kernel does not
        assert "expert loop" in model.capture_blocker(Mode.DECODE)
        monkeypatch.setattr(kernels, "moe_runs_triton", lambda t: True)
        assert model.capture_blocker(Mode.DECODE) is None


def test_prefill_warm_up_of_a_hybrid_borrows_pages_and_gives_everything_back(granite):
    """The engine's start-up warm-up (every prefill shape class the kernels compile a variant for) runs on a
    hybrid with KV pages borrowed beside the slots, and leaves every slot and page free."""
    runner = _runner(granite, 4)
    limits = warm_up.Limits(max_running=4, chunk=16, context_length=40, track_interval=8)
    warm_up.compile_kernels(runner, limits)
    assert runner.pool.allocator.num_free == runner.pool.allocator.capacity
    assert runner.kv_pool.allocator.num_free == PAGES and not runner.kv_pool.allocator.owners()
    small = _runner(granite, 4)
    small.kv_pool.allocator.ensure("other", (PAGES - 2) * 4)  # room for 2 pages: the steps that need more skip
    warm_up.compile_kernels(small, limits)
    assert small.pool.allocator.num_free == small.pool.allocator.capacity
    assert small.kv_pool.allocator.owners() == ["other"] and small.kv_pool.allocator.num_free == 2


@pytest.mark.parametrize("page_size", [1, 4])
def test_the_runner_replays_prefill_graphs_for_a_hybrid(model, page_size):
    """ModelRunner.forward dispatches a hybrid's prefill to its PrefillGraphs (bucket, upload, clone; on the CPU the
    recorded graph stands in by the function it captures): fresh prompts, then prompts resumed over their cached
    pages with a snapshot before the last token (a cache hit's step), in buckets with padding sequences. Logits,
    states, snapshots and KV pages equal the eager runner's; padding writes no page and no slot (pages nobody
    owns stay NaN); a sequence longer than the block table (context 48) runs eagerly."""

    class Replay:
        def __init__(self, graphs, bucket):
            self.graphs, self.bucket = graphs, bucket

        def replay(self):
            self.graphs.outputs[self.bucket] = self.graphs._forward(self.bucket)

    eager, graphed = _runner(model, page_size), _runner(model, page_size)
    graphs = graphed.prefill_graphs = PrefillGraphs(model, graphed.pool, 64, 4, CPU, graphed.kv_pool,
                                                    context_length=48)
    graphs.graphs = {b: Replay(graphs, b) for b in graphs.buckets}
    alloc = eager.kv_pool.allocator
    prompts = [[3, 9, 4, 1, 7, 2, 2, 8], list(range(10, 31)), [5, 6, 4]]
    for i, n in enumerate([16, 36, 12]):
        assert alloc.ensure(i, n)
    pages = [alloc.pages(i) for i in range(3)]
    unowned = sorted(set(range(PAGES)) - {q for ps in pages for q in ps})
    for r in (eager, graphed):
        r.kv_pool.k[:, unowned] = float("nan")
        r.kv_pool.v[:, unowned] = float("nan")
    slots = [2, 5, 3]
    steps = [  # (sequences, their new tokens' start, snapshot slots)
        ([0, 1, 2], [0, 0, 0], []),
        ([2, 0], [3, 8], [(1, 6)]),  # resumed over cached pages; sequence 0's state before its last token to slot 6
        ([1], [21], [(0, 7)]),
    ]
    extra = [[11, 12, 13, 14, 15], [7] * 14, [1, 1, 1, 2, 2, 2, 3]]
    for seqs, starts, snap in steps:
        toks = [(prompts[i] if st == 0 else extra[i]) for i, st in zip(seqs, starts)]
        batch = ForwardBatch(ForwardMode.EXTEND, sum(toks, []), [len(t) for t in toks], starts,
                             [slots[i] for i in seqs], snap=snap, pages=[pages[i] for i in seqs])
        bucket = graphs.fits(batch)
        assert bucket is not None and bucket[0] > len(seqs)
        want, got = (r.forward(batch).logits for r in (eager, graphed))
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for name in ("k", "v"):
        torch.testing.assert_close(getattr(graphed.kv_pool, name), getattr(eager.kv_pool, name), atol=1e-4,
                                   rtol=1e-4, equal_nan=True)
    for name in ("conv", "ssm"):
        torch.testing.assert_close(getattr(graphed.pool, name), getattr(eager.pool, name), atol=1e-4, rtol=1e-4)
    width = graphs.max_pages
    assert width == -(-48 // page_size)
    long = ForwardBatch(ForwardMode.EXTEND, [1], [1], [width * page_size], [5], pages=[list(range(width + 1))])
    assert graphs.fits(long) is None
