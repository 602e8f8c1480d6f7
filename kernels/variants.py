"""Which Triton specializations a piece of code launches, found on the host without a GPU and without running
a kernel: ``dry_run(target)``.

Inside it, every launcher chooses its variant as it would on ``target`` (``_dispatch.Target``: GPU tiles, SM
count, TMA, programmatic dependent launch) and every jitted kernel of ``mambaserve.kernels``, instead of
running, adds its launch's ``Variant`` to the set ``dry_run`` yields: the kernel's name and the key Triton's own
binder computes at that launch for an sm_90 target (each argument's type and its == 1 / divisible-by-16 /
aligned marks, unless the kernel lists it in ``do_not_specialize``; constexpr values; launch options), the key
a compile is cached under and ``kernels.compiles`` reports. With a model's weights and pools on the ``meta``
device, a forward at a real model's shapes runs on a CPU in milliseconds: ``tests/server/test_warm_up_coverage.py``
checks with it that the start-up warm-up compiles every specialization requests reach. Tensors' contents are
never read (outputs are left as allocated); what the launchers read on the host (lengths for boundary states)
must be host-readable, as the model runner's index tensors are off CUDA.
"""

from __future__ import annotations

import contextlib
import importlib
import pkgutil
from dataclasses import dataclass
from typing import Iterator

from mambaserve.kernels import _dispatch
from mambaserve.kernels._dispatch import H100, Target


@dataclass(frozen=True, order=True)
class Variant:
    kernel: str
    key: str  # Triton's cache key of the launch: specialization and options (as in its compile hooks)

    def __str__(self) -> str:
        return f"{self.kernel} {self.key}"


@contextlib.contextmanager
def dry_run(tg: Target = H100) -> Iterator[set[Variant]]:
    """Launch nothing, choose as on ``tg``, and collect the variants launched (module docstring)."""
    seen: set[Variant] = set()
    kernels = _jitted()
    for k in kernels:
        k.run = _recorder(k, seen)  # an instance attribute: ``kernel[grid](...)`` calls self.run
    _dispatch._emulated.append(tg)
    try:
        yield seen
    finally:
        _dispatch._emulated.pop()
        for k in kernels:
            del k.run


def _jitted() -> list:
    """Every jitted function of the ``mambaserve.kernels`` modules (compiled or interpreted: which one depends on
    ``TRITON_INTERPRET`` when they were decorated)."""
    import mambaserve.kernels as package
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    found = {}
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for value in vars(module).values():
            if isinstance(value, (JITFunction, InterpretedFunction)):
                found[id(value)] = value
    return list(found.values())


def _recorder(kernel, seen: set[Variant]):
    binder = _binder(kernel)
    name = kernel.fn.__name__

    def run(*args, grid, warmup, **kwargs):
        _, specialization, options = binder(*args, **kwargs)
        seen.add(Variant(name, _cache_key(specialization, options)))

    return run


def _binder(kernel):
    """Triton's launch-time binder of ``kernel`` for an sm_90 CUDA target: ``(args, specialization, options)``."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    jf = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn, **kernel.kwargs)
    return create_function_from_signature(jf.signature, jf.params, CUDABackend(GPUTarget("cuda", 90, 32)))


def _cache_key(specialization, options) -> str:
    try:
        from triton.runtime.jit import compute_cache_key
    except ImportError:  # pragma: no cover - a Triton that names it otherwise
        return str(specialization) + str(options)
    return compute_cache_key({}, specialization, options)
