"""One request's failure is its own: a row of a step without a finite distribution (its sampling values,
or its state) fails that request alone; the requests decoding beside it finish normally, and every slot
and page is accounted for afterwards (Mamba2 and a hybrid)."""

import asyncio

import pytest
import torch

from mambaserve.server.engine.request import SamplingParams
from tests.server.conftest import accounting, assert_idle, make_engine, run_started
from tests.server.tiny_hybrids import make_hybrid_checkpoint
from tests.server.tiny_models import make_checkpoint

NEIGHBOUR = SamplingParams(max_new_tokens=24, temperature=0.7, seed=5, ignore_eos=True)


CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module", params=["mamba2", "nemotron_h", pytest.param("mamba2-cuda", marks=CUDA),
                                        pytest.param("nemotron_h-cuda", marks=CUDA)])
def engine(request, tiny_ckpt, nemotron, tmp_path_factory):
    """CPU engines, and on a GPU the same models with the Triton kernels, bf16 and CUDA graphs (the culprit's
    row replayed in the same decode graph as its neighbours')."""
    hybrid = dict(page_size=4, chunked_prefill_size=8, max_running_requests=6, mamba_cache_size=12)
    if request.param == "mamba2":
        return make_engine(tiny_ckpt)
    if request.param == "nemotron_h":
        return make_engine(nemotron, **hybrid)
    root = tmp_path_factory.mktemp("cuda")  # power-of-two chunk sizes: the Triton scan runs
    if request.param == "mamba2-cuda":
        return make_engine(make_checkpoint(root, "h8_g2", num_layers=3, chunk_size=16), device="cuda")
    return make_engine(make_hybrid_checkpoint(root, "nemotron_h", chunk_size=16), device="cuda", **hybrid)


async def _last(engine, prompt, params, **kw):
    last = None
    async for out in engine.generate(prompt, params, **kw):
        last = out
    return last


async def _beside_neighbours(engine, culprit):
    """Three streams decoding, then ``culprit()``; returns (its last output, the neighbours' last outputs,
    how many neighbours were still decoding when it ended)."""
    neighbours = [asyncio.ensure_future(_last(engine, [3 + i, 4, 5], NEIGHBOUR)) for i in range(3)]
    while (await engine.accounting())["running"] < 3:
        await asyncio.sleep(0.005)
    out = await asyncio.wait_for(culprit(), 60)
    still = sum(not n.done() for n in neighbours)
    return out, await asyncio.wait_for(asyncio.gather(*neighbours), 60), still


def test_sampling_values_that_leave_no_distribution_fail_that_request_alone(engine):
    """top_p 1e-46 (0 in float32) and repetition_penalty 1e-39 (an infinite logit) get past no HTTP
    validation any more; sent to the engine directly, each ends its own request with a 400-class error
    while three streams decode beside it."""
    async def go():
        results = []
        for bad in (dict(top_p=1e-46), dict(repetition_penalty=1e-39)):
            params = SamplingParams(max_new_tokens=8, temperature=0.7, **bad)
            results.append(await _beside_neighbours(engine, lambda: _last(engine, [9, 10, 11], params)))
        return results, await accounting(engine)

    results, acc = run_started(engine, go)
    for out, neighbours, still in results:
        assert out.error_code == "invalid_sampling_params" and out.error_status == 400, out
        assert "sampling parameters" in out.error and out.token_ids == []
        assert still > 0  # (it failed while they decoded)
        assert [n.finish_reason.value for n in neighbours] == ["length"] * 3
        assert all(n.error is None and n.completion_tokens == 24 for n in neighbours)
    assert_idle(acc)
    text = engine.metrics.registry.get_sample_value("mambaserve_non_finite_rows_total", {"source": "sampling"})
    assert text == 2


def test_a_state_that_turns_non_finite_fails_its_turn_alone(engine):
    """A streaming session whose live state holds NaN (what a damaged snapshot could bring): its next turn
    fails with an internal error, its slot is freed (never cached), the neighbours finish normally."""
    async def go():
        sid = await engine.open_session(None, True, None, None)
        first = await _last(engine, [7, 8, 9], SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True),
                            session_id=sid)
        assert first.error is None

        def poison():
            s = engine.scheduler.sessions.table.get(sid)
            state = engine.scheduler.runner.read_slot(s.slot)
            engine.scheduler.runner.write_slot(s.slot, {k: torch.full_like(v, float("nan")) for k, v in state.items()})
        while engine.scheduler.sessions.table.sessions[sid].slot is None:  # (the fold of the first turn)
            await asyncio.sleep(0.005)
        await engine.run_in_scheduler(poison)
        turn = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
        out, neighbours, still = await _beside_neighbours(engine, lambda: _last(engine, [12], turn, session_id=sid))
        await engine.close_session(sid)
        return out, neighbours, still, await accounting(engine)

    out, neighbours, still, acc = run_started(engine, go)
    assert out.error_code == "internal_error" and "non-finite" in out.error and out.error_status is None, out
    assert still > 0
    assert [n.finish_reason.value for n in neighbours] == ["length"] * 3 and all(n.error is None for n in neighbours)
    assert_idle(acc)
    assert engine.metrics.registry.get_sample_value("mambaserve_non_finite_rows_total", {"source": "logits"}) == 1
