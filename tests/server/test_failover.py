"""Sessions outlive their worker: two ``mambaserve serve`` processes on one ``--storage-dir`` with
``--session-persist``, behind the real sglang-router (policy manual, assignment min_group; a turn carries
``session_params`` and the session id as ``x-smg-routing-key``). A worker killed (SIGKILL) or drained (SIGTERM):
every session goes on on the other worker from its state loaded from storage, not recomputed, and answers what
an undisturbed run answers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import free_port, run, sglang_router

BUNDLED = Path(__file__).resolve().parents[2] / "models" / "mamba2-tiny-pystdlib"
NEW = 4  # tokens per turn
# The router learns a worker is gone or draining from its health checks (every 60 s by default; in Kubernetes
# its pod discovery drops a deleted pod at once): here every second, so a key moves within about a second.
ROUTER = ("--policy", "manual", "--assignment-mode", "min_group",
          "--health-check-interval-secs", "1", "--health-failure-threshold", "1")


@dataclass
class Worker:
    proc: subprocess.Popen
    url: str
    log: Path

    def text(self) -> str:
        return self.log.read_text(errors="replace")


@contextlib.contextmanager
def _workers(model, tmp_path: Path, *flags: str):
    """Two servers sharing one storage directory, with --session-persist, until healthy."""
    workers = []
    try:
        for i in range(2):
            port, log = free_port(), tmp_path / f"worker{i}.log"
            with log.open("w") as out:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "mambaserve.server", "serve", "--model", str(model), "--port", str(port),
                     "--device", "cpu", "--storage-dir", str(tmp_path / "storage"), "--session-persist",
                     "--host-cache-size", "64MiB", "--context-length", "2048", "--max-running-requests", "8", *flags],
                    stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
            workers.append(Worker(proc, f"http://127.0.0.1:{port}", log))
        deadline = time.monotonic() + 90
        for w in workers:
            while not _healthy(w.url):
                assert w.proc.poll() is None and time.monotonic() < deadline, w.text()[-3000:]
                time.sleep(0.2)
        yield workers
    finally:
        for w in workers:
            if w.proc.poll() is None:
                w.proc.kill()
            w.proc.wait()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def _metric(url: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", httpx.get(url + "/metrics", timeout=10).text, re.M)
    return float(m.group(1)) if m else 0.0


def _words(n, seed):
    return [(seed * 17 + 7 * k * k + k) % 90 + 3 for k in range(n)]


@dataclass
class Answer:
    ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    errors: int  # retryable errors before it (the router's 5xx)


async def _turn(c: httpx.AsyncClient, sid: str, ids: list[int], first: bool = False, n: int = NEW,
                stream: bool = False, on_first_chunk=None) -> Answer:
    """One turn through the router, retried (at most 4 times, 1.5 s apart) on its 5xx: a worker killed between
    turns fails the turns the router still sends it until its health checks see it gone."""
    body = {"input_ids": ids, "stream": stream,
            "session_params": {"id": sid, **({"open": True, "streaming": True} if first else {})},
            "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    headers = {"x-smg-routing-key": sid}
    for errors in range(5):
        if not stream:
            r = await c.post("/generate", headers=headers, json=body)
            if r.status_code < 500:
                assert r.status_code == 200, r.text
                meta = r.json()["meta_info"]
                return Answer(r.json()["output_ids"], meta["prompt_tokens"], meta["cached_tokens"], errors)
        else:
            async with c.stream("POST", "/generate", headers=headers, json=body) as r:
                if r.status_code < 500:
                    assert r.status_code == 200, await r.aread()
                    got, last = [], None
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            last = json.loads(line[6:])
                            got += last["output_ids"][len(got):]  # (each chunk carries the output so far)
                            if on_first_chunk is not None:
                                on_first_chunk()
                                on_first_chunk = None
                    meta = last["meta_info"]
                    assert meta["finish_reason"]["type"] == "length", meta
                    return Answer(got, meta["prompt_tokens"], meta["cached_tokens"], errors)
                await r.aread()
        await asyncio.sleep(1.5)
    pytest.fail(f"turn of {sid} failed 5 times: {r.status_code}")


async def _open(url: str, workers: list[Worker], turns: dict[str, list[int]]) -> tuple[dict, dict]:
    """First turns one at a time, to learn which worker holds each session (its open-sessions gauge grows)."""
    placed, answers = {}, {}
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        for sid, ids in turns.items():
            before = [_metric(w.url, "mambaserve_sessions_open") for w in workers]
            answers[sid] = [await _turn(c, sid, ids, first=True)]
            deadline = time.monotonic() + 10
            while (grew := [i for i, w in enumerate(workers)
                            if _metric(w.url, "mambaserve_sessions_open") > before[i]]) == []:
                assert time.monotonic() < deadline, f"{sid} is open on no worker"
                await asyncio.sleep(0.05)
            placed[sid] = grew[0]
    return placed, answers


async def _more(url: str, turns: dict[str, list[list[int]]]) -> dict[str, list[Answer]]:
    """The sessions' next turns, the sessions concurrently, each one turn after the other."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        async def one(sid, inputs):
            return [await _turn(c, sid, ids) for ids in inputs]
        got = await asyncio.gather(*(one(sid, inputs) for sid, inputs in turns.items()))
    return dict(zip(turns, got))


def _reference(url: str, inputs: dict[str, list[list[int]]], lengths=()) -> dict[str, list[list[int]]]:
    """The same conversations undisturbed, under other session ids: each turn's output (``lengths``: tokens per
    turn where not NEW)."""
    ref = {f"ref-{sid}": t for sid, t in inputs.items()}

    async def go():
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            async def one(sid, t):
                return [(await _turn(c, sid, ids, first=i == 0, n=dict(enumerate(lengths)).get(i, NEW))).ids
                        for i, ids in enumerate(t)]
            return await asyncio.gather(*(one(sid, t) for sid, t in ref.items()))
    return dict(zip(inputs, run(go())))


@pytest.mark.parametrize("family", ["mamba2", "nemotron_h"])
def test_a_killed_workers_sessions_continue_on_the_other_from_storage(family, request, tmp_path):
    model = BUNDLED if family == "mamba2" else request.getfixturevalue("nemotron")
    inputs = {f"s{k}": [_words(3 + (k + i) % 4, 10 * k + i) for i in range(6)] for k in range(4)}
    with _workers(model, tmp_path) as workers, sglang_router([w.url for w in workers], *ROUTER) as (url, _):
        ref = _reference(url, inputs)
        placed, got = run(_open(url, workers, {sid: t[0] for sid, t in inputs.items()}))
        for sid, answers in run(_more(url, {sid: t[1:3] for sid, t in inputs.items()})).items():
            got[sid] += answers
        victim = max((0, 1), key=lambda i: list(placed.values()).count(i))
        moved = sorted(sid for sid, i in placed.items() if i == victim)
        survivor = workers[1 - victim]
        before = _metric(survivor.url, 'mambaserve_session_restores_total{result="loaded"}')
        workers[victim].proc.send_signal(signal.SIGKILL)
        workers[victim].proc.wait()
        for sid, answers in run(_more(url, {sid: t[3:] for sid, t in inputs.items()})).items():
            got[sid] += answers
        loaded = _metric(survivor.url, 'mambaserve_session_restores_total{result="loaded"}') - before
        recomputed = _metric(survivor.url, 'mambaserve_session_restores_total{result="recomputed"}')
        log = survivor.text()
    # (min_group places a key on a worker with the fewest keys in flight, ties at random: first turns sent one at
    # a time may all land on one worker, which is then the one killed)
    assert moved
    for sid, t in inputs.items():
        assert [a.ids for a in got[sid]] == ref[sid], sid  # as if nothing had happened
        for i, a in enumerate(got[sid][1:], 1):  # every later turn prefilled its new tokens only
            assert a.cached_tokens == a.prompt_tokens - len(t[i]), (sid, i, a)
        assert sum(a.errors for a in got[sid]) == sum(a.errors for a in got[sid][3:4]) <= 1, sid
    # the moved sessions' states were read from storage, none recomputed
    assert loaded == len(moved) and recomputed == 0
    for sid in moved:
        assert f"session {sid} continued from its persisted turn" in log and "its state loaded" in log


def test_a_drained_worker_finishes_its_stream_and_its_sessions_continue_on_the_other(tmp_path):
    inputs = {f"s{k}": [_words(5, 10 * k), _words(4, 10 * k + 1), _words(3, 10 * k + 2)] for k in range(4)}
    long = 600  # tokens of the first session's second turn, streamed while its worker drains
    with _workers(BUNDLED, tmp_path, "--drain-timeout", "60") as workers, \
            sglang_router([w.url for w in workers], *ROUTER) as (url, _):
        placed, got = run(_open(url, workers, {sid: t[0] for sid, t in inputs.items()}))
        # two sessions on one worker (min_group breaks ties at random; of four sessions on two workers, one holds
        # two or more): the first streams while that worker drains, the second's next turn follows it
        first, other = next([a, b] for a in placed for b in placed if a < b and placed[a] == placed[b])
        victim = workers[placed[first]]
        seen = {}

        def drain():  # at the stream's first chunk: SIGTERM, then what a caller sees of the worker meanwhile
            victim.proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            seen["health"] = httpx.get(victim.url + "/health")
            seen["live"] = httpx.get(victim.url + "/health", params={"stuck_step_timeout": 300})
            seen["new"] = httpx.post(victim.url + "/generate", json={"input_ids": [5, 6], "sampling_params": {
                "max_new_tokens": 2}})

        async def during():
            async with httpx.AsyncClient(base_url=url, timeout=60) as c:
                stream = await _turn(c, first, inputs[first][1], n=long, stream=True, on_first_chunk=drain)
                running = victim.proc.poll() is None  # still draining until its stream ended
                # the other session on that worker, and the first one again: both on the other worker now
                rest = await asyncio.gather(_turn(c, other, inputs[other][1]), _turn(c, first, inputs[first][2]))
                return stream, running, rest

        stream, running_after_stream, (other_turn, first_next) = run(during())
        rc = victim.proc.wait(timeout=30)
        survivor = workers[1 - placed[first]]
        loaded = _metric(survivor.url, 'mambaserve_session_restores_total{result="loaded"}')
        ref = _reference(url, {first: inputs[first]}, lengths=(NEW, long))
        log = victim.text()
    assert len(stream.ids) == long and stream.errors == 0  # every token of the stream, nothing cut
    assert rc == 0  # exited by itself, once drained
    assert seen["health"].status_code == 503 and seen["health"].json()["error"]["code"] == "draining"
    assert seen["live"].status_code == 200  # liveness is not readiness: a draining server is not restarted
    assert seen["new"].status_code == 503 and seen["new"].headers["retry-after"] == "1"
    assert seen["new"].json()["error"]["code"] == "draining"
    assert other_turn.errors == 0 and first_next.errors == 0  # no turn failed
    assert first_next.cached_tokens == first_next.prompt_tokens - len(inputs[first][2]) > 0  # loaded, not recomputed
    assert other_turn.cached_tokens == other_turn.prompt_tokens - len(inputs[other][1])
    assert loaded == 2
    assert [got[first][0].ids, stream.ids, first_next.ids] == ref[first]
    assert running_after_stream
    assert "draining: 1 requests in flight" in log and "drained in" in log
