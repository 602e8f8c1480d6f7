"""kernels.variants.dry_run: the Triton specializations launches reach, as Triton's binder computes them for an
sm_90 target, without a GPU and without running anything; launchers choose as on the emulated GPU."""

import pytest
import torch

pytest.importorskip("triton")

from mambaserve import kernels  # noqa: E402
from mambaserve.kernels import _dispatch  # noqa: E402
from mambaserve.kernels.variants import dry_run  # noqa: E402


def test_launches_are_recorded_by_specialization_not_run():
    w = torch.ones(64, device="meta")
    with dry_run() as seen:
        kernels.rmsnorm(torch.empty(5, 64, device="meta"), None, w, 1e-5)
        kernels.rmsnorm(torch.empty(40, 64, device="meta"), None, w, 1e-5)  # rows are the grid: the same variant
    assert [v.kernel for v in seen] == ["_rmsnorm_kernel"]
    with dry_run() as misaligned:  # a view 4 bytes into its storage: Triton's pointer specialization differs
        kernels.rmsnorm(torch.empty(5, 65, device="meta")[:, 1:], None, w, 1e-5)
    assert len(misaligned) == 1 and misaligned != seen
    pool = torch.ones(2, 4, 8)
    with dry_run() as cleared:
        kernels.clear_slots(pool, torch.tensor([1, 3]))  # a real tensor: recorded, not run
    assert [v.kernel for v in cleared] == ["_clear_slots_kernel"] and bool((pool == 1).all())
    assert not _dispatch._emulated  # the emulation ends with the block


def test_batch_counts_do_not_make_variants_but_the_tile_classes_do():
    """The conv's sequence count is not specialised: 1, 16 and 17 sequences launch one variant; 33 sequences need
    the wider per-sequence vector (another)."""
    D, K = 64, 4
    w = torch.ones(D, K, device="meta")
    state = torch.empty(8, D, K - 1, device="meta")
    seen = []
    for S in (1, 16, 17, 33):
        with dry_run() as v:
            kernels.causal_conv1d_varlen(torch.empty(S, D, device="meta"), w, None, state,
                                         torch.arange(S + 1, dtype=torch.int32), torch.zeros(S, dtype=torch.long),
                                         torch.zeros(S, dtype=torch.bool))
        seen.append({x for x in v if x.kernel == "_causal_conv1d_varlen_kernel"})
    assert seen[0] == seen[1] == seen[2] != seen[3]
