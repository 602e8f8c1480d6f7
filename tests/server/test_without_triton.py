"""Triton is an optional extra (CPU torch wheels do not bring it): without it every module imports and
`mambaserve serve` answers on the bundled model through the torch references."""

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.server.conftest import free_port

MODEL = Path(__file__).resolve().parents[2] / "models" / "mamba2-tiny-pystdlib"
BLOCK_TRITON = """
import sys
class _NoTriton:
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError("triton is not installed here (blocked by the test)")
sys.meta_path.insert(0, _NoTriton())
"""


def _env(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(BLOCK_TRITON)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}


def test_every_module_imports_and_the_server_serves_without_triton(tmp_path):
    env = _env(tmp_path)
    check = ("import importlib, pkgutil, mambaserve.kernels, mambaserve.server\n"
             "from mambaserve.kernels._dispatch import HAS_TRITON\n"
             "assert not HAS_TRITON\n"
             "for pkg in (mambaserve.kernels, mambaserve.server):\n"
             "    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
             "        if not m.name.endswith('__main__'):\n"
             "            importlib.import_module(m.name)\n")
    r = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mambaserve.server", "serve", "--model", str(MODEL), "--port",
                             str(port), "--device", "cpu", "--log-level", "warning"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read()[-2000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not become ready"
            time.sleep(0.2)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json={"prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] > 0
    finally:
        proc.terminate()
        proc.wait(timeout=30)
