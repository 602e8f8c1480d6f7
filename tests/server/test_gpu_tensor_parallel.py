"""Tensor parallelism on two GPUs: NCCL, the Triton kernels on each rank's shard, the warm-up and the CUDA graphs
captured on both ranks with the all-reduces inside. Greedy outputs and logprobs of concurrent requests at TP 2
equal TP 1 (fp32), a second round through the radix cache included; a session file written at TP 2 (gathered
over NCCL) restores at TP 1."""

import asyncio

import pytest
import torch

from mambaserve.server.config import ServerConfig
from mambaserve.server.engine.engine import Engine
from mambaserve.server.engine.request import SamplingParams
from tests.server.tiny_hybrids import make_hybrid_checkpoint
from tests.server.tiny_models import make_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]

PROMPTS = [list(range(5, 16)), [20, 21, 22], [30] * 40, [40, 41, 42, 43, 44], list(range(50, 90))]
LENGTHS = [12, 20, 7, 16, 25]


def _engine(path, tp: int, snapshots: str, hybrid: bool) -> Engine:
    return Engine(ServerConfig(model=str(path), device="cuda", dtype="float32", tensor_parallel_size=tp,
                               context_length=256, max_running_requests=4, cuda_graph_max_bs=4,
                               chunked_prefill_size=32, debug_cache_invariants=True, session_snapshot_dir=snapshots,
                               **({"page_size": 4} if hybrid else {})))


async def _greedy(engine, p, n, sid=None):
    ids, lps = [], []
    async for o in engine.generate(p, SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True),
                                   return_logprob=True, session_id=sid):
        ids += o.token_ids
        lps += o.logprobs
    return ids, lps


# one B/C group (the gated norm split over the ranks); Nemotron-H's kinds of layer with two groups (one per rank) and
# KV heads split; Granite's MoE with its experts' Triton kernels on each rank's share of every expert
@pytest.mark.parametrize("shape", ["mamba2_one_group", "nemotron_h_dense", "granite_moe"])
def test_tp2_on_two_gpus_equals_tp1(tmp_path, shape):
    torch.backends.cuda.matmul.allow_tf32 = False
    hybrid = shape != "mamba2_one_group"
    if hybrid:
        path = make_hybrid_checkpoint(tmp_path / shape, shape, chunk_size=16)
    else:
        path = make_checkpoint(tmp_path / shape, "h6_g1", num_layers=3, num_heads=4, head_dim=32, hidden_size=64,
                               state_size=32, chunk_size=32)
    snapshots = str(tmp_path / "snapshots")

    async def generate(engine, tp):
        first = await asyncio.gather(*[_greedy(engine, p, n) for p, n in zip(PROMPTS, LENGTHS)])
        again = [p + o + [7, 8, 9] for p, (o, _) in zip(PROMPTS, first)]
        second = await asyncio.gather(*[_greedy(engine, p, 6) for p in again])
        sid = await engine.open_session(f"s{tp}", True, None, None)
        turn = await _greedy(engine, PROMPTS[0], 5, sid)
        saved = await engine.snapshot_session(sid, f"from-tp{tp}")
        return first + second + [turn], saved

    outs = {}
    for tp in (2, 1):
        engine = _engine(path, tp, snapshots, hybrid)
        runner = engine.scheduler.runner
        assert runner.graphs is not None and runner.prefill_graphs is not None  # captured on every rank
        engine.start()
        try:
            outs[tp] = asyncio.run(generate(engine))
            if tp == 1:  # the file written at TP 2 goes on here
                restored = asyncio.run(engine.restore_session("from-tp2", "back"))
                after = asyncio.run(_greedy(engine, [60, 61, 62], 5, "back"))
                reference = asyncio.run(_greedy(engine, [60, 61, 62], 5, "s1"))  # the TP-1 session's own turn
        finally:
            engine.stop()
    for (a, la), (b, lb) in zip(outs[2][0], outs[1][0]):
        assert a == b
        torch.testing.assert_close(torch.tensor(la), torch.tensor(lb), atol=2e-3, rtol=0)
    assert outs[2][1]["has_state"] == (not hybrid) and restored["tokens"] == outs[2][1]["tokens"]
    assert after[0] == reference[0]
