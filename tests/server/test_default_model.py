"""The bundled default model (models/mamba2-tiny-pystdlib) is an ordinary Hugging Face checkpoint.

`make serve` points at this directory, so these tests guard what a fresh clone relies on: plain
transformers can load it offline, it is within the repository's size budget, its tokenizer and chat
template work, and it has actually learned Python (it is not random weights).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "mamba2-tiny-pystdlib"
SIZE_BUDGET = 10 * 1000 * 1000  # bytes, issue 2: "≤ 10 MB"

# Written for this test, so it is held out by construction: not in any Python's stdlib.
SNIPPET = '''import os


def find_files(root, suffix=".py"):
    """Return a sorted list of the files under root that end with suffix."""
    result = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames:
            if name.endswith(suffix):
                result.append(os.path.join(dirpath, name))
    result.sort()
    return result


class Counter:
    def __init__(self, start=0):
        self.value = start

    def increment(self, step=1):
        self.value += step
        return self.value
'''


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL_DIR, local_files_only=True)


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    # float32 on CPU: the checkpoint is bf16, but CPU bf16 matmuls are slow and less exact.
    m = AutoModelForCausalLM.from_pretrained(MODEL_DIR, local_files_only=True, dtype=torch.float32)
    return m.eval()


def test_files_and_size_budget():
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "README.md"):
        assert (MODEL_DIR / name).is_file(), name
    size = (MODEL_DIR / "model.safetensors").stat().st_size
    assert size <= SIZE_BUDGET, f"model.safetensors is {size} bytes"


def test_config_is_plain_json_mamba2():
    # Python's json accepts the non-standard Infinity/NaN tokens; fail on them, since stricter
    # parsers (and other transformers releases) do not read them the same way.
    raw = json.loads((MODEL_DIR / "config.json").read_text(), parse_constant=lambda c: pytest.fail(c))
    assert raw["model_type"] == "mamba2"
    assert raw["n_groups"] == 1
    assert raw["tie_word_embeddings"] is True
    assert raw["num_heads"] * raw["head_dim"] == raw["expand"] * raw["hidden_size"]


def test_loads_with_transformers(model, tokenizer):
    from transformers import Mamba2ForCausalLM

    assert isinstance(model, Mamba2ForCausalLM)
    cfg = model.config
    assert cfg.model_type == "mamba2" and cfg.n_groups == 1
    assert cfg.vocab_size == len(tokenizer) == 4096
    assert tokenizer.eos_token == "<|endoftext|>"
    assert cfg.eos_token_id == cfg.bos_token_id == cfg.pad_token_id == tokenizer.eos_token_id
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id


def test_tokenizer_round_trips_python_source(tokenizer):
    for text in (SNIPPET, Path(__file__).read_text(), "s = 'naïve café ≤ 10 MB 🐍'\n\tx = 1\r\n"):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text
    # Byte-level BPE trained on Python should compress code well (≈3.5 chars per token).
    ids = tokenizer(SNIPPET)["input_ids"]
    assert len(SNIPPET) / len(ids) > 2.5
    assert tokenizer.eos_token_id not in ids  # no bos/eos added to plain prompts


def test_chat_template_renders(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|system|>\nBe brief.<|endoftext|>\n<|user|>\nhi<|endoftext|>\n<|assistant|>\n"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    role_ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<|system|>", "<|user|>", "<|assistant|>")]
    assert all(i in ids for i in role_ids)  # role markers are single special tokens, not split text
    no_prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert not no_prompt.endswith("<|assistant|>\n")


def test_model_has_learned_python(model, tokenizer):
    ids = torch.tensor([tokenizer(SNIPPET)["input_ids"]])
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
    ce = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]).item()
    uniform = math.log(model.config.vocab_size)  # 8.32 nats: what random weights give
    # The trained model scores ~2.5 nats/token on this snippet; 0.5 * uniform leaves wide headroom
    # while still failing for an untrained or mismatched checkpoint (~8.3).
    assert ce < 0.5 * uniform, f"mean cross-entropy {ce:.2f} vs uniform {uniform:.2f}"


def test_greedy_generation_looks_like_python(model, tokenizer):
    prompt = tokenizer("def ", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=24, do_sample=False,
                             pad_token_id=tokenizer.eos_token_id)
    continuation = tokenizer.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
    assert len(continuation.strip()) > 10, repr(continuation)
    assert any(s in continuation for s in ("(", ":", "return", "self")), repr(continuation)
