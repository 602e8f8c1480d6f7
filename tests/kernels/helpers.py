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


def _probe_kernel(x_ptr, n, BLOCK: "tl.constexpr"):  # noqa: F821 - a kernel's source, never called
    pass


def triton_compile_hooks(key: str = "[('*fp32', 'D'), ('i32', 'D'), ('constexpr', 64)]{'num_warps': 4}"):
    """Triton's own code calling its before- and after-compile hooks for a compile of ``_probe_kernel`` with the
    arguments it passes in a real compile (``JITFunction._call_hook``: the hook names of Triton >= 3.4), on CPU:
    a real compile needs a GPU. Returns what the before-hook returned (True: skip the compile)."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import JITFunction

    import inspect

    fn = JITFunction(_probe_kernel)
    target = GPUTarget("cuda", 90, 32)
    options = CUDABackend(target).parse_options({"num_warps": 4, "enable_fp_fusion": True})
    signature = {"x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}
    # (Triton 3.9 passes the target too; 3.4-3.6 do not)
    with_target = "target" in inspect.signature(JITFunction._call_hook).parameters
    args = (key, signature, *([target] if with_target else []), 0, {("BLOCK",): 64}, options, [{}], False)
    skip = fn._call_hook(knobs.runtime.jit_cache_hook, *args)
    fn._call_hook(knobs.runtime.jit_post_compile_hook, *args)
    return skip
