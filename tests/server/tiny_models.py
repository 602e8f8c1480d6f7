"""Tiny random-weight Mamba2 checkpoints built with transformers and saved as real files."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, decoders

SHAPES = {
    # heads not a power of two, chunk_size smaller than typical prompts, one group (state-spaces style)
    "h6_g1": dict(num_heads=6, head_dim=8, hidden_size=24, n_groups=1, state_size=8, chunk_size=8),
    # several groups
    "h8_g2": dict(num_heads=8, head_dim=4, hidden_size=16, n_groups=2, state_size=6, chunk_size=5),
    # conv width 2, 3 heads, odd chunk
    "h3_k2": dict(num_heads=3, head_dim=8, hidden_size=12, n_groups=1, state_size=4, chunk_size=7, conv_kernel=2),
}

VOCAB = 96


def byte_tokenizer() -> Tokenizer:
    """A real tokenizers.Tokenizer over bytes (ids 0..255 via a word-level vocab of single chars)."""
    chars = [chr(i) for i in range(32, 127)]
    vocab = {"<|endoftext|>": 0, **{c: i + 1 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    return tok


def make_checkpoint(path: Path, shape: str = "h6_g1", num_layers: int = 2, seed: int = 0,
                    chat_template: str | None = None, **overrides) -> Path:
    from transformers import Mamba2Config, Mamba2ForCausalLM

    kw = dict(SHAPES[shape])
    kw.update(overrides)
    kw.setdefault("conv_kernel", 4)
    expand = kw["num_heads"] * kw["head_dim"] // kw["hidden_size"]
    cfg = Mamba2Config(vocab_size=VOCAB, num_hidden_layers=num_layers, expand=expand, eos_token_id=0,
                       bos_token_id=0, pad_token_id=0, tie_word_embeddings=False, **kw)
    torch.manual_seed(seed)
    model = Mamba2ForCausalLM(cfg)
    with torch.no_grad():  # spread decays and gates so chunk boundaries and state matter
        for layer in model.backbone.layers:
            m = layer.mixer
            m.A_log.uniform_(-1.0, 1.5)
            m.dt_bias.uniform_(-2.0, 0.5)
            m.D.normal_()
            m.norm.weight.uniform_(0.5, 1.5)
            m.conv1d.weight.normal_(std=0.5)
    model.save_pretrained(path, safe_serialization=True)
    byte_tokenizer().save(str(path / "tokenizer.json"))
    tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
               "bos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "model_max_length": 4096}
    if chat_template:
        tok_cfg["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    return path
