"""Triton's compiles as events, and where their cache lives: what the server counts and logs, and keeps.

A jitted kernel compiles once per *specialization* in a process, the first time a launch meets it: per
value of each ``tl.constexpr`` and launch option, per argument dtype, and per integer argument equal to 1,
divisible by 16 or neither (pointers: 16-byte aligned or not), unless the kernel lists it in
``do_not_specialize``. A compile takes seconds (a fraction of that when an earlier process left it in the
on-disk cache), so one that happens while serving stalls every running request; the server compiles every
specialization a request can reach before it reports ready (``server/engine/warm_up.py``) and counts what
compiles after (``mambaserve_kernel_compiles_total{phase="serving"}``, which should stay 0).

``watch(listener)`` calls ``listener(Compile)`` after each compile in the process, from the compiling thread.
It hooks Triton's notifications, whichever this Triton has: ``triton.knobs.runtime.jit_cache_hook`` (before)
and ``jit_post_compile_hook`` (after) from Triton 3.4 on, ``JITFunction.cache_hook`` / ``compiled_hook``
before; hooks already installed (torch's, a profiler's) keep being called. Under the interpreter
(``TRITON_INTERPRET=1``) nothing compiles and nothing is reported.

``set_cache_dir(path)``: where Triton keeps compiled kernels (``TRITON_CACHE_DIR``), so a restarted server
(a pod with the directory on a volume) loads them instead of compiling again.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Compile:
    kernel: str  # the jitted function's name
    key: str  # Triton's specialization key: argument types and their 1 / divisible-by-16 marks, constexprs, options
    seconds: float | None  # from Triton's before-compile hook to its after-compile hook (None without the former)


Listener = Callable[[Compile], None]

_lock = threading.Lock()
_listeners: list[Listener] = []
_started: dict[str, float] = {}  # key -> when its compile began (Triton 3.9's async compiles end on another thread)
_hooks: str | None = None  # which hooks are installed ("knobs", "JITFunction"), None: not yet / none exist


def watch(listener: Listener) -> Callable[[], None]:
    """Call ``listener`` after every Triton compile in this process; returns the function that stops it."""
    with _lock:
        _install()
        _listeners.append(listener)

    def stop() -> None:
        with _lock:
            if listener in _listeners:
                _listeners.remove(listener)

    return stop


def hooks() -> str | None:
    """Which of Triton's notifications ``watch`` uses: ``"knobs"`` (Triton >= 3.4), ``"JITFunction"`` (older),
    or None (no Triton, or one with neither: compiles go uncounted)."""
    with _lock:
        _install()
        return _hooks


def set_cache_dir(path: str | os.PathLike) -> Path:
    """Triton's compiled kernels go to and come from ``path`` (created if missing), for every compile from now on
    in this process and the processes it starts. ValueError where it cannot be a writable directory."""
    p = Path(path).expanduser().resolve()
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--kernel-cache-dir {path}: cannot create it: {e.strerror}") from None
    if not os.access(p, os.W_OK | os.X_OK):
        raise ValueError(f"--kernel-cache-dir {path}: not a writable directory")
    os.environ["TRITON_CACHE_DIR"] = str(p)  # Triton before 3.4 reads it at each compile; so do child processes
    try:
        from triton import knobs
    except ImportError:  # no Triton, or one older than 3.4: the environment is what it reads
        return p
    knobs.cache.dir = str(p)  # 3.4+: a value set on the knob wins over the environment
    return p


def _install() -> None:
    """Chain our hooks in front of Triton's current ones, once (called under ``_lock``)."""
    global _hooks
    if _hooks is not None:
        return
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:  # pragma: no cover - no Triton: nothing compiles
        return
    try:
        from triton import knobs
        runtime = knobs.runtime
        if hasattr(runtime, "jit_post_compile_hook") and hasattr(runtime, "jit_cache_hook"):
            runtime.jit_cache_hook = _before(runtime.jit_cache_hook)
            runtime.jit_post_compile_hook = _after(runtime.jit_post_compile_hook)
            _hooks = "knobs"
            return
    except ImportError:
        pass
    if hasattr(JITFunction, "compiled_hook") and hasattr(JITFunction, "cache_hook"):  # Triton 3.2-3.3
        JITFunction.cache_hook = _before(JITFunction.cache_hook)
        JITFunction.compiled_hook = _after(JITFunction.compiled_hook)
        _hooks = "JITFunction"
    else:  # pragma: no cover - a Triton without either
        log.warning("this Triton (%s) has no compile hooks: kernel compiles are not counted",
                    getattr(__import__("triton"), "__version__", "?"))


def _before(previous):
    def hook(*, key, **kw):
        _started[str(key)] = time.perf_counter()
        # the before-compile hook may skip the compile by returning True: only the hook we replaced decides
        return previous(key=key, **kw) if previous is not None else None

    return hook


def _after(previous):
    def hook(*, key, fn, **kw):
        began = _started.pop(str(key), None)
        event = Compile(kernel=getattr(fn, "name", str(fn)), key=str(key),
                        seconds=None if began is None else time.perf_counter() - began)
        with _lock:
            listeners = list(_listeners)
        for listener in listeners:
            try:
                listener(event)
            except Exception:  # noqa: BLE001 - a listener's failure must not fail the launch that compiled
                log.exception("a kernel-compile listener failed")
        return previous(key=key, fn=fn, **kw) if previous is not None else None

    return hook
