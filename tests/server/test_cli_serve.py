"""`mambaserve serve` as users start it: the port is bound before the model loads (503 `loading` until
ready), a taken port or a bad model fails in one line, and the banner appears only once serving."""

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from mambaserve.server.api.app import create_app
from mambaserve.server.api.loading import LoadingApp
from tests.server.conftest import free_port, make_engine, wait_healthy


def _serve(model, port, *flags):
    return subprocess.Popen([sys.executable, "-m", "mambaserve.server", "serve", "--model", str(model), "--port",
                             str(port), "--log-level", "warning", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_requests_get_503_loading_until_the_engine_is_ready(tiny_ckpt):
    go = threading.Event()
    engines = []

    def load():
        go.wait(30)
        engines.append(make_engine(tiny_ckpt))
        return engines[0], create_app(engines[0])

    app = LoadingApp(load)

    async def scenario():
        startup = asyncio.Queue()
        await startup.put({"type": "lifespan.startup"})
        sent = []
        lifespan = asyncio.ensure_future(app({"type": "lifespan"}, startup.get, lambda m: _append(sent, m)))
        while not sent:
            await asyncio.sleep(0.01)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            before = await c.get("/health")
            go.set()
            deadline = time.monotonic() + 30
            while app.app is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            after = await c.get("/health")
            head = await c.head("/health")
            gen = await c.post("/generate", json={"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 2}})
        await startup.put({"type": "lifespan.shutdown"})
        await lifespan
        return sent, before, after, head, gen

    sent, before, after, head, gen = asyncio.run(scenario())
    assert sent[0] == {"type": "lifespan.startup.complete"}  # startup does not wait for the load
    assert before.status_code == 503 and before.json()["error"]["code"] == "loading"
    assert before.headers["retry-after"] == "5"
    assert after.status_code == 200 and gen.status_code == 200
    assert head.status_code == 200 and head.content == b""  # load balancers' HEAD checks
    assert not engines[0].healthy  # shutdown stopped the engine


async def _append(sent, message):
    sent.append(message)


def test_port_is_bound_before_loading_and_the_server_serves(tiny_ckpt, tmp_path):
    port = free_port()
    proc = _serve(tiny_ckpt, port, "--kernel-cache-dir", str(tmp_path / "kernels"), "--log-level", "info")
    try:
        deadline, first = time.monotonic() + 60, None
        while time.monotonic() < deadline:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
            except httpx.TransportError:
                time.sleep(0.05)
                continue
            first = first or r
            if r.status_code == 200:
                break
            time.sleep(0.05)
        assert first is not None and (first.status_code == 200 or first.json()["error"]["code"] == "loading")
        assert r.status_code == 200
        # ready only after the warm-up's two generations, which leave no snapshot behind
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        assert 'mambaserve_requests_total{finish_reason="length"} 2.0' in metrics
        assert "mambaserve_state_slots_used 0.0" in metrics
        assert 'mambaserve_kernel_compiles_total{phase="serving"} 0.0' in metrics
        assert (tmp_path / "kernels").is_dir()  # Triton's compile cache, made before anything could compile
        gen = httpx.post(f"http://127.0.0.1:{port}/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 2}},
                         timeout=30)
        assert gen.status_code == 200
        # the freeze's own full collection ran before ready: not one of serving's pauses
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        assert 'mambaserve_gc_pause_seconds_count{generation="2"}' not in metrics
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=30)
    assert "mambaserve: serving '" in out  # the banner, once serving
    # the garbage collector walks only what serving allocates: what start-up left alive is frozen
    frozen = re.search(r"garbage collector: (\d+) objects frozen", err)
    assert frozen and int(frozen[1]) > 100_000, err[-2000:]


def test_a_taken_port_or_a_bad_model_fails_in_one_line_without_the_banner(tiny_ckpt, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = _serve(tiny_ckpt, port)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode != 0 and f"cannot listen on 127.0.0.1:{port}" in err and "Traceback" not in err
    assert "serving" not in out and "loading" not in out  # nothing was loaded

    proc = _serve(tmp_path / "missing", free_port())
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "does not exist" in err and "Traceback" not in err
    assert "serving" not in out


def test_the_cli_makes_openmp_workers_wait_passively_unless_the_user_chose(tmp_path):
    """Set before torch loads libgomp: a model loaded on a thread that exits otherwise leaves CPU serving
    12-25x slower (cli.openmp_defaults)."""
    code = ("import os, sys\nfrom mambaserve.server import cli\ntorch_first = 'torch' in sys.modules\n"
            "try:\n    cli.main(['serve', '--model', sys.argv[1], '--port', '99999'])\nexcept SystemExit:\n    pass\n"
            "print(os.environ.get('OMP_WAIT_POLICY'), torch_first)")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.split() == ["PASSIVE", "False"], out.stdout + out.stderr  # torch (libgomp) loads after it
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env={**env, "OMP_WAIT_POLICY": "ACTIVE"},
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.split()[0] == "ACTIVE", out.stdout + out.stderr


def test_the_warm_up_leaves_the_cache_empty_and_reports_a_failed_request(tiny_ckpt):
    """A warm-up answered with an error raises with the status and answer (the CLI then exits 2 with it)."""
    from mambaserve.server.api import warmup

    class Refusing:
        async def __call__(self, scope, receive, send):
            await send({"type": "http.response.start", "status": 500, "headers": []})
            await send({"type": "http.response.body", "body": b"broken"})

    engine = make_engine(tiny_ckpt)
    engine.start()
    try:
        with pytest.raises(RuntimeError, match=r"warm-up request failed \(500\): broken"):
            asyncio.run(warmup.warm_up(Refusing(), engine))
        # the real app: both generations run, the cache is empty afterwards
        asyncio.run(warmup.warm_up(create_app(engine), engine))
        acc = asyncio.run(engine.accounting())
    finally:
        engine.stop()
    assert acc["free"] == acc["capacity"] and acc["held_by_tree"] == 0, acc


@pytest.mark.parametrize("context_length", [2, 16, 19])
def test_the_warm_up_fits_a_short_context(tiny_ckpt, context_length):
    """A legal --context-length shorter than the warm-up's 16-token prompt + 4 tokens does not fail the start:
    the warm-up's requests fit the context (and the vocabulary) they are sent to."""
    from mambaserve.server.api import warmup

    engine = make_engine(tiny_ckpt, context_length=context_length)
    engine.start()
    try:
        asyncio.run(warmup.warm_up(create_app(engine), engine))
        acc = asyncio.run(engine.accounting())
    finally:
        engine.stop()
    assert acc["free"] == acc["capacity"] and acc["held_by_tree"] == 0, acc


def test_the_warm_up_prompt_fits_any_vocabulary_and_context():
    from mambaserve.server.api.warmup import warm_up_prompt

    assert warm_up_prompt(vocab_size=96, context_length=4096) == (list(range(1, 17)), 4)
    ids, new = warm_up_prompt(vocab_size=5, context_length=4096)
    assert len(ids) == 16 and max(ids) < 5 and new == 4
    assert warm_up_prompt(vocab_size=96, context_length=18) == (list(range(1, 15)), 4)
    assert warm_up_prompt(vocab_size=96, context_length=2) == ([1], 1)
    assert warm_up_prompt(vocab_size=1, context_length=1) is None  # nothing fits: no warm-up


@pytest.mark.parametrize("end", ["deadline", "second_signal"])
def test_a_drain_past_its_deadline_or_signalled_twice_exits_and_says_what_was_cut(tiny_ckpt, end):
    """SIGTERM drains (api/drain.py); a stream longer than --drain-timeout, or a second SIGTERM, ends it at once:
    the stream is cut, the log says so, the process exits 0 within seconds."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mambaserve.server", "serve", "--model", str(tiny_ckpt), "--port",
                             str(port), "--device", "cpu", "--drain-timeout", "1" if end == "deadline" else "60"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url)
        body = {"input_ids": [5, 6, 7], "stream": True,
                "sampling_params": {"max_new_tokens": 4000, "temperature": 0, "ignore_eos": True}}
        chunks, began = 0, None
        with httpx.stream("POST", url + "/generate", json=body, timeout=60) as r:
            with pytest.raises(httpx.RemoteProtocolError):  # the answer is cut: no final chunk, no [DONE]
                for line in r.iter_lines():
                    chunks += line.startswith("data: {")
                    assert line != "data: [DONE]"
                    if chunks == 1 and began is None:
                        began = time.monotonic()
                        proc.send_signal(signal.SIGTERM)
                        if end == "second_signal":
                            time.sleep(0.5)
                            proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=30)
        took = time.monotonic() - began
    finally:
        if proc.poll() is None:
            proc.kill()
        err = proc.communicate(timeout=30)[1]
    assert rc == 0 and chunks > 1 and took < 10, (rc, chunks, took, err[-2000:])
    assert "draining: 1 requests in flight" in err
    why = "the drain timeout (1 s) passed" if end == "deadline" else "a second signal"
    assert f"draining: {why}: exiting with 1 requests in flight" in err, err[-2000:]


def test_served_connections_send_small_writes_at_once():
    """Nagle's algorithm off (TCP_NODELAY) on every accepted connection: with it on, a stream's first chunk, written
    right after its headers, waited for the client's delayed ACK (40 ms more TTFT for one request in eight)."""
    import asyncio

    from mambaserve.server.api.connections import GuardedEventLoop
    from mambaserve.server.cli import listen

    async def main():
        sock = listen("127.0.0.1", 0)
        accepted = asyncio.get_running_loop().create_future()
        server = await asyncio.start_server(lambda r, w: accepted.set_result(w.get_extra_info("socket")), sock=sock)
        _, writer = await asyncio.open_connection(*sock.getsockname())
        nodelay = (await accepted).getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        writer.close()
        server.close()
        return nodelay

    loop = GuardedEventLoop()
    try:
        assert loop.run_until_complete(main()) != 0
    finally:
        loop.close()
