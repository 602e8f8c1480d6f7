"""Tokenizer and chat template from a Hugging Face model directory."""

from __future__ import annotations

from pathlib import Path

from mambaserve.server.model.config import ModelLoadError


def load_tokenizer(path: str | Path):
    """From a model or tokenizer directory, or a single ``tokenizer.json`` file (``--tokenizer``)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = Path(path)
    if path.is_file():
        try:
            tok = PreTrainedTokenizerFast(tokenizer_file=str(path))
        except Exception as e:  # the tokenizers library raises its own exception types
            raise ModelLoadError(f"cannot load the tokenizer file {path}: {e}") from None
        if tok.eos_token is None and "<|endoftext|>" in tok.get_vocab():
            tok.eos_token = "<|endoftext|>"  # a bare tokenizer.json names no EOS: GPT-NeoX's and GPT-2's is this
        return tok
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise ModelLoadError(f"no tokenizer in {path}: expected tokenizer.json (and tokenizer_config.json); pass "
                             "--tokenizer DIR_OR_TOKENIZER_JSON (state-spaces/mamba2-* checkpoints use "
                             "EleutherAI/gpt-neox-20b's tokenizer)")
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers raises many types here; the message is what matters
        raise ModelLoadError(f"cannot load the tokenizer from {path}: {e}") from None


def encode(tokenizer, text: str) -> list[int]:
    """``tokenizer.encode(text, add_special_tokens=False)``; for a fast tokenizer, its Rust backend called directly,
    which releases the interpreter lock while it tokenizes. Through transformers' wrapper a thread spinning beside
    it lost 1.26 ms per call on a 1,100-token prompt (1.17 ms a call: the lock held throughout), through the backend
    0.52 ms (2 cores); the scheduler thread waits for the lock the same way. The backend is used as transformers
    leaves it (its special tokens matched, ``split_special_tokens`` set at load); one that a tokenizer.json set to
    truncate or pad goes through the wrapper, which turns both off."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    fast = getattr(backend, "encode_batch_fast", None)
    if fast is None or backend.truncation is not None or backend.padding is not None:
        return tokenizer.encode(text, add_special_tokens=False)
    return fast([text], add_special_tokens=False)[0].ids


def render_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True,
                **template_args) -> str:
    """The model's chat template applied to OpenAI-style messages (text content only); ``tools`` (OpenAI's
    function definitions) go to the template's ``tools`` variable, ``template_args`` to its other variables
    (``continue_final_message``, a request's ``chat_template_kwargs``). ValueError: no template, or the
    template refused the conversation."""
    import jinja2

    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template (tokenizer_config.json 'chat_template'): "
                         "use /v1/completions")
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=add_generation_prompt, **template_args)
    except jinja2.TemplateError as e:  # (raise_exception() in a template: a role order it does not take, ...)
        raise ValueError(f"the chat template refused the messages: {e}") from None
