"""Hybrid Mamba2 + attention models: ``config.json`` of each family as one ``HybridDims``.

A hybrid is a stack of layers; each layer has one *mixer* (``mamba``, ``attention``, ``mlp`` or ``moe``)
and, in the families that pair every mixer with a feed-forward block (Granite 4.0-H, Bamba), an *ffn*
(``mlp`` or ``moe``) after it. The adapters here read each family's field names and defaults (those of
its ``transformers`` configuration class, the oracle the tests compare with) into that one shape;
the model modules (``nemotron_h.py``, ``granite_hybrid.py``, ``bamba.py``) only read ``HybridDims``.
"""

from __future__ import annotations

from dataclasses import dataclass

from mambaserve.server.model.config import Mamba2Dims, ModelLoadError, _json_float

MIXERS = ("mamba", "attention", "mlp", "moe")
# the names families use in layer_types / layers_block_type, old and new
_LAYER_NAMES = {"mamba": "mamba", "linear_attention": "mamba", "attention": "attention",
                "full_attention": "attention", "mlp": "mlp", "moe": "moe"}
NEMOTRON_PATTERN = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}


@dataclass(frozen=True)
class AttentionDims:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float  # softmax scale: head_dim ** -0.5, or Granite's attention_multiplier
    bias: bool
    rope_theta: float | None  # None: no position embedding (Nemotron-H, Granite 4.0-H "nope")
    rotary_dim: int  # leading channels of each head that RoPE turns (Bamba: half)


@dataclass(frozen=True)
class MlpDims:
    intermediate_size: int
    gated: bool  # act(gate) * up (SwiGLU) or act(up) (Nemotron's relu2)
    act: str  # "silu" or "relu2"
    bias: bool


@dataclass(frozen=True)
class MoEDims:
    num_experts: int
    top_k: int
    intermediate_size: int
    gated: bool
    act: str
    router: str  # "softmax_topk" (Granite: softmax over the top-k logits) or "sigmoid_grouped" (Nemotron-H)
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    shared_intermediate_size: int = 0  # Nemotron-H's shared expert (0: none)
    latent_size: int | None = None  # Nemotron-H: experts run in a smaller latent width


@dataclass(frozen=True)
class HybridDims:
    architecture: str
    vocab_size: int
    hidden_size: int
    mixers: tuple[str, ...]  # one per layer
    ffns: tuple[str | None, ...]  # one per layer: "mlp", "moe" or None
    mamba: Mamba2Dims | None  # the Mamba layers' shape; its num_layers = how many Mamba layers
    attention: AttentionDims | None
    mlp: MlpDims | None
    moe: MoEDims | None
    eps: float
    tie_word_embeddings: bool
    eos_token_id: list[int]
    max_position_embeddings: int | None
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0  # logits are divided by it (Granite)
    real_vocab_size: int | None = None

    @property
    def num_layers(self) -> int:
        return len(self.mixers)

    @property
    def mamba_layers(self) -> list[int]:
        return [i for i, m in enumerate(self.mixers) if m == "mamba"]

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, m in enumerate(self.mixers) if m == "attention"]

    # what the engine sizes itself by, as for a pure Mamba2 model
    @property
    def chunk_size(self) -> int:
        return self.mamba.chunk_size if self.mamba else 256

    @property
    def conv_kernel(self) -> int:
        return self.mamba.conv_kernel if self.mamba else 4


def _eos(cfg: dict) -> list[int]:
    eos = cfg.get("eos_token_id")
    return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))


def _kv_heads(cfg: dict, heads: int, default: int | None) -> int:
    """KV heads: the family's transformers default when absent (8 for Nemotron-H and Bamba, not the query
    heads), the query heads when null."""
    kv = cfg.get("num_key_value_heads", default)
    return heads if kv is None else int(kv)


def _layer_kinds(names: list[str], field: str) -> tuple[str, ...]:
    try:
        return tuple(_LAYER_NAMES[n] for n in names)
    except KeyError as e:
        raise ModelLoadError(f"{field} names layer type {e.args[0]!r}; this server runs "
                             f"{', '.join(sorted(_LAYER_NAMES))}") from None


def _mamba(cfg: dict, hidden: int, n_layers: int, *, heads: str, head_dim: str, groups: str, state: str,
           conv: str, chunk: str, conv_bias: str, proj_bias: str, eps: float, dt_limit, defaults: dict) -> Mamba2Dims:
    """The Mamba layers as a Mamba2Dims (the mixer's shape), from a family's field names and defaults."""
    g = lambda k: cfg.get(k, defaults.get(k))  # noqa: E731
    n_heads, expand = int(g(heads)), int(g("mamba_expand") or g("expand") or 2)
    hd = g(head_dim)
    hd = expand * hidden // n_heads if hd in (None, "auto") else int(hd)
    n_groups = int(g(groups))
    if n_heads % n_groups:
        raise ModelLoadError(f"{heads} {n_heads} is not divisible by {groups} {n_groups}")
    return Mamba2Dims(
        vocab_size=int(cfg["vocab_size"]), hidden_size=hidden, num_layers=n_layers, num_heads=n_heads, head_dim=hd,
        n_groups=n_groups, state_size=int(g(state)), conv_kernel=int(g(conv)), chunk_size=int(g(chunk)), eps=eps,
        use_bias=bool(g(proj_bias)), use_conv_bias=bool(g(conv_bias)), residual_in_fp32=False,
        tie_word_embeddings=False, dt_limit=tuple(_json_float(v) for v in dt_limit), eos_token_id=[],
        max_position_embeddings=None)


def _rope(cfg: dict, head_dim: int, partial: float = 1.0) -> tuple[float, int]:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise ModelLoadError(f"rope type {kind!r} is not implemented (only the default RoPE)")
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    partial = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", partial)))
    return theta, int(head_dim * partial)


def nemotron_h(cfg: dict) -> HybridDims:
    """``NemotronHForCausalLM``: one mixer per layer from ``layers_block_type`` (or the older
    ``hybrid_override_pattern`` string, M * - E), no position embedding, relu2 MLPs, sigmoid-routed MoE."""
    d = {"mamba_num_heads": 128, "mamba_head_dim": 64, "n_groups": 8, "ssm_state_size": 128, "conv_kernel": 4,
         "chunk_size": 128, "use_conv_bias": True, "use_bias": False, "expand": 2}
    # older configs name some Mamba fields mamba_*; transformers reads both
    for old, new in (("mamba_n_groups", "n_groups"), ("mamba_d_conv", "conv_kernel"), ("mamba_expand", "expand"),
                     ("mamba_conv_bias", "use_conv_bias"), ("mamba_chunk_size", "chunk_size")):
        if old in cfg and new not in cfg:
            cfg = {**cfg, new: cfg[old]}
    if cfg.get("layers_block_type"):
        mixers = _layer_kinds(cfg["layers_block_type"], "layers_block_type")
    elif cfg.get("hybrid_override_pattern"):
        pattern = cfg["hybrid_override_pattern"]
        if set(pattern) - set(NEMOTRON_PATTERN):
            raise ModelLoadError(f"hybrid_override_pattern {pattern!r}: characters other than M * - E")
        mixers = tuple(NEMOTRON_PATTERN[c] for c in pattern)
    else:
        raise ModelLoadError("config.json has neither layers_block_type nor hybrid_override_pattern")
    hidden, eps = int(cfg["hidden_size"]), float(cfg.get("layer_norm_epsilon", 1e-5))
    # transformers' Nemotron-H mixer clamps dt from below at time_step_min (its time_step_limit is unused)
    dt_limit = (cfg.get("time_step_min", 0.001), float("inf"))
    mamba = _mamba(cfg, hidden, mixers.count("mamba"), heads="mamba_num_heads", head_dim="mamba_head_dim",
                   groups="n_groups", state="ssm_state_size", conv="conv_kernel", chunk="chunk_size",
                   conv_bias="use_conv_bias", proj_bias="use_bias", eps=eps, dt_limit=dt_limit, defaults=d)
    heads = int(cfg.get("num_attention_heads", 32))
    head_dim = int(cfg.get("head_dim", 128) or hidden // heads)  # transformers' defaults: 128 and 8 KV heads
    kv_heads = _kv_heads(cfg, heads, 8)
    act = cfg.get("mlp_hidden_act", "relu2")
    if act != "relu2":
        raise ModelLoadError(f"mlp_hidden_act {act!r}: Nemotron-H is implemented with relu2")
    moe = None
    if "moe" in mixers:
        moe = MoEDims(num_experts=int(cfg.get("n_routed_experts", 8)), top_k=int(cfg.get("num_experts_per_tok", 2)),
                      intermediate_size=int(cfg.get("moe_intermediate_size", 7688)), gated=False, act=act,
                      router="sigmoid_grouped", norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                      routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
                      n_group=int(cfg.get("n_group", 1)), topk_group=int(cfg.get("topk_group", 1)),
                      shared_intermediate_size=int(cfg.get("moe_shared_expert_intermediate_size", 7688)),
                      latent_size=cfg.get("moe_latent_size"))
    return HybridDims(
        architecture="NemotronHForCausalLM", vocab_size=int(cfg["vocab_size"]), hidden_size=hidden, mixers=mixers,
        ffns=(None,) * len(mixers), mamba=mamba if "mamba" in mixers else None,
        attention=AttentionDims(heads, kv_heads, head_dim, head_dim ** -0.5, bool(cfg.get("attention_bias", False)),
                                None, 0) if "attention" in mixers else None,
        mlp=MlpDims(int(cfg.get("intermediate_size", 21504)), False, act, bool(cfg.get("mlp_bias", False))),
        moe=moe, eps=eps, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), eos_token_id=_eos(cfg),
        max_position_embeddings=cfg.get("max_position_embeddings"))


def granite_hybrid(cfg: dict) -> HybridDims:
    """``GraniteMoeHybridForCausalLM`` (Granite 4.0-H): Mamba or attention, then a SwiGLU shared MLP plus,
    with ``num_local_experts`` > 0, a softmax-routed MoE; embedding, residual, attention and logits multipliers;
    RoPE only with ``position_embedding_type: rope``."""
    hidden, n = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
    eps = float(cfg.get("rms_norm_eps", 1e-6))
    mixers = _layer_kinds(cfg.get("layer_types") or cfg.get("layers_block_type") or ["mamba"] * n, "layer_types")
    if len(mixers) != n or set(mixers) - {"mamba", "attention"}:
        raise ModelLoadError(f"layer_types must name {n} layers, each mamba or attention: {list(mixers)}")
    mamba = _mamba_prefixed(cfg, hidden, mixers.count("mamba"), eps)
    heads = int(cfg.get("num_attention_heads", 32))
    head_dim = hidden // heads
    pos = cfg.get("position_embedding_type")
    if pos not in (None, "nope", "rope"):
        raise ModelLoadError(f"position_embedding_type {pos!r}: this server runs rope or none")
    theta, rot = _rope(cfg, head_dim) if pos == "rope" else (None, 0)
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"hidden_act {act!r}: Granite 4.0-H is implemented with silu")
    experts = int(cfg.get("num_local_experts", 8) or 0)
    moe = MoEDims(experts, int(cfg.get("num_experts_per_tok", 2)), int(cfg.get("intermediate_size", 11008)), True,
                  act, "softmax_topk") if experts else None
    return HybridDims(
        architecture="GraniteMoeHybridForCausalLM", vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
        mixers=mixers, ffns=("moe" if experts else "mlp",) * n, mamba=mamba if "mamba" in mixers else None,
        attention=AttentionDims(heads, _kv_heads(cfg, heads, None), head_dim,
                                float(cfg.get("attention_multiplier", 1.0)), bool(cfg.get("attention_bias", False)),
                                theta, rot) if "attention" in mixers else None,
        mlp=MlpDims(int(cfg.get("shared_intermediate_size", 1024)), True, act, False), moe=moe, eps=eps,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), eos_token_id=_eos(cfg),
        max_position_embeddings=cfg.get("max_position_embeddings"),
        embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(cfg.get("residual_multiplier", 1.0)),
        logits_scaling=float(cfg.get("logits_scaling", 1.0)))


def _mamba_prefixed(cfg: dict, hidden: int, layers: int, eps: float):
    """The Mamba dims of configs that name them ``mamba_*`` (Granite 4.0-H and Bamba), with transformers'
    defaults."""
    d = {"mamba_n_heads": 128, "mamba_n_groups": 1, "mamba_d_state": 256, "mamba_d_head": "auto", "mamba_d_conv": 4,
         "mamba_chunk_size": 256, "mamba_conv_bias": True, "mamba_proj_bias": False, "mamba_expand": 2}
    return _mamba(cfg, hidden, layers, heads="mamba_n_heads", head_dim="mamba_d_head", groups="mamba_n_groups",
                  state="mamba_d_state", conv="mamba_d_conv", chunk="mamba_chunk_size", conv_bias="mamba_conv_bias",
                  proj_bias="mamba_proj_bias", eps=eps, dt_limit=cfg.get("time_step_limit") or (0.0, float("inf")),
                  defaults=d)


def bamba(cfg: dict) -> HybridDims:
    """``BambaForCausalLM``: Mamba layers with attention at ``attn_layer_indices`` (RoPE on half of each
    head), each followed by a SwiGLU MLP."""
    hidden, n = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
    eps = float(cfg.get("rms_norm_eps", 1e-5))
    attn = set(cfg.get("attn_layer_indices") or [])
    mixers = tuple("attention" if i in attn else "mamba" for i in range(n))
    mamba = _mamba_prefixed(cfg, hidden, mixers.count("mamba"), eps)
    heads = int(cfg.get("num_attention_heads", 32))
    head_dim = hidden // heads
    theta, rot = _rope(cfg, head_dim, partial=0.5)  # transformers hard-codes Bamba's factor 0.5
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"hidden_act {act!r}: Bamba is implemented with silu")
    return HybridDims(
        architecture="BambaForCausalLM", vocab_size=int(cfg["vocab_size"]), hidden_size=hidden, mixers=mixers,
        ffns=("mlp",) * n, mamba=mamba if "mamba" in mixers else None,
        attention=AttentionDims(heads, _kv_heads(cfg, heads, 8), head_dim, head_dim ** -0.5,
                                bool(cfg.get("attention_bias", False)), theta, rot) if attn else None,
        mlp=MlpDims(int(cfg.get("intermediate_size", 14336)), True, act, bool(cfg.get("mlp_bias", False))), moe=None,
        eps=eps, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), eos_token_id=_eos(cfg),
        max_position_embeddings=cfg.get("max_position_embeddings"))
