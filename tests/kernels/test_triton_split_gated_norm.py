"""The gated norm split over tensor-parallel ranks (``kernels.split_gated_norm``): the Triton kernels against
their references, and the ranks' parts, projected and summed, against the unsplit norm + projection."""

import pytest
import torch

from mambaserve.kernels.norm_linear import gated_rmsnorm_linear_ref
from mambaserve.kernels.split_gated_norm import (split_gated_norm, split_gated_norm_finish,
                                                 split_gated_norm_finish_ref, split_gated_norm_ref)
from tests.kernels.helpers import TOL, assert_close, gen, randn


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 3])
def test_kernels_match_their_references(dev, dtype, T):
    g = gen(T)
    D, H = 40, 24
    xz = randn(g, T, 2 * D + 3, dtype=dtype, dev=dev)  # x and z as strided views of one projection
    x, z = xz[:, :D], xz[:, D:2 * D]
    w = randn(g, D, dtype=dtype, dev=dev)
    sums, ref_sums = (torch.empty(T, 2, dtype=dtype, device=dev) for _ in range(2))
    out = split_gated_norm(x, z, w, 1e-5, 2 * D, 2, sums, force_triton=True)
    ref = split_gated_norm_ref(x, z, w, 1e-5, 2 * D, 2, ref_sums)
    assert_close(out, ref, TOL[dtype])
    assert_close(sums.float().sum(-1), ref_sums.float().sum(-1), TOL[dtype])
    projection, bias = randn(g, T, H, dtype=dtype, dev=dev), randn(g, H, dtype=dtype, dev=dev)
    assert_close(split_gated_norm_finish(projection, sums, bias, force_triton=True),
                 split_gated_norm_finish_ref(projection, sums, bias), TOL[dtype])


@pytest.mark.parametrize("ranks", [2, 4])
def test_the_ranks_parts_summed_are_the_unsplit_norm_and_projection(ranks):
    g = gen(ranks)
    T, D, H = 3, 48, 16
    x, z, w = torch.randn(T, D, generator=g), torch.randn(T, D, generator=g), torch.rand(D, generator=g) + 0.5
    W, b = torch.randn(H, D, generator=g), torch.randn(H, generator=g)
    want = gated_rmsnorm_linear_ref(x, z, w, 1e-5, D, W, b)
    k = D // ranks
    buf = torch.zeros(T * H + 2 * T)
    for r in range(ranks):  # what every rank adds to the all-reduce
        part = torch.empty(T * H + 2 * T)
        projection, sums = part[:T * H].view(T, H), part[T * H:].view(T, 2)
        c = slice(r * k, (r + 1) * k)
        torch.mm(split_gated_norm_ref(x[:, c], z[:, c], w[c], 1e-5, D, ranks, sums), W[:, c].t(), out=projection)
        buf += part
    got = split_gated_norm_finish_ref(buf[:T * H].view(T, H), buf[T * H:].view(T, 2), b)
    assert_close(got, want, 1e-5)
