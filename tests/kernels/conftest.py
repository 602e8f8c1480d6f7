"""Kernel tests run the Triton kernels on CPU through the Triton interpreter when there is no GPU.

``TRITON_INTERPRET`` is read when a kernel is decorated, so it must be set before ``mambaserve.kernels``
(and ``triton``) are first imported; pytest loads this file before the test modules of this folder.
On a CUDA machine the same tests run the compiled kernels on the GPU instead.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def dev() -> str:
    """Device the Triton tests put their tensors on; skips them where Triton cannot run."""
    if torch.cuda.is_available():
        return "cuda"
    pytest.importorskip("triton")
    from mambaserve.kernels import ssd_scan

    if type(ssd_scan._ssd_prep_kernel).__name__ != "InterpretedFunction":
        pytest.skip("mambaserve.kernels was imported before TRITON_INTERPRET=1 was set")
    return "cpu"
