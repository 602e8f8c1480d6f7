"""Hybrid models on a GPU: the Triton path (chunked scan, conv, fused decode, paged attention) against
transformers in fp32, packed prefill then batched decode with interleaved pages."""

import pytest
import torch

from mambaserve.server.engine.batch import ForwardBatch, ForwardMode
from mambaserve.server.engine.kv_pool import KVPool
from mambaserve.server.engine.model_runner import ModelRunner
from mambaserve.server.engine.state_pool import MambaStatePool
from mambaserve.server.model.loader import load_model
from tests.server.tiny_hybrids import FAMILIES, make_hybrid_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_triton_hybrid_forward_matches_transformers(tmp_path, family):
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda")
    path = make_hybrid_checkpoint(tmp_path / family, family, chunk_size=16)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(dev).eval()
    model, _ = load_model(path, torch.float32, dev)
    pool = MambaStatePool.for_model(model, 8, torch.float32, torch.float32, dev)
    kv = KVPool.for_model(model, 64, 4, torch.float32, dev)
    runner = ModelRunner(model, pool, dev, kv)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(1, 90, (n,), generator=g).tolist() for n in (5, 37, 18)]
    for i, p in enumerate(seqs):
        assert kv.allocator.ensure(i, len(p) + 6)
    pages = [kv.allocator.pages(i) for i in range(3)]
    logits = runner.forward(ForwardBatch(ForwardMode.EXTEND, sum(seqs, []), [len(p) for p in seqs], [0] * 3,
                                         [1, 2, 3], pages=pages)).logits
    for _ in range(5):
        with torch.no_grad():
            for row, p in zip(logits, seqs):
                ref = hf(torch.tensor([p], device=dev), position_ids=torch.arange(len(p), device=dev)[None],
                         use_cache=False).logits[0, -1]
                torch.testing.assert_close(row, ref, atol=2e-3, rtol=0)
        nxt = logits.argmax(-1).tolist()
        for p, t in zip(seqs, nxt):
            p.append(t)
        logits = runner.forward(ForwardBatch(ForwardMode.DECODE, nxt, [1] * 3, [len(p) - 1 for p in seqs], [1, 2, 3],
                                             pages=pages)).logits
