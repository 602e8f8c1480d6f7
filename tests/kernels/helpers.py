"""Shared input builders and comparisons for the Triton kernel tests."""

from __future__ import annotations

import torch


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(g, *shape, dtype=torch.float32, dev="cpu", scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(dev)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def assert_close(a, b, tol):
    """Relative-norm check (METHOD.md) plus finiteness; ``tol`` per dtype, chosen by the caller."""
    assert torch.isfinite(a).all(), "non-finite values"
    err = rel_err(a, b)
    assert err <= tol, f"relative error {err:.3g} > {tol:.3g}"


TOL = {torch.float32: 2e-5, torch.bfloat16: 1.5e-2, torch.float16: 3e-3}
