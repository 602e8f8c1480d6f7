"""The fused MoE experts at real shapes on a GPU, bf16: granite-4.0-h-tiny's SwiGLU experts (hidden 1536, 64 experts,
top-6, 512) at decode and prefill token counts (both align steps: a program per expert, three launches), relu2
experts with a width no tile divides (Nemotron-H style), and the op captured in a CUDA graph replaying new routings
(no host sync). Skipped without CUDA."""

import pytest
import torch

from mambaserve.kernels.moe import align_launch, moe_experts, moe_experts_ref
from tests.kernels.helpers import TOL, assert_close

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BF = torch.bfloat16


def _inputs(T, E, k, H, I, gated, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, device="cuda")  # noqa: E731
    x = r(T, H).to(BF)
    w1 = (r(E, 2 * I if gated else I, H) * H ** -0.5).to(BF)
    w2 = (r(E, H, I) * I ** -0.5).to(BF)
    logits, ids = r(T, E).topk(k, dim=-1)
    return x, ids, torch.softmax(logits, -1).to(BF), w1, w2


@pytest.mark.parametrize("T,align", [(1, None), (16, "per_expert"), (64, "per_expert"), (256, "split"),
                                     (1000, "split")])
def test_granite_tiny_shape(T, align):
    x, ids, wts, w1, w2 = _inputs(T, 64, 6, 1536, 512, True, seed=T)
    if align:
        assert align_launch(ids.numel(), 64)["kernel"] == align
    out = moe_experts(x, ids, wts, w1, w2, act="silu", gated=True)
    assert_close(out, moe_experts_ref(x, ids, wts, w1, w2, act="silu", gated=True), TOL[BF])


@pytest.mark.parametrize("T", [3, 200])
def test_relu2_uneven_width(T):
    x, ids, wts, w1, w2 = _inputs(T, 128, 6, 1024, 1856 // 2, False, seed=T + 1)
    out = moe_experts(x, ids, wts.float(), w1, w2, act="relu2", gated=False)
    assert_close(out, moe_experts_ref(x, ids, wts.float(), w1, w2, act="relu2", gated=False), TOL[BF])


def test_captured_in_a_cuda_graph():
    x, ids, wts, w1, w2 = _inputs(64, 64, 6, 1536, 512, True, seed=7)
    moe_experts(x, ids, wts, w1, w2)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_experts(x, ids, wts, w1, w2)
    for seed in (8, 9):  # new tokens and a new routing in the same buffers
        nx, nids, nwts, _, _ = _inputs(64, 64, 6, 1536, 512, True, seed=seed)
        x.copy_(nx), ids.copy_(nids), wts.copy_(nwts)
        graph.replay()
        assert_close(out, moe_experts_ref(x, ids, wts, w1, w2), TOL[BF])
