"""The request timeline: every stage from arrival to the first byte is stamped and exported, and the
stage shares add up to the time the client waited."""

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from mambaserve.server.engine.timeline import Timeline
from tests.server.conftest import make_engine, run, serving, uvicorn_server


def stage_histogram(metrics_text: str) -> dict[str, tuple[float, float]]:
    """stage -> (count, sum) of mambaserve_request_stage_seconds."""
    out: dict[str, list[float]] = {}
    for fam in text_string_to_metric_families(metrics_text):
        if fam.name != "mambaserve_request_stage_seconds":
            continue
        for s in fam.samples:
            if s.name.endswith("_count"):
                out.setdefault(s.labels["stage"], [0, 0])[0] = s.value
            elif s.name.endswith("_sum"):
                out.setdefault(s.labels["stage"], [0, 0])[1] = s.value
    return {k: tuple(v) for k, v in out.items()}


def test_shares_follow_the_order_stages_happened():
    tl = Timeline(received=10.0)
    tl.marks.update(validated=10.5, queued=10.5, admitted=11.0, first_token=13.0, launched=12.0)
    tl.mark("queued")  # a second mark keeps the first
    assert tl.marks["queued"] == 10.5
    assert tl.shares() == [("validated", 0.5), ("queued", 0.0), ("admitted", 0.5), ("launched", 1.0),
                           ("first_token", 1.0)]


def test_streamed_and_whole_answers_export_every_stage(tiny_ckpt):
    """Over a real socket: a streamed request's stages end at its first chunk, a non-streamed one's at the
    whole answer (so 'finished' is among them); refused requests are not counted; the shares of one request
    add up to no more than what the client measured."""
    engine = make_engine(tiny_ckpt)
    with uvicorn_server(engine) as url, httpx.Client(base_url=url, timeout=60) as c:
        t0 = time.perf_counter()
        with c.stream("POST", "/generate", json={"input_ids": [5, 6, 7, 8], "stream": True,
                                                  "sampling_params": {"max_new_tokens": 8, "temperature": 0}}) as r:
            waited = None
            for line in r.iter_lines():
                if waited is None and line.startswith("data: "):
                    waited = time.perf_counter() - t0
        first = stage_histogram(c.get("/metrics").text)
        assert c.post("/generate", json={"input_ids": [1] * 300}).status_code == 400  # refused: not timed
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4,
                                            "temperature": 0})
        assert r.status_code == 200
        second = stage_histogram(c.get("/metrics").text)
    streamed = {"validated", "queued", "admitted", "launched", "first_token", "first_byte"}
    assert {s for s, (n, _) in first.items() if n == 1} >= streamed
    assert first["finished"][0] == 0 or first["finished"][1] < 0.5  # a stream's end comes after its first byte
    assert sum(total for _, total in first.values()) <= waited
    assert {s for s, (n, _) in second.items() if n - first[s][0] == 1} == streamed | {"finished"}


def test_health_generate_and_in_process_requests_are_not_timed(tiny_ckpt):
    async def go():
        async with serving(make_engine(tiny_ckpt)) as c:
            assert (await c.get("/health_generate")).status_code == 200
            return stage_histogram((await c.get("/metrics")).text)

    assert all(n == 0 for n, _ in run(go()).values())
