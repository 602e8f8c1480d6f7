"""A hybrid model's attention layers through the Triton paged-attention kernels (on CPU: the interpreter)
against the same model on the kernels' references: packed prefill with interleaved pages, a chunk
resumed over its cached prefix, and a decode batch with a padding row."""

import functools

import pytest
import torch

from mambaserve.kernels import paged_attention as pa
from mambaserve.server.engine.batch import ForwardBatch, ForwardMode
from mambaserve.server.engine.kv_pool import KVPool
from mambaserve.server.engine.model_runner import ModelRunner
from mambaserve.server.engine.state_pool import MambaStatePool
from mambaserve.server.model import attention
from mambaserve.server.model.loader import load_model
from tests.server.tiny_hybrids import make_hybrid_checkpoint


class _Triton:
    write_kv = functools.partial(pa.write_kv, force_triton=True)
    paged_prefill_attention = functools.partial(pa.paged_prefill_attention, force_triton=True)
    paged_decode_attention = functools.partial(pa.paged_decode_attention, force_triton=True)


def _steps(path, dev):
    model, _ = load_model(path, torch.float32, torch.device(dev))
    pool = MambaStatePool.for_model(model, 4, torch.float32, torch.float32, dev)
    runner = ModelRunner(model, pool, torch.device(dev),
                         KVPool.for_model(model, 32, 4, torch.float32, dev))
    al = runner.kv_pool.allocator
    A, B = list(range(3, 22)), list(range(40, 47))
    al.ensure("b", 4), al.ensure("a", 25), al.ensure("b", 13)  # interleaved pages
    return [runner.forward(b).logits for b in (
        ForwardBatch(ForwardMode.EXTEND, A[:6] + B, [6, 7], [0, 0], [1, 2], pages=[al.pages("a"), al.pages("b")]),
        ForwardBatch(ForwardMode.EXTEND, A[6:], [13], [6], [1], pages=[al.pages("a")]),
        ForwardBatch(ForwardMode.DECODE, [5, 0, 6], [1, 1, 1], [19, 0, 7], [1, -1, 2],
                     pages=[al.pages("a"), [], al.pages("b")]))]


@pytest.mark.parametrize("family", ["granite_dense_rope", "nemotron_h"])
def test_model_attention_through_triton_matches_references(dev, tmp_path, family, monkeypatch):
    path = make_hybrid_checkpoint(tmp_path / family, family, chunk_size=16)
    monkeypatch.setattr(attention, "pa", pa)
    ref = _steps(path, dev) if dev == "cpu" else None
    monkeypatch.setattr(attention, "pa", _Triton)
    tri = _steps(path, dev)
    if ref is None:  # on a GPU every kernel runs Triton already: compare with the references forced
        monkeypatch.setattr(attention, "pa", pa)
        monkeypatch.setenv("MAMBASERVE_KERNELS", "ref")
        ref = _steps(path, dev)
    for r, t in zip(ref, tri):  # (row 1 of the decode step is the padding row)
        torch.testing.assert_close(t[[0, -1]], r[[0, -1]], atol=1e-4 if dev == "cpu" else 2e-3, rtol=0)
