"""Shared by the kernel benchmarks: ``mambaserve.kernels`` importable from a bare checkout, the
CUDA-graph timing of short kernels (launch overhead left out), the device's copy bandwidth."""

from __future__ import annotations

import os
import sys
import tempfile


def import_kernels_from_checkout() -> None:
    """Map the repository's ``kernels/`` to ``mambaserve.kernels`` when the package is not installed
    (a checkout without ``pip install -e .``)."""
    try:
        import mambaserve.kernels  # noqa: F401
    except ImportError:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        shim = tempfile.mkdtemp()
        os.makedirs(os.path.join(shim, "mambaserve"))
        open(os.path.join(shim, "mambaserve", "__init__.py"), "w").close()
        os.symlink(os.path.join(root, "kernels"), os.path.join(shim, "mambaserve", "kernels"))
        sys.path.insert(0, shim)


def graph_time(fn, n: int = 20, rep_ms: int = 200, warmup_ms: int = 25) -> float:
    """Median seconds per call of ``fn`` replayed from a CUDA graph of ``n`` calls."""
    import torch
    from triton.testing import do_bench

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            fn()
    t = do_bench(g.replay, warmup=warmup_ms, rep=rep_ms, return_mode="median") * 1e-3 / n
    del g
    return t


def copy_bandwidth() -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read + write; ``do_bench``'s median)."""
    import torch
    from triton.testing import do_bench

    a = torch.empty(1024**3 // 4, dtype=torch.float32, device="cuda")
    b = torch.empty_like(a)
    return 2 * a.numel() * 4 / (do_bench(lambda: b.copy_(a), warmup=5, rep=100, return_mode="median") * 1e-3)
