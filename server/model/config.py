"""Model architecture read from ``config.json``: the numbers the engine sizes itself by.

Two layouts load: Hugging Face's ``Mamba2ForCausalLM`` and ``mamba_ssm``'s (the ``state-spaces/mamba2-*``
checkpoints: ``d_model``, ``n_layer``, ``ssm_cfg``, a vocabulary padded to ``pad_vocab_size_multiple``),
which ``read_config`` translates into the former with mamba_ssm's ``Mamba2`` defaults for what
``ssm_cfg`` leaves out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SUPPORTED_ARCHITECTURES = ("Mamba2ForCausalLM",)


class ModelLoadError(RuntimeError):
    """The checkpoint cannot be served: the message says which file or field and why."""


@dataclass(frozen=True)
class Mamba2Dims:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    n_groups: int
    state_size: int
    conv_kernel: int
    chunk_size: int
    eps: float
    use_bias: bool
    use_conv_bias: bool
    residual_in_fp32: bool
    tie_word_embeddings: bool
    dt_limit: tuple[float, float]
    eos_token_id: list[int]
    max_position_embeddings: int | None
    # ids the tokenizer can produce, when the embedding has padding rows past them (mamba_ssm pads the
    # vocabulary to a multiple): they are never sampled
    real_vocab_size: int | None = None

    @property
    def d_inner(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.n_groups * self.state_size

    @classmethod
    def from_dict(cls, cfg: dict) -> "Mamba2Dims":
        archs = cfg.get("architectures") or []
        model_type = cfg.get("model_type")
        if model_type != "mamba2" or (archs and not set(archs) & set(SUPPORTED_ARCHITECTURES)):
            raise ModelLoadError(
                f"unsupported architecture {archs or model_type!r}: this server runs "
                f"{', '.join(SUPPORTED_ARCHITECTURES)} (config model_type 'mamba2')")
        try:
            hidden = int(cfg["hidden_size"])
            heads, head_dim = int(cfg["num_heads"]), int(cfg["head_dim"])
            expand = cfg.get("expand", 2)
            if hidden * expand != heads * head_dim:
                raise ModelLoadError(f"hidden_size*expand ({hidden * expand}) != num_heads*head_dim ({heads * head_dim})")
            eos = cfg.get("eos_token_id")
            eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
            n_groups = int(cfg.get("n_groups", 8))  # transformers' default, written out by save_pretrained
            if heads % n_groups:
                raise ModelLoadError(f"num_heads {heads} is not divisible by n_groups {n_groups}")
            return cls(
                vocab_size=int(cfg["vocab_size"]), hidden_size=hidden, num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads, head_dim=head_dim, n_groups=n_groups, state_size=int(cfg["state_size"]),
                conv_kernel=int(cfg.get("conv_kernel", 4)), chunk_size=int(cfg.get("chunk_size", 256)),
                eps=float(cfg.get("layer_norm_epsilon", 1e-5)), use_bias=bool(cfg.get("use_bias", False)),
                use_conv_bias=bool(cfg.get("use_conv_bias", True)),
                residual_in_fp32=bool(cfg.get("residual_in_fp32", True)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                dt_limit=tuple(_json_float(v) for v in cfg.get("time_step_limit", (0.0, float("inf")))),
                eos_token_id=eos, max_position_embeddings=cfg.get("max_position_embeddings"),
                real_vocab_size=cfg.get("real_vocab_size"),
            )
        except KeyError as e:
            raise ModelLoadError(f"config.json lacks required field {e.args[0]!r}") from None


def _json_float(v) -> float:
    # transformers >= 5 writes infinity as {"__float__": "Infinity"}; older versions as Infinity.
    if isinstance(v, dict) and "__float__" in v:
        return float(v["__float__"])
    return float(v)


# mamba_ssm.modules.mamba2.Mamba2's defaults, for what a checkpoint's ssm_cfg does not say
MAMBA_SSM_DEFAULTS = {"d_state": 128, "d_conv": 4, "expand": 2, "headdim": 64, "ngroups": 1, "chunk_size": 256,
                      "bias": False, "conv_bias": True, "rmsnorm": True, "norm_before_gate": False,
                      "dt_limit": (0.0, float("inf"))}


def from_mamba_ssm(cfg: dict) -> dict:
    """A mamba_ssm ``MambaConfig`` as the Hugging Face Mamba2 config it is equivalent to."""
    ssm = {**MAMBA_SSM_DEFAULTS, **(cfg.get("ssm_cfg") or {})}
    layer = ssm.pop("layer", "Mamba1")
    if layer != "Mamba2":
        raise ModelLoadError(f"this mamba_ssm checkpoint is a {layer} model (ssm_cfg.layer); this server runs Mamba2")
    if cfg.get("attn_layer_idx"):
        raise ModelLoadError("this mamba_ssm checkpoint has attention layers (attn_layer_idx): hybrid models are "
                             "not served yet")
    if not ssm["rmsnorm"] or ssm["norm_before_gate"]:
        raise ModelLoadError("ssm_cfg rmsnorm=false or norm_before_gate=true: only Mamba2's gated RMSNorm "
                             "(normalising after the gate) is implemented")
    d_model, vocab = int(cfg["d_model"]), int(cfg["vocab_size"])
    pad = int(cfg.get("pad_vocab_size_multiple", 1)) or 1
    d_inner = int(ssm["expand"]) * d_model
    return {
        "model_type": "mamba2", "architectures": ["Mamba2ForCausalLM"], "hidden_size": d_model,
        "num_hidden_layers": int(cfg["n_layer"]), "expand": int(ssm["expand"]),
        "num_heads": d_inner // int(ssm["headdim"]), "head_dim": int(ssm["headdim"]), "n_groups": int(ssm["ngroups"]),
        "state_size": int(ssm["d_state"]), "conv_kernel": int(ssm["d_conv"]), "chunk_size": int(ssm["chunk_size"]),
        "use_bias": bool(ssm["bias"]), "use_conv_bias": bool(ssm["conv_bias"]),
        "time_step_limit": list(ssm["dt_limit"]), "layer_norm_epsilon": 1e-5,
        "residual_in_fp32": bool(cfg.get("residual_in_fp32", True)),
        "tie_word_embeddings": bool(cfg.get("tie_embeddings", True)),
        "vocab_size": -(-vocab // pad) * pad, "real_vocab_size": vocab, "eos_token_id": None,
    }


def read_config(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    if model_dir.is_file():
        raise ModelLoadError(f"--model {model_dir} is a file; give the checkpoint's directory (config.json, weights, "
                             "tokenizer)")
    if not model_dir.is_dir():
        raise ModelLoadError(f"model directory {model_dir} does not exist")
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing: a model directory needs a Hugging Face config.json")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from None
    try:
        return from_mamba_ssm(cfg) if "d_model" in cfg and "n_layer" in cfg else cfg
    except KeyError as e:
        raise ModelLoadError(f"{path} (mamba_ssm layout) lacks required field {e.args[0]!r}") from None
