#!/usr/bin/env python3
"""Train the byte-level BPE tokenizer of the bundled default model.

The corpus is the running Python's own standard library source, because that text is present on
every machine that can run this project: anyone can rebuild the tokenizer (and the model, see
train_default_model.py) without downloading data.

    python scripts/train_tokenizer.py --out models/mamba2-tiny-pystdlib

Writes tokenizer.json and tokenizer_config.json into --out. The corpus helpers here are imported by
train_default_model.py so that tokenizer and model see exactly the same files.
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
import time
from pathlib import Path

EOS = "<|endoftext|>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
# Order fixes the ids: <|endoftext|> = 0, then the role tokens 1..3. The model's bos/eos/pad ids
# come from here, so changing the order means retraining the model.
SPECIAL_TOKENS = [EOS, *ROLE_TOKENS]
VOCAB_SIZE = 4096
MODEL_MAX_LENGTH = 2048

# Test suites are large, repetitive and full of deliberately odd code (bad encodings, syntax
# errors); site-packages is whatever happens to be installed, so it would make the corpus depend on
# the machine.
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}

# One line per message, each ended by <|endoftext|> so that a generated assistant turn stops on eos.
# Unknown roles fall back to <|user|> rather than raising: the template is rendered by plain Jinja
# in the server as well as by transformers, and only transformers provides raise_exception.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] in ['system', 'user', 'assistant'] %}"
    "{{ '<|' + message['role'] + '|>' }}"
    "{% else %}{{ '<|user|>' }}{% endif %}"
    "{{ '\\n' + message['content'] + '<|endoftext|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_sources(root: Path | None = None) -> list[tuple[str, str]]:
    """(relative posix path, text) of every stdlib .py file outside test folders, sorted by path.

    Sorting makes the corpus order independent of the file system's listing order, so two runs on
    the same Python give byte-identical input.
    """
    root = root or stdlib_dir()
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if SKIP_DIRS.intersection(rel.parts[:-1]):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            # A handful of files are Latin-1 on purpose; skipping them is simpler than guessing.
            continue
        files.append((rel.as_posix(), text))
    files.sort(key=lambda item: item[0])
    if len(files) < 100:
        sys.exit(f"only {len(files)} .py files under {root}: is the standard library source installed?")
    return files


def build_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    # add_prefix_space=False keeps "def" at the start of a file the same token sequence as the
    # prompt "def" typed by a user; byte-level means any text (including non-ASCII) round-trips.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def tokenizer_config() -> dict:
    # add_bos_token=False: the model is trained on documents separated (not prefixed) by
    # <|endoftext|>, so a prompt should be encoded exactly as its text.
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "unk_token": None,
        "additional_special_tokens": ROLE_TOKENS,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "chat_template": CHAT_TEMPLATE,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="models/mamba2-tiny-pystdlib", help="model directory to write into")
    ap.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    ap.add_argument("--stdlib", type=Path, default=None, help="corpus root (default: this Python's stdlib)")
    args = ap.parse_args()

    t0 = time.time()
    files = stdlib_sources(args.stdlib)
    texts = [text for _, text in files]
    print(f"corpus: {len(files)} files, {sum(map(len, texts)) / 1e6:.1f} M chars from {args.stdlib or stdlib_dir()}")
    tok = build_tokenizer(texts, args.vocab_size)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")

    for tok_str in SPECIAL_TOKENS:
        print(f"  {tok_str!r} -> {tok.token_to_id(tok_str)}")
    n_tokens = sum(len(e.ids) for e in tok.encode_batch(texts))
    print(
        f"vocab {tok.get_vocab_size()}, corpus = {n_tokens / 1e6:.2f} M tokens "
        f"({sum(map(len, texts)) / n_tokens:.2f} chars/token), {time.time() - t0:.0f}s -> {out}"
    )


if __name__ == "__main__":
    main()
