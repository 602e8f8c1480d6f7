"""A hybrid model's MoE layers through the fused Triton experts (on CPU: the interpreter) against the same model on
the torch expert loop: Granite 4.0-H's SwiGLU experts and Nemotron-H's relu2 experts in a latent width, over a packed
prefill of two sequences, a decode step of both and one of one (a single token: no align step). Granite's decode
steps run its fused norm + router + top-k kernel too."""

import functools

import pytest
import torch

from mambaserve.kernels import moe
from mambaserve.kernels.topk_softmax import rmsnorm_topk_softmax
from mambaserve.server.engine.batch import ForwardBatch, ForwardMode
from mambaserve.server.engine.kv_pool import KVPool
from mambaserve.server.engine.model_runner import ModelRunner
from mambaserve.server.engine.state_pool import MambaStatePool
from mambaserve.server.model import feed_forward
from mambaserve.server.model.loader import load_model
from tests.server.tiny_hybrids import make_hybrid_checkpoint


class _Triton:
    moe_experts = functools.partial(moe.moe_experts, force_triton=True)


class _Calls:
    """The reference, counting its calls (so the test knows the MoE layers ran at all)."""

    n = 0

    @classmethod
    def moe_experts(cls, *a, **kw):
        cls.n += 1
        return moe.moe_experts_ref(*a, **kw)


def _steps(path, dev):
    model, _ = load_model(path, torch.float32, torch.device(dev))
    pool = MambaStatePool.for_model(model, 4, torch.float32, torch.float32, dev)
    kv = KVPool.for_model(model, 32, 4, torch.float32, dev)
    runner = ModelRunner(model, pool, torch.device(dev), kv)
    al = runner.kv_pool.allocator
    A, B = list(range(3, 22)), list(range(40, 47))
    al.ensure("a", 21), al.ensure("b", 8)
    return [runner.forward(b).logits for b in (
        ForwardBatch(ForwardMode.EXTEND, A + B, [19, 7], [0, 0], [1, 2], pages=[al.pages("a"), al.pages("b")]),
        ForwardBatch(ForwardMode.DECODE, [5, 6], [1, 1], [19, 7], [1, 2], pages=[al.pages("a"), al.pages("b")]),
        ForwardBatch(ForwardMode.DECODE, [8], [1], [20], [1], pages=[al.pages("a")]))]


@pytest.mark.parametrize("family", ["granite_moe", "nemotron_h"])
def test_model_moe_through_triton_matches_reference(dev, tmp_path, family, monkeypatch):
    path = make_hybrid_checkpoint(tmp_path / family, family, chunk_size=16)
    monkeypatch.setattr(feed_forward, "moe", _Calls)
    ref = _steps(path, dev)
    assert _Calls.n >= 2
    monkeypatch.setattr(feed_forward, "moe", _Triton)
    monkeypatch.setattr(feed_forward, "rmsnorm_topk_softmax",
                        functools.partial(rmsnorm_topk_softmax, force_triton=True))
    tri = _steps(path, dev)
    for r, t in zip(ref, tri):
        torch.testing.assert_close(t, r, atol=1e-4 if dev == "cpu" else 2e-3, rtol=0)
