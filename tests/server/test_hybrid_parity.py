"""Hybrid models (Nemotron-H, Granite 4.0-H dense and MoE, Bamba) against transformers, fp32, <= 1e-4:
packed prefill, chunked prefill (the second chunk reads the first's KV pages and Mamba state) and
step-by-step batched decode, with KV page sizes 1, 4 and 16. The oracle runs full forwards with
explicit position_ids; the pages are handed out interleaved, so a block table read wrong shows."""

import dataclasses
import weakref

import pytest
import torch

from mambaserve.server.cache.pages import PageAllocator
from mambaserve.server.engine.batch import ForwardBatch, ForwardMode
from mambaserve.server.engine.kv_pool import KVPool
from mambaserve.server.engine.model_runner import ModelRunner
from mambaserve.server.engine.state_pool import MambaStatePool
from mambaserve.server.model import feed_forward
from mambaserve.server.model.loader import load_model
from tests.server.tiny_hybrids import FAMILIES, make_hybrid_checkpoint
from tests.server.tiny_models import VOCAB

ATOL = 1e-4
PAGE_SIZES = [1, 4, 16]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def ckpt(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = make_hybrid_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _runner(path, page_size, slots=6, pages=96):
    model, _ = load_model(path, torch.float32, torch.device("cpu"))
    pool = MambaStatePool.for_model(model, slots, torch.float32, torch.float32, "cpu")
    kv = KVPool.for_model(model, pages, page_size, torch.float32, "cpu")
    return ModelRunner(model, pool, torch.device("cpu"), kv)


# Per oracle model, not per id(): a family's model freed, the next one's may get its address.
_ORACLE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _hf(hf, ids):
    """The oracle's logits for every position of ``ids`` (remembered: page sizes share sequences)."""
    known = _ORACLE.setdefault(hf, {})
    if tuple(ids) not in known:
        with torch.no_grad():
            known[tuple(ids)] = hf(torch.tensor([ids]), position_ids=torch.arange(len(ids))[None],
                                   use_cache=False).logits[0]
    return known[tuple(ids)]


def _prompt(n, seed):
    return torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _grow(alloc: PageAllocator, owners_tokens: dict) -> None:
    """Pages for each owner's tokens, handed out one page per owner in turn (interleaved)."""
    done = False
    n = 0
    while not done:
        n += alloc.page_size
        done = True
        for owner, tokens in owners_tokens.items():
            assert alloc.ensure(owner, min(n, tokens))
            done &= n >= tokens


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_packed_prefill_matches_transformers(ckpt, page_size):
    path, hf = ckpt
    runner = _runner(path, page_size)
    alloc = runner.kv_pool.allocator
    prompts = [_prompt(n, seed) for seed, n in enumerate([1, 9, 21])]  # cross chunks and pages
    _grow(alloc, {i: len(p) for i, p in enumerate(prompts)})
    logits = runner.forward(ForwardBatch(ForwardMode.EXTEND, sum(prompts, []), [len(p) for p in prompts], [0] * 3,
                                         [1, 2, 3], all_logits=True, pages=[alloc.pages(i) for i in range(3)])).logits
    off = 0
    for p in prompts:
        torch.testing.assert_close(logits[off:off + len(p)], _hf(hf, p), atol=ATOL, rtol=0)
        off += len(p)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_chunked_prefill_then_decode_match_transformers(ckpt, page_size):
    """Two prompts prefilled in two chunks each (packed together, cut mid-page and mid-scan-chunk), then
    greedy decode batched with a padding row, each step checked against a full forward."""
    path, hf = ckpt
    runner = _runner(path, page_size)
    alloc = runner.kv_pool.allocator
    a, b = _prompt(19, 10), _prompt(13, 11)
    cuts = {"a": [0, 6, 19], "b": [0, 11, 13]}
    for step in range(2):
        sa, ea, sb, eb = cuts["a"][step], cuts["a"][step + 1], cuts["b"][step], cuts["b"][step + 1]
        _grow(alloc, {"a": ea, "b": eb})
        out = runner.forward(ForwardBatch(ForwardMode.EXTEND, a[sa:ea] + b[sb:eb], [ea - sa, eb - sb], [sa, sb], [3, 5],
                                          pages=[alloc.pages("a"), alloc.pages("b")])).logits
    torch.testing.assert_close(out[0], _hf(hf, a)[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[1], _hf(hf, b)[-1], atol=ATOL, rtol=0)
    for _ in range(5):
        nxt = out.argmax(-1).tolist()
        a.append(nxt[0])
        b.append(nxt[1])
        _grow(alloc, {"a": len(a), "b": len(b)})
        out = runner.forward(ForwardBatch(ForwardMode.DECODE, [nxt[0], 0, nxt[1]], [1, 1, 1],
                                          [len(a) - 1, 0, len(b) - 1], [3, -1, 5],
                                          pages=[alloc.pages("a"), [], alloc.pages("b")])).logits
        assert torch.equal(out[1], out[1])  # the padding row ran and touched nothing (checked by the next rows)
        out = out[[0, 2]]
        torch.testing.assert_close(out[0], _hf(hf, a)[-1], atol=ATOL, rtol=0)
        torch.testing.assert_close(out[1], _hf(hf, b)[-1], atol=ATOL, rtol=0)
    alloc.check()


def test_chunked_and_whole_prefill_agree_on_state_and_pages(ckpt):
    """The same prompt prefilled whole and in three chunks ends with the same logits, Mamba states and KV."""
    path, _ = ckpt
    runner = _runner(path, 4)
    alloc, kv = runner.kv_pool.allocator, runner.kv_pool
    p = _prompt(23, 3)
    alloc.ensure("whole", len(p))
    whole = runner.forward(ForwardBatch(ForwardMode.EXTEND, p, [len(p)], [0], [1], pages=[alloc.pages("whole")]))
    for s, e in [(0, 5), (5, 12), (12, 23)]:
        alloc.ensure("parts", e)
        part = runner.forward(ForwardBatch(ForwardMode.EXTEND, p[s:e], [e - s], [s], [2], pages=[alloc.pages("parts")]))
    # fp32 GEMMs of 23 rows and of 5, 7, 11 rows sum in different orders (the CPU BLAS blocks by shape): ~1e-5 apart
    torch.testing.assert_close(part.logits, whole.logits, atol=2e-5, rtol=0)
    torch.testing.assert_close(runner.pool.ssm[:, 2], runner.pool.ssm[:, 1], atol=1e-5, rtol=0)
    ps = kv.page_size
    for k in (kv.k, kv.v):
        mine = k[:, alloc.pages("whole")].reshape(k.shape[0], -1, *k.shape[3:])[:, :len(p)]
        theirs = k[:, alloc.pages("parts")].reshape(k.shape[0], -1, *k.shape[3:])[:, :len(p)]
        assert ps * len(alloc.pages("parts")) >= len(p)
        torch.testing.assert_close(theirs, mine, atol=2e-5, rtol=0)


def test_granite_decode_folded_and_unfolded_agree(tmp_path, monkeypatch):
    """Granite's decode runs its shared MLP folded into the MoE op (``GraniteMoE.fold``); ``fold_shared_mlp=False``
    runs it in its own GEMMs, as prefill does: the same logits either way, and the switch picks the path."""
    runner = _runner(make_hybrid_checkpoint(tmp_path / "g", "granite_moe"), 4)
    model, alloc = runner.model, runner.kv_pool.allocator
    prompts = {"a": _prompt(11, 20), "b": _prompt(6, 21)}
    _grow(alloc, {k: len(p) + 1 for k, p in prompts.items()})
    runner.forward(ForwardBatch(ForwardMode.EXTEND, sum(prompts.values(), []), [11, 6], [0, 0], [1, 2],
                                pages=[alloc.pages("a"), alloc.pages("b")]))
    folded = []
    real = feed_forward.GraniteMoE.forward_folded

    def counted(self, *a, **kw):
        folded.append(1)
        return real(self, *a, **kw)

    monkeypatch.setattr(feed_forward.GraniteMoE, "forward_folded", counted)
    outs, states = [], (runner.pool.conv.clone(), runner.pool.ssm.clone())
    for fold in (True, False):
        model.use_kernel_config(dataclasses.replace(model.kernel_config, fold_shared_mlp=fold))
        runner.pool.conv.copy_(states[0])  # the same decode step twice, from the same states (its KV writes repeat)
        runner.pool.ssm.copy_(states[1])
        before = len(folded)
        outs.append(runner.forward(ForwardBatch(ForwardMode.DECODE, [5, 7], [1, 1], [11, 6], [1, 2],
                                                pages=[alloc.pages("a"), alloc.pages("b")])).logits)
        assert (len(folded) > before) == fold
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=0)
