"""The engine on a GPU: Triton kernels against transformers, CUDA-graph decode and prefill against eager."""

import pytest
import torch

from mambaserve.server.engine.batch import ForwardBatch, ForwardMode
from mambaserve.server.model.loader import load_model
from mambaserve.server.engine.model_runner import ModelRunner
from mambaserve.server.engine.state_pool import MambaStatePool
from tests.server.hf_reference import hf_norm_is_grouped
from tests.server.tiny_models import make_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _runner(path, graphs: bool, slots=16):
    dev = torch.device("cuda")
    model, _ = load_model(path, torch.float32, dev)
    pool = MambaStatePool.for_model(model, slots, torch.float32, torch.float32, dev)
    runner = ModelRunner(model, pool, dev)
    if graphs:
        runner.enable_cuda_graphs(8, max_prefill_tokens=128, max_prefill_seqs=8)
    return runner


@pytest.fixture(scope="module", params=["tiny", "medium"])
def ckpt(request, tmp_path_factory):
    # power-of-two chunk sizes, so the Triton scan (not its fallback) runs
    if request.param == "tiny":
        return make_checkpoint(tmp_path_factory.mktemp("gpu"), "h8_g2", num_layers=3, chunk_size=16)
    return make_checkpoint(tmp_path_factory.mktemp("gpu"), "h6_g1", num_layers=3, num_heads=4, head_dim=32,
                           hidden_size=64, state_size=32, chunk_size=32)


def _comparable_with_hf(path) -> bool:
    import json

    return json.loads((path / "config.json").read_text())["n_groups"] == 1 or hf_norm_is_grouped()


def test_triton_forward_matches_transformers_and_graphs_match_eager(ckpt):
    from transformers import Mamba2ForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    hf = Mamba2ForCausalLM.from_pretrained(ckpt, dtype=torch.float32).cuda().eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 90, (n,), generator=g).tolist() for n in (5, 37, 16, 70)]
    eager, graphed = _runner(ckpt, False), _runner(ckpt, True)
    outs = {}
    for name, runner in (("eager", eager), ("graph", graphed)):
        batch = ForwardBatch(ForwardMode.EXTEND, sum(prompts, []), [len(p) for p in prompts], [0] * 4, [1, 2, 3, 4])
        logits = runner.forward(batch).logits
        seqs = [list(p) for p in prompts]
        steps = [logits]
        for _ in range(5):
            nxt = logits.argmax(-1).tolist()
            for s, t in zip(seqs, nxt):
                s.append(t)
            logits = runner.forward(ForwardBatch(ForwardMode.DECODE, nxt, [1] * 4, [len(s) - 1 for s in seqs],
                                                 [1, 2, 3, 4])).logits
            steps.append(logits)
        outs[name] = (seqs, steps)
    seqs, steps = outs["eager"]
    with torch.no_grad():
        for i, s in enumerate(seqs if _comparable_with_hf(ckpt) else []):
            ref = hf(torch.tensor([s], device="cuda"), use_cache=False).logits[0, -1]
            rel = ((steps[-1][i] - ref).norm() / ref.norm()).item()
            # Triton's fp32 dots run on tensor cores (tf32): ~1e-3 relative, as the kernels' tests allow
            assert rel < 5e-3, (i, rel, (steps[-1][i] - ref).abs().max().item())
    assert outs["graph"][0] == seqs  # same greedy tokens
    for a, b in zip(outs["graph"][1], steps):
        diff = (a - b).abs().max().item()
        assert diff < 1e-3, diff  # padded buckets may pick other GEMM tiles: rounding-level differences


def test_prefill_triton_vs_reference_vs_transformers_on_gpu(ckpt, monkeypatch):
    """Locates a GPU mismatch: our forward with Triton kernels, with the torch references, and HF."""
    from transformers import Mamba2ForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    hf = Mamba2ForCausalLM.from_pretrained(ckpt, dtype=torch.float32).cuda().eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 90, (n,), generator=g).tolist() for n in (5, 37, 16, 70)]

    def ours():
        runner = _runner(ckpt, False)
        batch = ForwardBatch(ForwardMode.EXTEND, sum(prompts, []), [len(p) for p in prompts], [0] * 4, [1, 2, 3, 4],
                             all_logits=True)
        return runner.forward(batch).logits

    triton_logits = ours()
    monkeypatch.setenv("MAMBASERVE_KERNELS", "ref")
    ref_logits = ours()
    with torch.no_grad():
        hf_logits = torch.cat([hf(torch.tensor([p], device="cuda"), use_cache=False).logits[0] for p in prompts])
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    report = {"triton_vs_ref": rel(triton_logits, ref_logits)}
    if _comparable_with_hf(ckpt):
        report |= {"ref_vs_hf": rel(ref_logits, hf_logits), "triton_vs_hf": rel(triton_logits, hf_logits)}
    assert max(report.values()) < 5e-3, report


def test_prefill_graphs_match_eager_and_touch_only_their_slots(ckpt):
    """Prefill batches of every kind (fresh and resumed mid-chunk, a token count equal to a bucket's, one
    that needs the largest) replayed from the prefill graphs: the logits and states of eager runs, and the
    slots outside the batch bit for bit as they were."""
    eager, graphed = _runner(ckpt, False), _runner(ckpt, True)
    g = torch.Generator().manual_seed(1)
    for r in (eager, graphed):
        r.pool.conv.copy_(torch.randn(r.pool.conv.shape, generator=g.manual_seed(2)))
        r.pool.ssm.copy_(torch.randn(r.pool.ssm.shape, generator=g.manual_seed(3)))
    before = graphed.pool.ssm.clone(), graphed.pool.conv.clone()
    cases = [([5], [0], [1]), ([3, 20], [0, 7], [2, 3]), ([16], [0], [4]), ([1], [33], [5]),
             ([40, 1, 9, 2, 30, 6, 11], [0, 3, 17, 0, 40, 1, 2], [6, 7, 8, 9, 10, 11, 12])]
    used = set()
    for lens, starts, slots in cases:
        assert graphed.prefill_graphs.bucket(len(lens), sum(lens)) is not None
        ids = torch.randint(1, 90, (sum(lens),), generator=g).tolist()
        out = [r.forward(ForwardBatch(ForwardMode.EXTEND, ids, lens, starts, slots)).logits for r in (eager, graphed)]
        assert (out[0] - out[1]).abs().max().item() < 1e-3, (lens, starts)
        used |= set(slots)
    for name in ("ssm", "conv"):
        a, b = getattr(eager.pool, name), getattr(graphed.pool, name)
        assert (a - b).abs().max().item() < 1e-3, name
    free = [s for s in range(graphed.pool.ssm.shape[1]) if s not in used]
    assert torch.equal(graphed.pool.ssm[:, free], before[0][:, free])
    assert torch.equal(graphed.pool.conv[:, free], before[1][:, free])


def test_host_tier_round_trip_on_pinned_memory_is_bit_exact(ckpt):
    """Offload to pinned host memory and load back, asynchronous on the forward's stream: bit for bit."""
    from mambaserve.server.cache.prefix_cache import StateOps
    from mambaserve.server.engine.state_pool import HostStatePool

    runner = _runner(ckpt, False)
    runner.host_pool = HostStatePool(runner.pool, 3, pin=True)
    assert runner.host_pool.ssm.is_pinned()
    g = torch.Generator().manual_seed(0)
    state = {"conv": torch.randn(runner.pool.conv[:, 0].shape, generator=g),
             "ssm": torch.randn(runner.pool.ssm[:, 0].shape, generator=g)}
    runner.write_slot(2, state)
    runner.apply_state_ops(StateOps([("offload", 2, 1), ("clear", 2, 2), ("load", 1, 5)]))
    back = runner.read_slot(5)
    assert torch.equal(back["conv"].cpu(), state["conv"]) and torch.equal(back["ssm"].cpu(), state["ssm"])
    assert not runner.read_slot(2)["ssm"].any()


def test_offloads_on_the_copy_stream_finish_before_their_slot_is_written(ckpt):
    """An offload runs on the copy stream beside the forwards; a forward that writes the offloaded slot
    right after (its slot handed to another request) waits for the copy: the host gets the state as it was;
    the storage thread's fence covers a copy no forward waited for."""
    from mambaserve.server.cache.prefix_cache import StateOps
    from mambaserve.server.engine.state_pool import HostStatePool

    runner = _runner(ckpt, False)
    runner.host_pool = HostStatePool(runner.pool, 3, pin=True)
    g = torch.Generator().manual_seed(1)
    states = [{"conv": torch.randn(runner.pool.conv[:, 0].shape, generator=g),
               "ssm": torch.randn(runner.pool.ssm[:, 0].shape, generator=g)} for _ in range(2)]
    for slot, state in zip((2, 3), states):
        runner.write_slot(slot, state)
    ids = [1 + i % 90 for i in range(2048)]  # a long prefill queued behind the offload: the copy would lose a race
    runner.forward(ForwardBatch(ForwardMode.EXTEND, ids, [2048], [0], [2], StateOps([("offload", 2, 0)])))
    runner.forward(ForwardBatch(ForwardMode.EXTEND, ids, [2048], [0], [4], StateOps([("offload", 3, 1)])))
    runner.fence().synchronize()
    for h, state in enumerate(states):
        assert torch.equal(runner.host_pool.conv[h], state["conv"]) and torch.equal(runner.host_pool.ssm[h], state["ssm"])


# ---------------------------------------------------------------------------------------------- hybrid models

CAPTURED_HYBRIDS = ["nemotron_h_dense", "granite_dense_rope", "bamba", "granite_moe", "nemotron_h"]  # MoE: Triton


def _hybrid_runner(path, graphs: bool, page_size: int = 4, context: int = 64):
    """A hybrid's runner on pools whose state slots are noise and whose KV pages are NaN until written: a
    padding row that wrote a page or read one past its length would show."""
    from mambaserve.server.engine.kv_pool import KVPool

    dev = torch.device("cuda")
    model, _ = load_model(path, torch.float32, dev)
    pool = MambaStatePool.for_model(model, 8, torch.float32, torch.float32, dev)
    kv = KVPool.for_model(model, 96, page_size, torch.float32, dev)
    g = torch.Generator().manual_seed(5)
    pool.conv.copy_(torch.randn(pool.conv.shape, generator=g))
    pool.ssm.copy_(torch.randn(pool.ssm.shape, generator=g))
    kv.k.fill_(float("nan"))
    kv.v.fill_(float("nan"))
    runner = ModelRunner(model, pool, dev, kv)
    if graphs:
        runner.enable_cuda_graphs(8, max_prefill_tokens=128, max_prefill_seqs=8, context_length=context)
    return runner


@pytest.mark.parametrize("context", [64, 4096])
@pytest.mark.parametrize("family", CAPTURED_HYBRIDS)
def test_hybrid_decode_graphs_match_eager(tmp_path, family, context):
    """Four sequences prefilled eagerly, then decode replayed from the graphs with rows leaving, coming back
    and changing places (padded buckets, block table rows re-uploaded): logits within rounding of the eager
    runner's, the same greedy tokens, and the same KV pages and states (NaN pages stay NaN: padding rows wrote
    nothing). Context 64: one row outgrows the graphs' block table and runs eagerly from there; 4096: the
    decode kernel splits each row's keys 16 ways, most splits empty (eager, sized by the batch, does not split)."""
    from mambaserve.kernels.paged_attention import DECODE_TILES, decode_splits
    from mambaserve.kernels._dispatch import sm_count
    from tests.server.tiny_hybrids import make_hybrid_checkpoint

    torch.backends.cuda.matmul.allow_tf32 = False
    path = make_hybrid_checkpoint(tmp_path / family, family, chunk_size=16)
    eager, graphed = _hybrid_runner(path, False), _hybrid_runner(path, True, context=context)
    assert graphed.graphs is not None and graphed.prefill_graphs is not None  # the prefill below replays a graph
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(1, 90, (n,), generator=g).tolist() for n in (5, 37, 16, 50)]
    alloc = eager.kv_pool.allocator
    for i, p in enumerate(seqs):
        assert alloc.ensure(i, 80)  # past the graphs' 64 tokens: the last steps of sequence 3 run eagerly
    pages = [alloc.pages(i) for i in range(4)]
    slots = [1, 2, 3, 4]
    prefill = ForwardBatch(ForwardMode.EXTEND, sum(seqs, []), [len(p) for p in seqs], [0] * 4, slots, pages=pages)
    last = eager.forward(prefill).logits.argmax(-1).tolist()
    graphed.forward(prefill)
    schedule = [[0, 1, 2, 3]] * 3 + [[3, 1], [2, 0, 3], [0], [1, 2, 3, 0]] + [[3, 0, 1, 2]] * 12
    replays = 0
    for rows in schedule:
        for i in rows:
            seqs[i].append(last[i])
        batch = ForwardBatch(ForwardMode.DECODE, [seqs[i][-1] for i in rows], [1] * len(rows),
                             [len(seqs[i]) - 1 for i in rows], [slots[i] for i in rows], pages=[pages[i] for i in rows])
        replays += graphed.graphs.fits(batch.batch_size, batch.start_pos)
        want, got = eager.forward(batch).logits, graphed.forward(batch).logits
        assert (want - got).abs().max().item() < 1e-3, rows
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
        for i, t in zip(rows, want.argmax(-1).tolist()):
            last[i] = t
    if context == 64:
        assert 0 < replays < len(schedule)  # both paths ran
    else:
        a = graphed.model.dims.attention
        assert replays == len(schedule)
        assert decode_splits(1, a.num_kv_heads, context, sm_count(torch.device("cuda")), DECODE_TILES["block_n"]) > 1
    for a, b in ((eager.kv_pool.k, graphed.kv_pool.k), (eager.kv_pool.v, graphed.kv_pool.v),
                 (eager.pool.conv, graphed.pool.conv), (eager.pool.ssm, graphed.pool.ssm)):
        torch.testing.assert_close(b, a, atol=1e-3, rtol=1e-3, equal_nan=True)


@pytest.mark.parametrize("radix", [False, True])
@pytest.mark.parametrize("family", ["nemotron_h_dense", "granite_moe"])
def test_hybrid_engine_greedy_outputs_with_cuda_graphs_equal_disable_cuda_graph(tmp_path, family, radix):
    """The engine on CUDA: a dense and a MoE hybrid's decode and prefill are captured (the experts' Triton kernel),
    and greedy outputs of concurrent requests (batched decode in padded buckets, requests ending at different
    steps; with the radix cache, a second round resending each prompt + answer + new tokens: prefills resumed over
    cached pages, with snapshots) equal those of --disable-cuda-graph; every slot and page comes back."""
    import asyncio

    from mambaserve.server.config import ServerConfig
    from mambaserve.server.engine.engine import Engine
    from mambaserve.server.engine.request import SamplingParams
    from tests.server.tiny_hybrids import make_hybrid_checkpoint

    torch.backends.cuda.matmul.allow_tf32 = False
    path = make_hybrid_checkpoint(tmp_path / family, family, chunk_size=16)
    prompts = [list(range(5, 16)), [20, 21, 22], [30] * 40, [40, 41, 42, 43, 44], list(range(50, 90))]
    lengths = [12, 20, 7, 16, 25]

    async def generate(engine):
        async def one(p, n):
            ids = []
            async for o in engine.generate(p, SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)):
                ids += o.token_ids
            return ids
        first = await asyncio.gather(*[one(p, n) for p, n in zip(prompts, lengths)])
        if not radix:
            return first
        again = [p + o + [7, 8, 9] for p, o in zip(prompts, first)]
        return first + await asyncio.gather(*[one(p, 6) for p in again])

    outs = {}
    for disable in (False, True):
        engine = Engine(ServerConfig(model=str(path), device="cuda", dtype="float32", disable_radix_cache=not radix,
                                     context_length=256, max_running_requests=4, cuda_graph_max_bs=4,
                                     chunked_prefill_size=32, disable_cuda_graph=disable, debug_cache_invariants=True,
                                     page_size=4))
        runner = engine.scheduler.runner
        assert (runner.graphs is not None) == (runner.prefill_graphs is not None) == (not disable)
        engine.start()
        try:
            outs[disable] = asyncio.run(generate(engine))
            acct = asyncio.run(engine.accounting())
        finally:
            engine.stop()
        if not radix:
            assert acct["kv_pages_free"] == acct["kv_pages"] and acct["free"] == acct["capacity"]
    assert outs[False] == outs[True]
    assert [len(o) for o in outs[False]][:len(lengths)] == lengths
