"""A kernel compiled after the server reported ready is counted (`mambaserve_kernel_compiles_total{phase=
"serving"}`) and logged as a WARNING naming the kernel and its specialization; compiles before ready count as
the warm-up's. The compile events are Triton's own hook calls (a real compile needs a GPU)."""

import logging

import pytest

from tests.server.conftest import make_engine

pytest.importorskip("triton")

from tests.kernels.helpers import triton_compile_hooks  # noqa: E402


def _compiles(engine, phase: str) -> float:
    return engine.metrics.registry.get_sample_value("mambaserve_kernel_compiles_total", {"phase": phase})


def test_compiles_before_ready_count_as_warm_up_and_after_it_as_serving_with_a_warning(tiny_ckpt, caplog):
    engine = make_engine(tiny_ckpt)
    try:
        assert (_compiles(engine, "warmup"), _compiles(engine, "serving")) == (0, 0)  # exported from the start
        triton_compile_hooks("spec-before-ready")
        with caplog.at_level(logging.INFO, logger="mambaserve.server.engine.engine"):
            engine.mark_ready()
            assert "ready in" in caplog.text and "1 kernel compiles before ready" in caplog.text
            caplog.clear()
            triton_compile_hooks("spec-after-ready")
        assert (_compiles(engine, "warmup"), _compiles(engine, "serving")) == (1, 1)
        warning = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warning) == 1 and "_probe_kernel" in warning[0].message
        assert "spec-after-ready" in warning[0].message
    finally:
        engine.stop()
    triton_compile_hooks("spec-after-stop")  # a stopped engine no longer listens
    assert _compiles(engine, "serving") == 1
