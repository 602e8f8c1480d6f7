"""Which implementation the launchers pick."""

import torch

from mambaserve.kernels import _dispatch
from mambaserve.kernels.state_ops import clear_slots


def test_cpu_tensors_run_the_reference_unless_forced(monkeypatch):
    monkeypatch.delenv("MAMBASERVE_KERNELS", raising=False)
    t = torch.zeros(1)
    assert not _dispatch.use_triton(t, None)
    assert not _dispatch.use_triton(t, False)


def test_env_forces_references(monkeypatch):
    monkeypatch.setenv("MAMBASERVE_KERNELS", "ref")
    t = torch.zeros(1, device="cuda") if torch.cuda.is_available() else torch.zeros(1)
    assert not _dispatch.use_triton(t, None)
    pool = torch.ones(2, 3, 4)
    clear_slots(pool, torch.tensor([1]))  # runs the reference: same result
    assert not pool[:, 1].any() and pool[:, 0].all()


def test_next_pow2():
    assert [_dispatch.next_pow2(n) for n in (1, 2, 3, 5, 64, 65)] == [1, 2, 4, 8, 64, 128]
