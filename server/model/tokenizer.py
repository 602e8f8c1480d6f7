"""Tokenizer and chat template from a Hugging Face model directory."""

from __future__ import annotations

from pathlib import Path

from mambaserve.server.model.config import ModelLoadError


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    path = Path(path)
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise ModelLoadError(f"no tokenizer in {path}: expected tokenizer.json (and tokenizer_config.json)")
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers raises many types here; the message is what matters
        raise ModelLoadError(f"cannot load the tokenizer from {path}: {e}") from None


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> str:
    """The model's chat template applied to OpenAI-style messages (text content only)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template (tokenizer_config.json 'chat_template'): "
                         "use /v1/completions")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
