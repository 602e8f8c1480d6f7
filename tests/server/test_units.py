"""Pure parts of the engine: admission policy, sampling filters, detokenizer, slot allocator, loading errors."""

import json

import pytest
import torch

from mambaserve.server.engine.detokenizer import IncrementalDetokenizer
from mambaserve.server.model.config import ModelLoadError
from mambaserve.server.model.loader import load_model, resolve_device
from mambaserve.server.engine.request import BadRequest, SamplingParams
from mambaserve.server.engine.request import Req
from mambaserve.server.engine.sampling import (NON_FINITE_LOGITS, NON_FINITE_SAMPLING, Sampler, _filter, needs_fp32,
                                             sample)
from mambaserve.server.engine.policy import PrefillCandidate, burst_hold, next_mode_is_decode, plan_prefill
from mambaserve.server.engine.state_pool import SlotAllocator
from tests.server.tiny_models import byte_tokenizer, make_checkpoint


def test_prefill_plan_packs_chunks_and_keeps_arrival_order():
    c = [PrefillCandidate("a", 5, False), PrefillCandidate("b", 30, True), PrefillCandidate("c", 2, True)]
    assert plan_prefill(c, 16, free_slots=4, running=1, max_running=8) == [("a", 5), ("b", 11)]
    assert plan_prefill(c, 64, free_slots=4, running=1, max_running=8) == [("a", 5), ("b", 30), ("c", 2)]
    # no slot for b: c must not overtake it
    assert plan_prefill(c, 64, free_slots=0, running=1, max_running=8) == [("a", 5)]
    assert plan_prefill(c, 64, free_slots=4, running=2, max_running=2) == [("a", 5)]
    assert plan_prefill([], 64, 4, 0, 8) == []
    # a session turn brings its own slot but still needs a running place
    turn = [PrefillCandidate("t", 3, True, needs_slot=False)]
    assert plan_prefill(turn, 64, free_slots=0, running=1, max_running=8) == [("t", 3)]
    assert plan_prefill(turn, 64, free_slots=4, running=2, max_running=2) == []


def test_prefill_and_decode_alternate_when_both_have_work():
    def decode(prefill_tokens, extends_in_a_row, has_decode_work=True):
        return next_mode_is_decode(prefill_tokens, has_decode_work, extends_in_a_row, short=512)

    assert not decode(4096, extends_in_a_row=0)  # a decode step ran last: prefill
    assert decode(4096, extends_in_a_row=1)  # a long prompt's next chunk waits for the decoders' step
    assert decode(0, extends_in_a_row=0)  # nothing to prefill
    assert not decode(4096, extends_in_a_row=3, has_decode_work=False)
    # cache hits' few new tokens run right after an extend, but never a third extend in a row
    assert not decode(448, extends_in_a_row=1)
    assert decode(448, extends_in_a_row=2)
    assert decode(513, extends_in_a_row=1)


def test_an_idle_step_is_held_only_for_requests_on_their_way_and_only_so_long():
    assert burst_hold(idle=True, waiting=1, arriving=3, held=0.0, limit=0.01) == 0.01
    assert burst_hold(idle=True, waiting=1, arriving=3, held=0.004, limit=0.01) == pytest.approx(0.006)
    assert burst_hold(idle=True, waiting=1, arriving=3, held=0.02, limit=0.01) == 0  # held long enough
    assert burst_hold(idle=True, waiting=1, arriving=0, held=0.0, limit=0.01) == 0  # a lone request
    assert burst_hold(idle=False, waiting=1, arriving=3, held=0.0, limit=0.01) == 0  # busy: steps go on
    assert burst_hold(idle=True, waiting=0, arriving=3, held=0.0, limit=0.01) == 0  # nothing to run yet
    assert burst_hold(idle=True, waiting=1, arriving=3, held=0.0, limit=0.0) == 0  # --burst-hold-ms 0
    # after a burst of 8, the first of the next waits a quiet moment after its submission for the rest...
    assert burst_hold(idle=True, waiting=1, arriving=0, held=0.0, limit=0.01, quiet_left=0.002, expected=8) == 0.002
    assert burst_hold(idle=True, waiting=7, arriving=0, held=0.009, limit=0.01, quiet_left=0.002,
                      expected=8) == pytest.approx(0.001)  # (within the hold's limit)
    assert burst_hold(idle=True, waiting=3, arriving=0, held=0.001, limit=0.01, quiet_left=-0.001, expected=8) == 0
    assert burst_hold(idle=True, waiting=8, arriving=0, held=0.0, limit=0.01, quiet_left=0.002, expected=8) == 0
    # ... but not after lone requests
    assert burst_hold(idle=True, waiting=1, arriving=0, held=0.0, limit=0.01, quiet_left=0.002, expected=1) == 0


def test_garbage_collections_are_timed_by_generation_until_unwatched():
    import gc

    from prometheus_client import CollectorRegistry, Histogram

    from mambaserve.server.engine import gc_pauses

    registry = CollectorRegistry()
    pauses = Histogram("pauses", "", ["generation"], registry=registry)
    stop = gc_pauses.watch(pauses)
    try:
        gc.collect()
    finally:
        stop()
    gc.collect()
    assert registry.get_sample_value("pauses_count", {"generation": "2"}) == 1
    assert registry.get_sample_value("pauses_sum", {"generation": "2"}) > 0


def test_sampling_filters():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = _filter(logits, [SamplingParams(top_k=2)])
    assert torch.allclose(p, torch.tensor([[0.625, 0.375, 0, 0]]))
    p = _filter(logits, [SamplingParams(top_p=0.7)])  # 0.5 < 0.7, 0.8 >= 0.7: keeps two
    assert torch.allclose(p, torch.tensor([[0.625, 0.375, 0, 0]]))
    p = _filter(logits, [SamplingParams(min_p=0.25)])  # threshold 0.125
    assert torch.allclose(p, torch.tensor([[0.5, 0.3, 0.15, 0]]) / 0.95)
    p = _filter(logits, [SamplingParams(temperature=0.5)])
    assert torch.allclose(p, torch.softmax(logits / 0.5, -1))
    r = sample(logits.repeat(2, 1), [SamplingParams(temperature=0), SamplingParams(top_k=1)], [None, None], [0, 1],
               [2, 0]).result()
    assert r.tokens == [0, 0] and r.logprobs[0] == pytest.approx(float(torch.log(torch.tensor(0.5))))
    assert [t for t, _ in r.top_logprobs[0]] == [0, 1] and r.top_logprobs[1] == []


def test_a_row_without_a_finite_distribution_gets_a_status_not_a_token():
    """NaN logits (the model's) or a distribution the filters emptied (the request's parameters) mark that
    row alone; the other rows sample as before, and the device token stays a valid id."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(4, 1)
    logits[1, 2] = float("nan")
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0), SamplingParams(top_p=1e-46),
              SamplingParams(top_k=2, seed=1)]
    g = torch.Generator().manual_seed(1)
    d = sample(logits, params, [None, None, None, g], [], [0] * 4)
    assert d.result().tokens[:3] == [0, NON_FINITE_LOGITS, NON_FINITE_SAMPLING] and d.result().tokens[3] in (0, 1)
    assert all(0 <= t < 4 for t in d.tokens.tolist())
    # the sampled row is what torch.multinomial draws from the same generator
    probs = _filter(logits[3:], params[3:])[0]
    assert d.result().tokens[3] == torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(1)).item()


def test_greedy_rows_sample_the_models_bf16_logits_and_anything_else_gets_fp32():
    """A batch of plain greedy rows takes the maximum of the model's own (bf16) logits: the argmax of their fp32
    copy, the first of tied maxima, a non-finite row flagged. One row with logprobs sends the batch through fp32."""
    torch.manual_seed(0)
    logits = torch.randn(4, 300).to(torch.bfloat16)
    logits[1, 7] = logits[1, 250] = logits[1].max() + 1  # a tie: the first index wins
    logits[2, 5] = float("inf")
    sampler = Sampler(torch.device("cpu"), seed=0)

    def req(i, **kw):
        return Req(f"r{i}", [1], SamplingParams(temperature=0), IncrementalDetokenizer(_Tok(), ()), print, **kw)

    plain = [req(i) for i in range(4)]
    assert not needs_fp32(plain, edited=False) and needs_fp32(plain, edited=True)
    got = sampler.launch(logits, list(range(4)), plain).sample.result().tokens
    want = logits.float().argmax(-1).tolist()
    assert got[0] == want[0] and got[1] == 7 and got[2] == NON_FINITE_LOGITS and got[3] == want[3]
    asking = [req(0), req(1, return_logprob=True, top_logprobs_num=2)]
    assert needs_fp32(asking, edited=False)
    r = sampler.launch(logits[[0, 3]], [0, 1], asking).sample.result()
    logp = torch.log_softmax(logits[3].float(), -1)
    assert r.tokens == [want[0], want[3]] and r.logprobs[1] == pytest.approx(logp.max().item(), abs=1e-6)
    assert r.top_logprobs[1][0] == (want[3], pytest.approx(logp.max().item(), abs=1e-6))


@pytest.mark.parametrize("bad", [dict(max_new_tokens=-1), dict(temperature=-0.1), dict(top_p=0), dict(top_p=1.5),
                                 dict(min_p=2), dict(stop=("",)), dict(top_p=1e-46), dict(temperature=1e39),
                                 dict(repetition_penalty=1e-39), dict(frequency_penalty=1e39)])
def test_sampling_params_validation(bad):
    with pytest.raises(BadRequest):
        SamplingParams(**bad).validate()


class _Tok:
    def __init__(self):
        self.t = byte_tokenizer()

    def decode(self, ids, skip_special_tokens=True):
        return self.t.decode(ids, skip_special_tokens=skip_special_tokens)

    def encode(self, s):
        return self.t.encode(s).ids


def test_detokenizer_holds_back_possible_stop_prefix_and_cuts_at_stop():
    tok = _Tok()
    d = IncrementalDetokenizer(tok, stop=("END",))
    released = ""
    for t in tok.encode("abc EN"):
        d.add(t)
        released += d.release()
    assert released == "abc "  # "EN" may start "END"
    for t in tok.encode("Dxyz"):
        d.add(t)
        released += d.release()
    assert d.stopped == "END" and released + d.release(final=True) == "abc "
    d2 = IncrementalDetokenizer(tok, stop=("END",))
    for t in tok.encode("ENx"):
        d2.add(t)
    assert d2.release() == "ENx"


def test_slot_allocator_accounting():
    a = SlotAllocator(3)
    slots = [a.alloc() for _ in range(3)]
    assert sorted(slots) == [0, 1, 2] and a.alloc() is None and a.num_free == 0
    a.free(slots[0])
    assert a.num_free == 1 and a.alloc() == slots[0]
    with pytest.raises(RuntimeError, match="double free"):
        a.free(99)


def test_loading_errors_are_clear(tmp_path):
    cpu = torch.device("cpu")
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nope", torch.float32, cpu)
    (tmp_path / "model.safetensors").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="is a file; give the checkpoint's directory"):
        load_model(tmp_path / "model.safetensors", torch.float32, cpu)
    tmp_path.joinpath("empty").mkdir()
    with pytest.raises(ModelLoadError, match="config.json is missing"):
        load_model(tmp_path / "empty", torch.float32, cpu)
    ck = make_checkpoint(tmp_path / "m")
    cfg = json.loads((ck / "config.json").read_text())
    (ck / "config.json").write_text(json.dumps({**cfg, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        load_model(ck, torch.float32, cpu)
    (ck / "config.json").write_text(json.dumps(cfg))
    (ck / "model.safetensors").rename(ck / "elsewhere.safetensors")
    with pytest.raises(ModelLoadError, match="no weights"):
        load_model(ck, torch.float32, cpu)
    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match="no CUDA device"):
            resolve_device("cuda")


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path):
    from safetensors.torch import load_file, save_file

    ck = make_checkpoint(tmp_path / "m")
    state = load_file(ck / "model.safetensors")
    names = sorted(state)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for fname, keys in shards.items():
        save_file({k: state[k] for k in keys}, ck / fname)
    (ck / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}))
    single, _ = load_model(ck, torch.float32, torch.device("cpu"))
    (ck / "model.safetensors").unlink()
    sharded, _ = load_model(ck, torch.float32, torch.device("cpu"))
    for (n, a), (_, b) in zip(single.named_parameters(), sharded.named_parameters()):
        assert torch.equal(a, b), n
    (ck / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="missing"):
        load_model(ck, torch.float32, torch.device("cpu"))


def test_cli_help_explains_every_flag():
    from mambaserve.server.cli import build_parser

    parser = build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]
    for action in serve._actions:
        if action.option_strings and action.dest != "help":
            assert action.help and len(action.help) > 10, action.dest
    text = " ".join(serve.format_help().split())
    # each default said once, and never as "(default: None)"
    assert "(default: None)" not in text and "(default: False)" not in text
    fmt = serve._get_formatter()
    twice = [a.help for a in serve._actions if "default" in (a.help or "") and fmt._get_help_string(a) != a.help]
    assert not twice, twice  # a help text that explains its default gets no second one
    assert "(default: 30000)" in text and "(default: 16GiB)" in text and "(default: 8MiB)" in text


def test_cli_errors_are_short_and_sizes_take_units(capsys):
    from mambaserve.server.cli import build_parser, config_from_args

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--model", "m", "--dtype", "int8"])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "invalid choice: 'int8'" in err[0] and "mambaserve serve --help" in err[0]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--model", "m", "--bogus", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unrecognized arguments: --bogus 1" in err[0] and "mambaserve serve --help" in err[0]
    args = build_parser().parse_args(["serve", "--model", "m", "--session-snapshot-max-bytes", "1GiB",
                                      "--max-request-bytes", "512KiB"])
    cfg = config_from_args(args)
    assert cfg.session_snapshot_max_bytes == 2**30 and cfg.max_request_bytes == 512 * 2**10
    defaults = config_from_args(build_parser().parse_args(["serve", "--model", "m"]))
    assert defaults.session_snapshot_max_bytes == 16 * 2**30 and defaults.max_request_bytes == 8 * 2**20


def test_lazy_detokenization_gives_the_same_text_as_incremental():
    from pathlib import Path

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(Path(__file__).resolve().parents[2] / "models" / "mamba2-tiny-pystdlib")
    ids = tok.encode("def héllo(x):\n    return '世界' + x  # ünïcode", add_special_tokens=False)
    prompt, out = ids[:3], ids[3:]
    texts = []
    for incremental in (True, False):
        d = IncrementalDetokenizer(tok, prompt_tail=prompt, incremental=incremental)
        text = ""
        for t in out:
            d.add(t)
            text += d.release()
        texts.append(text + d.release(final=True))
    assert texts[0] == texts[1] == tok.decode(ids)[len(tok.decode(prompt)):]
    assert "世界" in texts[0]


@pytest.mark.parametrize("bad,needle", [(dict(session_slot_fraction=1.0), "session-slot-fraction"),
                                        (dict(request_timeout=float("nan")), "request-timeout"),
                                        (dict(max_queued_requests=0), "max-queued-requests"),
                                        (dict(burst_hold_ms=-1.0), "burst-hold-ms"),
                                        (dict(burst_quiet_ms=float("nan")), "burst-quiet-ms"),
                                        (dict(state_dtype="int8"), "state-dtype"),
                                        (dict(device="tpu"), "--device must be auto, cpu, cuda or cuda:N"),
                                        (dict(device="cuda:x"), "--device must be"),
                                        (dict(mamba_track_interval=256), "needs --mamba-cache-strategy extra_buffer")])
def test_config_refuses_bad_values_before_anything_loads(bad, needle):
    from mambaserve.server.config import ServerConfig

    with pytest.raises(ValueError, match=needle):
        ServerConfig(model="/nonexistent", **bad)


def test_encode_through_the_backend_gives_the_tokenizers_ids():
    """``model.tokenizer.encode`` (the Rust backend, the interpreter lock released) equals transformers' encode: special
    tokens, unicode, whitespace; a backend set to truncate goes through transformers, which turns that off."""
    from pathlib import Path

    from mambaserve.server.model.tokenizer import encode, load_tokenizer, render_chat

    tok = load_tokenizer(Path(__file__).resolve().parents[2] / "models" / "mamba2-tiny-pystdlib")
    chat = render_chat(tok, [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def f(x):\n\treturn x"}])
    for text in (chat, "héllo wörld ✓ 日本語 \U0001F600", "", "  \n\t x", "<|endoftext|><|endoftext|>abc<|system|>",
                 json.__doc__):
        assert encode(tok, text) == tok.encode(text, add_special_tokens=False), text
    tok.backend_tokenizer.enable_truncation(max_length=3)
    assert len(encode(tok, chat)) > 3


def test_the_cache_hit_rate_covers_the_lookups_of_its_window_only(monkeypatch):
    import types

    from mambaserve.server.engine import metrics as metrics_module

    clock = [100.0]
    monkeypatch.setattr(metrics_module, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    m = metrics_module.ServerMetrics(hit_rate_window_s=10.0)
    rate = lambda: m.registry.get_sample_value("mambaserve_cache_hit_rate")  # noqa: E731
    m.observe_lookup(100, 0)
    clock[0] += 5
    m.observe_lookup(100, 100)
    assert rate() == 0.5
    clock[0] += 6  # the first lookup is 11 s old: out of the window
    m.observe_lookup(100, 50)
    assert rate() == 150 / 200
    clock[0] += 30  # all of them out but the one just made
    m.observe_lookup(10, 0)
    assert rate() == 0.0 and len(m._window) == 1
