"""Tiny random-weight hybrid checkpoints (Nemotron-H, Granite 4.0-H dense and MoE, Bamba) built with
transformers and saved as real files: the oracle and the server load the same safetensors."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.server.tiny_models import VOCAB, byte_tokenizer


def _oracle_groups_gated_norm() -> bool:
    """Whether the installed transformers normalizes Bamba's and Granite 4.0-H's gated RMSNorm per group of
    ``intermediate_size // n_groups`` channels, as mamba_ssm (and this server) do. transformers 5.17 does not
    (one norm over the whole width; grouped by 5.23): there those two families' checkpoints take one group, for
    which both agree, so the rest of their parity still runs against that version."""
    import inspect

    from transformers.models.bamba import modeling_bamba

    return "group_size" in inspect.signature(modeling_bamba.BambaRMSNormGated.__init__).parameters


# Every family's Mamba layers have 2 groups (an ungrouped gated norm shows; Bamba and Granite only where the
# oracle groups too: _oracle_groups_gated_norm) and 8-token chunks.
FAMILIES = {
    # M * - E M *: every mixer kind; MoE with grouped sigmoid routing, a correction bias and a latent width;
    # head_dim 8 != 16/4
    "nemotron_h": lambda: _nemotron(["linear_attention", "full_attention", "mlp", "moe", "linear_attention",
                                     "full_attention"]),
    # Granite 4.0-H tiny's layout: MoE + shared MLP twice the experts' width (so decode runs it folded into the MoE
    # op as two more experts, as at the real shape), no position embedding, every multiplier != 1
    "granite_moe": lambda: _granite(num_local_experts=4, position_embedding_type=None, shared_intermediate_size=24),
    # dense Granite (no experts) with RoPE and the embedding tied to the LM head (as Granite 4.0 ships)
    "granite_dense_rope": lambda: _granite(num_local_experts=0, position_embedding_type="rope",
                                           tie_word_embeddings=True),
    # Bamba: attention with RoPE on half of each head
    "bamba": lambda: _bamba(),
}

# Beside the families (not in every family-parametrized test): Nemotron-H-8B's kinds of layer, no MoE, so
# its decode is captured in CUDA graphs (attention without RoPE)
VARIANTS = {
    "nemotron_h_dense": lambda: _nemotron(["linear_attention", "full_attention", "mlp", "linear_attention", "mlp",
                                           "full_attention"]),
}


def _nemotron(layers):
    from transformers import NemotronHConfig, NemotronHForCausalLM

    cfg = NemotronHConfig(vocab_size=VOCAB, hidden_size=16, layers_block_type=layers, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=8, intermediate_size=24, mamba_num_heads=4, mamba_head_dim=8,
                          n_groups=2, ssm_state_size=8, chunk_size=8, n_routed_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=12, moe_shared_expert_intermediate_size=10, n_group=2, topk_group=1,
                          routed_scaling_factor=1.5, moe_latent_size=12, eos_token_id=0, bos_token_id=0, pad_token_id=0)
    return NemotronHForCausalLM, cfg


def _mamba_groups() -> int:
    return 2 if _oracle_groups_gated_norm() else 1


def _granite(**kw):
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    kw = dict(shared_intermediate_size=10) | kw
    cfg = GraniteMoeHybridConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=4,
        layer_types=["mamba", "attention", "mamba", "attention"], num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=12, num_experts_per_tok=2, mamba_n_heads=4, mamba_d_state=8,
        mamba_n_groups=_mamba_groups(), mamba_chunk_size=8, embedding_multiplier=3.0, residual_multiplier=0.6,
        attention_multiplier=0.4, logits_scaling=1.7, eos_token_id=0, bos_token_id=0, pad_token_id=0, **kw)
    return GraniteMoeHybridForCausalLM, cfg


def _bamba():
    from transformers import BambaConfig, BambaForCausalLM

    cfg = BambaConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=3, attn_layer_indices=[1],
                      num_attention_heads=2, num_key_value_heads=1, intermediate_size=12, mamba_n_heads=4,
                      mamba_d_state=8, mamba_n_groups=_mamba_groups(), mamba_chunk_size=8, eos_token_id=0,
                      bos_token_id=0, pad_token_id=0)
    return BambaForCausalLM, cfg


def make_hybrid_checkpoint(path: Path, family: str, seed: int = 0, chunk_size: int | None = None) -> Path:
    """``chunk_size``: the Mamba layers' scan chunk (default 8; the GPU tests take 16 so the Triton scan runs)."""
    cls, cfg = {**FAMILIES, **VARIANTS}[family]()
    if chunk_size is not None:
        setattr(cfg, "chunk_size" if family.startswith("nemotron_h") else "mamba_chunk_size", chunk_size)
    torch.manual_seed(seed)
    model = cls(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log",)):
                p.uniform_(-1.0, 1.5)
            elif name.endswith("dt_bias"):
                # some heads far below 0: softplus < Nemotron-H's time_step_min, so its dt clamp matters
                p.uniform_(-2.0, 0.5)
                p[0] = -8.0
            elif name.endswith(".D"):
                p.normal_()
            elif name.endswith("conv1d.weight"):
                p.normal_(std=0.5)
            elif "norm" in name and name.endswith("weight"):
                p.uniform_(0.5, 1.5)
            elif p.dim() >= 2:
                p.normal_(std=0.3)  # larger than the init so attention and routing are far from uniform
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(std=0.2)
    model.save_pretrained(path, safe_serialization=True)
    byte_tokenizer().save(str(path / "tokenizer.json"))
    tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
               "bos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "model_max_length": 4096}
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    return path
