"""The architecture registry and the hybrid config adapters: what loads as what, what is refused and why."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from mambaserve.server.model import hybrid_config
from mambaserve.server.model.config import ModelLoadError
from mambaserve.server.model.loader import load_model
from mambaserve.server.model.mamba2 import Mamba2ForCausalLM
from mambaserve.server.model.nemotron_h import NemotronHForCausalLM
from mambaserve.server.model.registry import ARCHITECTURES, resolve
from tests.server.tiny_hybrids import make_hybrid_checkpoint


def test_architectures_resolve_by_name_then_model_type():
    assert resolve({"architectures": ["Mamba2ForCausalLM"], "model_type": "mamba2"}).model_class is Mamba2ForCausalLM
    assert resolve({"model_type": "mamba2"}).model_class is Mamba2ForCausalLM  # older configs name no class
    assert resolve({"architectures": ["NemotronHForCausalLM"]}).model_class is NemotronHForCausalLM
    assert not resolve({"model_type": "mamba2"}).hybrid and resolve({"model_type": "bamba"}).hybrid
    with pytest.raises(ModelLoadError, match="unsupported architecture 'LlamaForCausalLM'.*NemotronHForCausalLM"):
        resolve({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    assert set(ARCHITECTURES) >= {"Mamba2ForCausalLM", "NemotronHForCausalLM", "GraniteMoeHybridForCausalLM",
                                  "BambaForCausalLM"}


def test_nemotron_pattern_string_and_layer_list_agree():
    base = {"vocab_size": 8, "hidden_size": 16, "mamba_num_heads": 4, "mamba_head_dim": 8, "n_groups": 2,
            "ssm_state_size": 4, "num_attention_heads": 2, "head_dim": 8, "n_routed_experts": 4}
    a = hybrid_config.nemotron_h({**base, "hybrid_override_pattern": "M*-E"})
    b = hybrid_config.nemotron_h({**base, "layers_block_type": ["mamba", "attention", "mlp", "moe"]})
    assert a == b and a.mixers == ("mamba", "attention", "mlp", "moe")
    assert a.mamba.num_layers == 1 and a.attention_layers == [1] and a.attention.rope_theta is None
    assert a.mamba.dt_limit == (0.001, float("inf"))  # transformers clamps Nemotron-H's dt at time_step_min
    with pytest.raises(ModelLoadError, match="characters other than"):
        hybrid_config.nemotron_h({**base, "hybrid_override_pattern": "M*X"})


def test_granite_rope_only_when_asked_and_unknown_rope_refused():
    base = {"vocab_size": 8, "hidden_size": 16, "num_hidden_layers": 2, "layer_types": ["mamba", "attention"],
            "num_attention_heads": 4, "mamba_n_heads": 4, "mamba_d_state": 4, "attention_multiplier": 0.25}
    assert hybrid_config.granite_hybrid(base).attention.rope_theta is None  # Granite 4.0-H: "nope"
    g = hybrid_config.granite_hybrid({**base, "position_embedding_type": "rope", "rope_theta": 500.0})
    assert (g.attention.rope_theta, g.attention.rotary_dim, g.attention.scale) == (500.0, 4, 0.25)
    with pytest.raises(ModelLoadError, match="rope type 'yarn'"):
        hybrid_config.granite_hybrid({**base, "position_embedding_type": "rope",
                                      "rope_parameters": {"rope_type": "yarn", "factor": 4.0}})


def test_nemotron_experts_stacked_at_load_and_a_missing_tensor_named(tmp_path):
    path = make_hybrid_checkpoint(tmp_path / "nh", "nemotron_h")
    model, _ = load_model(path, torch.float32, torch.device("cpu"))
    state = load_file(str(path / "model.safetensors"))
    up = model.backbone.layers[3].mixer.experts.up_proj
    assert up.shape[0] == 4 and torch.equal(up[2], state["backbone.layers.3.mixer.experts.2.up_proj.weight"])
    del state["backbone.layers.3.mixer.experts.1.up_proj.weight"]
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"experts \[0, 2, 3\] for up_proj.*missing \[1\]"):
        load_model(path, torch.float32, torch.device("cpu"))


def test_unknown_layer_type_is_refused(tmp_path):
    path = make_hybrid_checkpoint(tmp_path / "g", "granite_dense_rope")
    cfg = json.loads((path / "config.json").read_text())
    cfg["layer_types"][1] = "sliding_attention"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="sliding_attention"):
        load_model(path, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("family,fields", [
    ("nemotron_h", ["n_groups", "conv_kernel", "chunk_size", "ssm_state_size", "mamba_head_dim", "use_conv_bias",
                    "num_key_value_heads", "n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor",
                    "moe_latent_size", "time_step_min", "layer_norm_epsilon", "mlp_bias", "attention_bias"]),
    ("granitemoehybrid", ["mamba_n_groups", "mamba_d_conv", "mamba_chunk_size", "mamba_d_state", "mamba_d_head",
                          "mamba_conv_bias", "mamba_proj_bias", "time_step_limit", "rms_norm_eps",
                          "embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling",
                          "num_experts_per_tok", "shared_intermediate_size", "position_embedding_type"]),
    ("bamba", ["mamba_n_groups", "mamba_d_conv", "mamba_chunk_size", "mamba_d_state", "mamba_d_head",
               "mamba_conv_bias", "rms_norm_eps", "num_key_value_heads", "rope_parameters"]),
])
def test_adapter_defaults_are_transformers_defaults(family, fields):
    """A config.json that leaves a field out means transformers' default (a wrong n_groups default once
    passed every test whose configs spelled it out): the adapter reads the same dims either way."""
    from transformers import AutoConfig

    layers = {"nemotron_h": {"mamba_num_heads": 8},  # its default pattern has every layer kind
              "granitemoehybrid": {"mamba_n_heads": 8, "num_hidden_layers": 2, "layer_types": ["mamba", "attention"]},
              "bamba": {"mamba_n_heads": 8, "num_hidden_layers": 2, "attn_layer_indices": [1]}}[family]
    full = AutoConfig.for_model(family, vocab_size=64, hidden_size=256, num_attention_heads=4, **layers).to_dict()
    full["time_step_limit"] = list(full.get("time_step_limit") or (0.0, float("inf")))
    stripped = {k: v for k, v in full.items() if k not in fields}
    read = ARCHITECTURES[full["architectures"][0] if full.get("architectures") else
                         next(a.name for a in ARCHITECTURES.values() if a.model_type == family)].read_dims
    assert read(full).attention is not None and read(stripped) == read(full)


def test_tied_lm_head_is_the_embedding(tmp_path):
    path = make_hybrid_checkpoint(tmp_path / "g", "granite_dense_rope")
    assert "lm_head.weight" not in load_file(str(path / "model.safetensors"))  # tied: saved once
    model, _ = load_model(path, torch.float32, torch.device("cpu"))
    assert model.lm_head.weight is model.embed.weight
