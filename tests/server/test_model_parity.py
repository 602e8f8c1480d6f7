"""Our Mamba2 forward against transformers' Mamba2ForCausalLM on real checkpoints (fp32, ≤ 1e-4)."""

import pytest
import torch

from mambaserve.server.engine import warm_up
from mambaserve.server.engine.batch import ForwardBatch, ForwardMode
from mambaserve.server.model.loader import load_model
from mambaserve.server.engine.model_runner import ModelRunner
from mambaserve.server.engine.state_pool import MambaStatePool
from tests.server.tiny_models import SHAPES, VOCAB, make_checkpoint

ATOL = 1e-4


def _runner(path, slots=8):
    model, _ = load_model(path, torch.float32, torch.device("cpu"))
    pool = MambaStatePool.for_model(model, slots, torch.float32, torch.float32, "cpu")
    return ModelRunner(model, pool, torch.device("cpu"))


def _hf_logits(path, ids):
    from transformers import Mamba2ForCausalLM

    hf = Mamba2ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids]), use_cache=False).logits[0]


def _prompt(n, seed):
    return torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=sorted(SHAPES))
def ckpt(request, tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


def test_prefill_logits_match_transformers(ckpt):
    runner = _runner(ckpt)
    prompts = [_prompt(n, seed) for seed, n in enumerate([1, 7, 19, 33])]  # odd lengths, cross chunk boundaries
    batch = ForwardBatch(ForwardMode.EXTEND, sum(prompts, []), [len(p) for p in prompts], [0] * 4, [1, 2, 3, 4],
                         all_logits=True)
    logits = runner.forward(batch).logits
    off = 0
    for p in prompts:
        torch.testing.assert_close(logits[off:off + len(p)], _hf_logits(ckpt, p), atol=ATOL, rtol=0)
        off += len(p)


def test_mixed_chunks_then_decode_match_transformers(ckpt):
    """Chunks of different requests packed together, resumed from their slots, then batched decode."""
    runner = _runner(ckpt)
    a, b = _prompt(23, 10), _prompt(17, 11)
    cuts_a, cuts_b = [0, 5, 14, 23], [0, 9, 10, 17]
    for step in range(3):
        sa, ea, sb, eb = cuts_a[step], cuts_a[step + 1], cuts_b[step], cuts_b[step + 1]
        out = runner.forward(ForwardBatch(ForwardMode.EXTEND, a[sa:ea] + b[sb:eb], [ea - sa, eb - sb], [sa, sb],
                                          [3, 5])).logits
    ref_a, ref_b = _hf_logits(ckpt, a), _hf_logits(ckpt, b)
    torch.testing.assert_close(out[0], ref_a[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[1], ref_b[-1], atol=ATOL, rtol=0)
    # greedy decode, batched with a padding row; compare each step with a full forward of the sequence
    for _ in range(6):
        nxt = out.argmax(-1).tolist()
        a.append(nxt[0])
        b.append(nxt[1])
        out = runner.forward(ForwardBatch(ForwardMode.DECODE, [nxt[0], 0, nxt[1]], [1, 1, 1],
                                          [len(a) - 1, 0, len(b) - 1], [3, 0, 5])).logits
        out = out[[0, 2]]
        torch.testing.assert_close(out[0], _hf_logits(ckpt, a)[-1], atol=ATOL, rtol=0)
        torch.testing.assert_close(out[1], _hf_logits(ckpt, b)[-1], atol=ATOL, rtol=0)


def test_chunked_and_unchunked_prefill_agree(ckpt):
    runner = _runner(ckpt)
    p = _prompt(29, 3)
    whole = runner.forward(ForwardBatch(ForwardMode.EXTEND, p, [len(p)], [0], [1])).logits[0]
    for s, e in [(0, 4), (4, 11), (11, 29)]:
        part = runner.forward(ForwardBatch(ForwardMode.EXTEND, p[s:e], [e - s], [s], [2])).logits[0]
    torch.testing.assert_close(part, whole, atol=1e-5, rtol=0)
    torch.testing.assert_close(runner.pool.ssm[:, 2], runner.pool.ssm[:, 1], atol=1e-5, rtol=0)


def test_A_is_derived_at_load_and_refreshed_in_place(ckpt):
    """A = -exp(A_log) is a buffer computed by load_weights, not per step; refresh_derived() follows a
    direct change of A_log in place (captured CUDA graphs keep reading the same memory)."""
    model = _runner(ckpt).model
    mixer = model.backbone.layers[-1].mixer
    assert mixer.A.dtype == torch.float32 and torch.equal(mixer.A, -torch.exp(mixer.A_log.float()))
    assert not any(k.endswith(".A") for k in model.state_dict())  # derived, never saved or loaded
    ptr = mixer.A.data_ptr()
    with torch.no_grad():
        mixer.A_log.add_(0.25)
    model.refresh_derived()
    assert mixer.A.data_ptr() == ptr and torch.equal(mixer.A, -torch.exp(mixer.A_log.float()))


def test_warm_up_borrows_slots_and_gives_them_back(ckpt):
    """The start-up warm-up's steps (one per class of step: engine/warm_up.py) run on three borrowed slots, padding
    sequences making up the counts (here 33 sequences, tracked states, eager decode of 1 to 64 rows)."""
    runner = _runner(ckpt, slots=70)
    free = runner.pool.allocator.num_free
    q = runner.model.dims.chunk_size
    limits = warm_up.Limits(max_running=64, chunk=64, context_length=8 * q + 64, track_interval=q)
    assert any(isinstance(s, warm_up.Prefill) and s.seqs == 33 and s.track for s in
               warm_up.plan(limits, warm_up.shapes_of(runner, limits.context_length), warm_up.target(runner.pool.ssm)))
    warm_up.compile_kernels(runner, limits)
    assert runner.pool.allocator.num_free == free
    while runner.pool.allocator.num_free > 2:
        runner.pool.allocator.alloc()  # too few slots left to borrow three: nothing runs, nothing leaks
    warm_up.compile_kernels(runner, limits)
    assert runner.pool.allocator.num_free == 2
