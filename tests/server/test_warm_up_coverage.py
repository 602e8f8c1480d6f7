"""The start-up warm-up compiles every kernel specialization that requests reach, so nothing compiles while serving.

Random request mixes (chats resent with their answers, prompts sent again, long prompts in chunks, prompt
logprobs, two answers to a prompt, many requests at once) run through the real scheduler on a tiny hybrid on the
CPU, and every step it launched is recorded. The steps are then replayed at real model shapes (nemotron-h-8b,
granite-4.0-h-tiny: benchmarks/hybrid_step.SHAPES) on the meta device with an H100's launch choices
(``kernels.variants.dry_run``), after the warm-up the engine runs at start under the same limits
(``engine/warm_up.compile_kernels``, the CUDA graph captures included; a replayed graph launches nothing): each
Triton specialization the steps launch must be one the warm-up launched. On a GPU the same is measured for real
by ``mambaserve_kernel_compiles_total{phase="serving"}`` (benchmarks/hybrid_session.sh prints it)."""

import asyncio
import dataclasses
import importlib
import random
import types
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from mambaserve.kernels.variants import dry_run  # noqa: E402
from mambaserve.server.cache.prefix_cache import StateOps  # noqa: E402
from mambaserve.server.config import ServerConfig  # noqa: E402
from mambaserve.server.engine import cuda_graphs, warm_up  # noqa: E402
from mambaserve.server.engine.engine import Engine  # noqa: E402
from mambaserve.server.engine.kv_pool import KVPool  # noqa: E402
from mambaserve.server.engine.model_runner import ModelRunner  # noqa: E402
from mambaserve.server.engine.request import SamplingParams  # noqa: E402
from mambaserve.server.engine.state_pool import MambaStatePool  # noqa: E402
from mambaserve.server.model.registry import ARCHITECTURES  # noqa: E402
from tests.server.conftest import run_started  # noqa: E402

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

# served configurations (the tiny model's chunk of 8 divides the real ones' 128 and 256, so do tracked positions)
CONFIGS = {
    # a few chats at a time, long prompts in chunks, decode graphs for 8 rows and eager past them, tracked snapshots
    "chunked": dict(max_running_requests=12, chunked_prefill_size=64, context_length=512, cuda_graph_max_bs=8,
                    mamba_cache_strategy="extra_buffer", mamba_track_interval=256, mamba_cache_size=40),
    # many requests at once (prefills of more than 32 sequences), no CUDA graphs: every step eager
    "wide": dict(max_running_requests=40, chunked_prefill_size=512, context_length=384, disable_cuda_graph=True,
                 mamba_cache_size=96),
}


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    import sys

    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module("hybrid_step").SHAPES
    finally:
        sys.path.remove(str(BENCHMARKS))


async def _client(engine, rng: random.Random, context: int) -> None:
    """A chat of a few turns: its history resent with the answer and a question, sometimes the same prompt again,
    sometimes with its prompt's logprobs, sometimes two answers at once."""
    history = [rng.randrange(3, 90) for _ in range(rng.choice([1, 5, 17, 40, 120, 300]))]
    for _ in range(rng.randrange(1, 5)):
        n = rng.choice([0, 1, 3, 9])
        if len(history) + n >= context - 1:
            return
        params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
        if rng.random() < 0.15:
            outs = [[t async for o in g for t in o.token_ids] for g in engine.generate_n(list(history), params, 2)]
            answer = outs[0]
        else:
            logprobs = rng.random() < 0.15
            gen = engine.generate(list(history), params, return_logprob=logprobs,
                                  logprob_start_len=rng.randrange(len(history)) if logprobs else -1)
            answer = [t async for o in gen for t in o.token_ids]
        if rng.random() < 0.8:  # else the same prompt again
            history = history + answer + [rng.randrange(3, 90) for _ in range(rng.choice([1, 7, 16, 70]))]
        await asyncio.sleep(rng.random() * 0.02)


def _served_steps(ckpt, config: dict, seed: int):
    """(the engine's limits, the distinct steps its scheduler ran for a random mix, its pool sizes)."""
    engine = Engine(ServerConfig(model=str(ckpt), device="cpu", page_size=16, **config))
    runner = engine.scheduler.runner
    steps = {}
    forward = runner.forward

    def recording(batch):
        out = forward(batch)
        kinds = tuple(sorted({kind for kind, _, _ in batch.state_ops.ops}))
        key = (batch.mode, tuple(sorted(batch.seq_lens)), max(map(len, batch.pages or [[]])), bool(batch.snap),
               bool(batch.track), bool(batch.logprob_at), batch.all_logits, kinds)
        steps.setdefault(key, dataclasses.replace(
            batch, state_ops=StateOps([op for op in batch.state_ops.ops if op[0] in ("copy", "clear")]),
            from_prev=[], prev_tokens=None))
        return out

    runner.forward = recording
    rng = random.Random(seed)

    async def mix():
        if engine.track_interval:  # a tracked position inside a chunk, whatever order admission takes the mix in:
            # a prompt sent again longer, its hit (a page boundary 48 tokens short of the interval) then
            # prefilled in a chunk across the interval
            first = [rng.randrange(3, 90) for _ in range(engine.track_interval - 40)]
            for prompt in (first, first + [7] * 80):
                async for _ in engine.generate(prompt, SamplingParams(max_new_tokens=1, temperature=0.0)):
                    pass
        clients = [_client(engine, random.Random(rng.random()), engine.context_length)
                   for _ in range(engine.max_running + 4)]
        await asyncio.gather(*clients)

    run_started(engine, mix)
    cfg = engine.cfg
    limits = warm_up.Limits(max_running=engine.max_running, chunk=cfg.chunked_prefill_size,
                            context_length=engine.context_length, track_interval=engine.track_interval,
                            graph_max_bs=0 if cfg.disable_cuda_graph else min(engine.max_running,
                                                                              cfg.cuda_graph_max_bs))
    return limits, list(steps.values()), engine.pool.allocator.capacity, engine.kv_pool.allocator.capacity


def _meta_runner(shape, slots: int, pages: int) -> ModelRunner:
    """The real shape's model, state pool and KV pool on the meta device (no memory, no values)."""
    arch_name, cfg = shape
    arch = ARCHITECTURES[arch_name]
    dims = arch.read_dims(cfg)
    dev = torch.device("meta")
    with dev:
        model = arch.model_class(dims).to(torch.bfloat16)
    model.refresh_derived()  # as a load does once the weights are in place
    pool = MambaStatePool.for_model(model, slots, torch.bfloat16, torch.float32, dev)
    kv = KVPool.for_model(model, pages, 16, torch.bfloat16, dev)
    return ModelRunner(model, pool, dev, kv)


@pytest.fixture
def graphs_on_meta(monkeypatch):
    """CUDA graphs on the meta device: a capture runs the function it would capture once (its launches are the
    capture's compiles), a replay launches nothing."""
    def capture_all(keys, forward, graphs, outputs, warmups, prepare=None):
        for key in keys:
            if prepare is not None:
                prepare(key)
            outputs[key] = forward(key)
            graphs[key] = types.SimpleNamespace(replay=lambda: None)

    monkeypatch.setattr(cuda_graphs, "capture_all", capture_all)
    monkeypatch.setattr(cuda_graphs.DecodeGraphs, "run",
                        lambda self, ids, slots, *rest: self.outputs[self.buckets[-1]][:len(slots)])
    monkeypatch.setattr(cuda_graphs.PrefillGraphs, "run",
                        lambda self, bucket, ids, batch: self.outputs[bucket][:batch.batch_size])


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_every_specialization_requests_launch_was_compiled_at_start(nemotron, shapes, config, graphs_on_meta):
    limits, steps, slots, pages = _served_steps(nemotron, CONFIGS[config], seed=sorted(CONFIGS).index(config))
    kinds = {(s.mode.name, s.batch_size > 32, s.num_tokens == 1, bool(s.snap), bool(s.track), bool(s.logprob_at))
             for s in steps}
    assert {k[0] for k in kinds} == {"EXTEND", "DECODE"} and any(k[3] for k in kinds)  # the mix is a real one
    assert any(k[4] for k in kinds) == bool(limits.track_interval)
    for name in ("nemotron-h-8b", "granite-4.0-h-tiny"):
        runner = _meta_runner(shapes[name], slots, pages)
        with dry_run() as compiled:
            warm_up.compile_kernels(runner, limits)
        with dry_run() as served:
            for step in steps:
                runner.forward(step)
        missing = sorted(served - compiled)
        assert not missing, f"{name}, {config}: {len(missing)} specializations compile while serving: " + "\n".join(
            map(str, missing[:5]))
        assert len(compiled) < 100  # start time: each is a compile of a few seconds (cached across restarts)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_nothing_compiles_after_ready_on_a_gpu(tmp_path, config):
    """The same mixes on a GPU, for real: once the engine is ready (its warm-up and graph captures done), Triton
    compiles nothing (kernels.compiles counts every compile in the process; a tiny MoE Nemotron-H with Triton's
    chunk of 16)."""
    from tests.server.tiny_hybrids import make_hybrid_checkpoint

    path = make_hybrid_checkpoint(tmp_path / "nh", "nemotron_h", chunk_size=16)
    engine = Engine(ServerConfig(model=str(path), device="cuda", dtype="bfloat16", page_size=16,
                                 kernel_cache_dir=str(tmp_path / "kernels"), **CONFIGS[config]))
    assert engine.compiles["warmup"] > 0  # a cold cache: the warm-up compiled (loads from the cache count too)
    engine.mark_ready()
    rng = random.Random(0)

    async def mix():
        await asyncio.gather(*[_client(engine, random.Random(rng.random()), engine.context_length)
                               for _ in range(engine.max_running + 4)])

    run_started(engine, mix)
    assert engine.compiles["serving"] == 0
