"""Checkpoints as people have them: mamba_ssm's layout (state-spaces/mamba2-*: d_model/n_layer/ssm_cfg,
pytorch_model.bin, a padded vocabulary, no tokenizer) beside Hugging Face's, and the n_groups > 1 shape
of Mamba-Codestral-7B; each checked against transformers' forward."""

import json

import pytest
import torch

from mambaserve.server.config import ServerConfig
from mambaserve.server.engine.batch import ForwardBatch, ForwardMode
from mambaserve.server.engine.engine import Engine
from mambaserve.server.model.config import ModelLoadError
from tests.server.conftest import run, serving
from tests.server.hf_reference import hf_norm_is_grouped
from tests.server.tiny_models import VOCAB, make_checkpoint

REAL_VOCAB = 90  # the tokenizer's ids; mamba_ssm pads the embedding to a multiple of 16: VOCAB = 96 rows


def _hf_logits(path, ids):
    from transformers import Mamba2ForCausalLM

    hf = Mamba2ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids]), use_cache=False).logits[0]


def to_mamba_ssm(hf_dir, out, layer="Mamba2", shards=1):
    """The same weights in mamba_ssm's layout: its config, its tensor names, torch .bin file(s), no tokenizer."""
    from safetensors.torch import load_file

    c = json.loads((hf_dir / "config.json").read_text())
    ssm_cfg = {"layer": layer, "d_state": c["state_size"], "d_conv": c["conv_kernel"], "expand": c["expand"],
               "headdim": c["head_dim"], "ngroups": c["n_groups"], "chunk_size": c["chunk_size"]}
    (out / "config.json").write_text(json.dumps({
        "d_model": c["hidden_size"], "d_intermediate": 0, "n_layer": c["num_hidden_layers"], "vocab_size": REAL_VOCAB,
        "ssm_cfg": ssm_cfg, "attn_layer_idx": [], "attn_cfg": {}, "rms_norm": True, "residual_in_fp32": True,
        "fused_add_norm": True, "pad_vocab_size_multiple": 16, "tie_embeddings": False}))
    state = {k.replace("backbone.embeddings.", "backbone.embedding."): v
             for k, v in load_file(str(hf_dir / "model.safetensors")).items()}
    names = sorted(state)
    if shards == 1:
        torch.save(state, out / "pytorch_model.bin")
    else:
        weight_map = {}
        for i in range(shards):
            part = {k: state[k] for k in names[i::shards]}
            torch.save(part, out / f"pytorch_model-{i}.bin")
            weight_map |= {k: f"pytorch_model-{i}.bin" for k in part}
        (out / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return out


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("hf"), "h6_g1")


@pytest.mark.parametrize("shards", [1, 2])
def test_mamba_ssm_checkpoint_matches_transformers_and_never_samples_padding(hf_dir, tmp_path, shards):
    path = to_mamba_ssm(hf_dir, tmp_path, shards=shards)
    engine = Engine(ServerConfig(model=str(path), tokenizer=str(hf_dir / "tokenizer.json"), mamba_cache_size=4,
                                 max_running_requests=2, context_length=128, device="cpu"))
    assert engine.dims.vocab_size == VOCAB and engine.dims.real_vocab_size == REAL_VOCAB
    assert engine.eos_token_ids == {0}  # from the bare tokenizer.json's <|endoftext|> (the config names none)
    ids = torch.randint(1, REAL_VOCAB, (23,), generator=torch.Generator().manual_seed(0)).tolist()
    logits = engine.scheduler.runner.forward(ForwardBatch(ForwardMode.EXTEND, ids, [23], [0], [0], all_logits=True)).logits
    assert logits.shape[-1] == REAL_VOCAB
    torch.testing.assert_close(logits, _hf_logits(hf_dir, ids)[:, :REAL_VOCAB], atol=1e-4, rtol=0)

    async def go():  # served through HTTP with --tokenizer given as a single tokenizer.json file
        async with serving(engine) as c:
            r = await c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 12, "temperature": 1.5,
                                                      "seed": 3, "logprobs": 1})
            return r.status_code, r.json()

    status, body = run(go())
    assert status == 200, body
    assert body["usage"]["completion_tokens"] > 0


def test_mamba_ssm_checkpoints_that_cannot_serve_say_why(hf_dir, tmp_path):
    (tmp_path / "m1").mkdir()
    with pytest.raises(ModelLoadError, match="Mamba1 model"):
        Engine(ServerConfig(model=str(to_mamba_ssm(hf_dir, tmp_path / "m1", layer="Mamba1"))))
    (tmp_path / "m2").mkdir()
    with pytest.raises(ModelLoadError, match="pass --tokenizer"):  # mamba_ssm checkpoints ship no tokenizer
        Engine(ServerConfig(model=str(to_mamba_ssm(hf_dir, tmp_path / "m2")), mamba_cache_size=4))
    (tmp_path / "m3").mkdir()
    (tmp_path / "m3" / "config.json").write_text((tmp_path / "m2" / "config.json").read_text())
    (tmp_path / "m3" / "pytorch_model.bin").write_bytes(b"not a checkpoint")
    with pytest.raises(ModelLoadError, match="cannot read .*pytorch_model.bin"):
        Engine(ServerConfig(model=str(tmp_path / "m3"), tokenizer=str(hf_dir / "tokenizer.json")))
    # a missing tokenizer is said before the weights are read (a 2.7b checkpoint's take a minute)
    with pytest.raises(ModelLoadError, match="pass --tokenizer"):
        Engine(ServerConfig(model=str(tmp_path / "m3")))


def test_codestral_group_shape_matches_transformers(tmp_path):
    """Mamba-Codestral-7B's mixer shape, small: 8 groups, head_dim 64, a 32,768-token vocabulary."""
    from transformers import Mamba2Config, Mamba2ForCausalLM

    if not hf_norm_is_grouped():
        pytest.skip("this transformers normalises the gated RMSNorm over all groups: no reference for n_groups > 1")

    cfg = Mamba2Config(vocab_size=32768, hidden_size=256, num_hidden_layers=2, expand=2, num_heads=8, head_dim=64,
                       n_groups=8, state_size=16, chunk_size=16, eos_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    Mamba2ForCausalLM(cfg).save_pretrained(tmp_path, safe_serialization=True)
    make_checkpoint(tmp_path / "tok", "h6_g1")  # only its tokenizer files are used
    engine = Engine(ServerConfig(model=str(tmp_path), tokenizer=str(tmp_path / "tok"), mamba_cache_size=4,
                                 max_running_requests=2, context_length=128, device="cpu"))
    assert (engine.dims.n_groups, engine.dims.head_dim) == (8, 64)
    ids = torch.randint(1, 32768, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    logits = engine.scheduler.runner.forward(ForwardBatch(ForwardMode.EXTEND, ids, [37], [0], [0], all_logits=True)).logits
    torch.testing.assert_close(logits, _hf_logits(tmp_path, ids), atol=1e-4, rtol=0)
