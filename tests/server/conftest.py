"""Shared fixtures: tiny checkpoints, an engine behind the real FastAPI app, a real uvicorn server."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import uvicorn

from mambaserve.server.config import ServerConfig
from mambaserve.server.engine.engine import Engine
from mambaserve.server.engine.request import SamplingParams
from mambaserve.server.api.app import create_app
from tests.server.tiny_hybrids import make_hybrid_checkpoint
from tests.server.tiny_models import make_checkpoint

CHAT_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("tiny"), "h6_g1", chat_template=CHAT_TEMPLATE)


@pytest.fixture(scope="session")
def nemotron(tmp_path_factory):
    """A tiny random Nemotron-H (Mamba2, attention, MLP and MoE blocks), built once for the hybrid tests."""
    return make_hybrid_checkpoint(tmp_path_factory.mktemp("nemotron"), "nemotron_h")


def make_engine(path, **overrides) -> Engine:
    # on the CPU even where a GPU is: these tests compare exact values (the GPU's are test_gpu_engine.py's)
    kw = dict(model=str(path), served_model_name="tiny", debug_cache_invariants=True, chunked_prefill_size=16,
              mamba_cache_size=8, max_running_requests=6, context_length=256, device="cpu")
    kw.update(overrides)
    return Engine(ServerConfig(**kw))


@contextlib.asynccontextmanager
async def serving(engine: Engine):
    """The real app (lifespan included) behind an in-process ASGI transport."""
    app = create_app(engine)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     timeout=60) as client:
            yield client


def wait_healthy(proc, url: str, timeout: float = 60) -> None:
    """Until ``url``'s /health answers 200; fails with the server's stderr if ``proc`` ends or time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            err = proc.stderr.read()
            pytest.fail(f"the server did not become healthy: {(err.decode() if isinstance(err, bytes) else err)[-3000:]}")
        time.sleep(0.2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def uvicorn_server(engine: Engine):
    """A real HTTP server on loopback (needed where the transport matters: client disconnects)."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(engine), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)


async def accounting(engine: Engine) -> dict:
    """Wait until the scheduler is idle, run the invariant check on its thread, return the accounting."""
    deadline = time.monotonic() + 30
    while True:
        acc = await engine.run_in_scheduler(engine.scheduler.accounting)
        if acc["running"] == 0 and acc["waiting"] == 0 or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    await engine.run_in_scheduler(engine.scheduler.check_invariants)
    return acc


def run(coro):
    return asyncio.run(coro)


def run_started(engine: Engine, coro_fn):
    """``asyncio.run(coro_fn())`` with ``engine``'s scheduler running, stopped afterwards whatever happens."""
    engine.start()
    try:
        return asyncio.run(coro_fn())
    finally:
        engine.stop()


async def greedy(engine: Engine, prompt, n: int, **kw) -> tuple[list[int], list[float], int | None]:
    """``prompt`` generated greedily with logprobs: (token ids, their logprobs, cached prompt tokens)."""
    ids, lps, cached = [], [], None
    async for o in engine.generate(prompt, SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True),
                                   return_logprob=True, **kw):
        ids += o.token_ids
        lps += o.logprobs
        cached = o.cached_tokens
    return ids, lps, cached


def checked_accounting(engine: Engine) -> dict:
    """The invariant check on the running scheduler's thread, then its accounting."""
    engine.scheduler.call(engine.scheduler.check_invariants).result(timeout=10)
    return engine.scheduler.call(engine.scheduler.accounting).result(timeout=10)


def assert_idle(acc: dict) -> None:
    """No request holds a slot; every slot is free or a cached snapshot."""
    assert acc["running"] == 0 and acc["waiting"] == 0 and acc["held_by_requests"] == 0, acc
    assert acc["free"] + acc["held_by_tree"] == acc["capacity"], acc


@contextlib.contextmanager
def sglang_router(worker_urls: list[str], *flags: str):
    """The real sglang-router (the Rust gateway from PyPI) on a free port (its metrics on another), once every
    worker is registered and healthy; yields (its URL, its metrics URL)."""
    port, prom = free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
         "--worker-urls", *worker_urls, "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom),
         "--log-level", "warn", *flags],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 40
        while True:
            with contextlib.suppress(httpx.TransportError, ValueError):
                workers = httpx.get(url + "/workers", timeout=2).json()["workers"]
                if len(workers) == len(worker_urls) and all(w["is_healthy"] for w in workers):
                    break
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the router did not register every worker"
            time.sleep(0.2)
        yield url, f"http://127.0.0.1:{prom}/metrics"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
