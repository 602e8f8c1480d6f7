"""Start a mambaserve server as a subprocess for a benchmark, and stop it afterwards."""

from __future__ import annotations

import collections
import contextlib
import os
import socket
import subprocess
import sys
import threading
import time

import httpx


def sharing_one_device(i: int) -> list[str]:
    """Flags for the i-th (0, 1) of two servers on one GPU. --mem-fraction-static caps the device's memory in use,
    whoever uses it (pool = F x total - in use - reserve): with the default 0.88 for both, the second found none
    left and refused to start (H200); so the first stops at 0.42 and the second at 0.84. A --mem-fraction-static
    given later on the command line wins."""
    return ["--mem-fraction-static", f"{0.42 * (i + 1):.2f}"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(url: str, proc: subprocess.Popen, timeout: float) -> bool:
    """Wait until the server at ``url`` answers /health with 200 (True), or its process ``proc`` has exited or
    ``timeout`` seconds have passed (False)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.2)


@contextlib.contextmanager
def launched(model: str, extra: list[str], timeout: float = 300, process: bool = False):
    """Yield the URL of a fresh server on loopback serving ``model`` with ``extra`` CLI flags (with
    ``process``: the URL and the server's Popen)."""
    port = free_port()
    cmd = [sys.executable, "-m", "mambaserve.server", "serve", "--model", model, "--port", str(port),
           "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    tail: collections.deque[str] = collections.deque(maxlen=5)

    def forward() -> None:  # the server's log still reaches the terminal; its last lines explain a refusal
        for line in proc.stderr:
            sys.stderr.write(line)
            tail.append(line.rstrip())

    reader = threading.Thread(target=forward, daemon=True)
    reader.start()
    url = f"http://127.0.0.1:{port}"
    try:
        if not healthy(url, proc, timeout):
            reader.join(timeout=2)
            raise RuntimeError(f"server did not start: {' '.join(cmd)}: " + " / ".join(tail))
        yield (url, proc) if process else url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def kernel_compiles(url: str) -> dict[str, int]:
    """The server's Triton compiles so far by phase (``warmup``: before it reported ready; ``serving``: after, each
    one a stall of the requests running; should stay 0)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        if fam.name == "mambaserve_kernel_compiles":
            out.update({s.labels["phase"]: int(s.value) for s in fam.samples if s.name.endswith("_total")})
    return out


def gc_pauses(url: str) -> dict[str, dict]:
    """The server's garbage collections since ready, by generation: how many, their seconds in all, and the bucket
    bound of the longest (``mambaserve_gc_pause_seconds``; each one stopped every thread of the server)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict] = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        if fam.name != "mambaserve_gc_pause_seconds":
            continue
        for s in fam.samples:
            g = out.setdefault(s.labels["generation"], {"count": 0, "seconds": 0.0, "longest_le": 0.0})
            if s.name.endswith("_count"):
                g["count"] = int(s.value)
            elif s.name.endswith("_sum"):
                g["seconds"] = s.value
        for s in fam.samples:  # the smallest bound that holds every collection
            g = out[s.labels["generation"]]
            if s.name.endswith("_bucket") and g["count"] and s.value == g["count"] and not g["longest_le"]:
                g["longest_le"] = float(s.labels["le"])
    return out


def metric(url: str, name: str) -> float:
    """The sum of the samples of the server's /metrics whose line starts with ``name`` (a name, or a name and
    its labels); 0 when the server does not answer (a worker killed)."""
    try:
        text = httpx.get(url + "/metrics", timeout=5).text
    except httpx.TransportError:
        return 0.0
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))
