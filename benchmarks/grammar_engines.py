"""xgrammar against llguidance on the host, the measurement behind the server's choice of grammar engine.

For each engine installed: the one-time tokenizer setup, the compile time of a realistic JSON schema
(cold, then a second distinct schema of the same size), and the per-token mask time while a valid
instance of the schema is fed token by token (the host work of every constrained decode step), at a
~50k vocabulary. Without ``--tokenizer``, a 50,257-token byte-level BPE is trained on the Python standard
library first (about 30 s); ``--tokenizer tokenizer.json`` takes a real one.

  python benchmarks/grammar_engines.py
  python benchmarks/grammar_engines.py --tokenizer /path/to/tokenizer.json --repeat 5
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sysconfig
import tempfile
import time
from pathlib import Path

# an order a shop system receives: nested objects, arrays, enums, patterns, bounds, optional fields
SCHEMA = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
        "customer": {"type": "object", "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 80},
            "email": {"type": "string", "format": "email"},
            "tier": {"type": "string", "enum": ["free", "pro", "enterprise"]},
        }, "required": ["name", "email", "tier"], "additionalProperties": False},
        "items": {"type": "array", "minItems": 1, "maxItems": 20, "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "quantity": {"type": "integer", "minimum": 1, "maximum": 999},
            "unit_price": {"type": "number", "minimum": 0}, "gift": {"type": "boolean"},
        }, "required": ["sku", "quantity", "unit_price"], "additionalProperties": False}},
        "shipping": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {
            "street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string"},
            "country": {"type": "string", "enum": ["US", "DE", "FR", "JP", "BR"]},
        }, "required": ["street", "city", "country"], "additionalProperties": False}]},
        "notes": {"type": "string"},
    },
    "required": ["order_id", "customer", "items", "shipping"],
    "additionalProperties": False,
}
INSTANCE = {"order_id": "ORD-123456", "customer": {"name": "Ada Lovelace", "email": "ada@example.org", "tier": "pro"},
            "items": [{"sku": "KB-01", "quantity": 2, "unit_price": 49.5, "gift": False},
                      {"sku": "MS-77", "quantity": 1, "unit_price": 19.99}],
            "shipping": {"street": "12 Analytical Row", "city": "London", "country": "DE"},
            "notes": "Leave at the door, please."}


def variant(k: int) -> dict:
    """The schema with renamed properties: a distinct schema of the same size (no cache can answer it)."""
    s = copy.deepcopy(SCHEMA)
    s["properties"][f"extra_{k}"] = {"type": "integer"}
    return s


def train_tokenizer(out: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    def texts():
        for f in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
            try:
                yield f.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                pass

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts(), trainers.BpeTrainer(vocab_size=50257, special_tokens=["<|endoftext|>"],
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = out / "tokenizer.json"
    tok.save(str(path))
    return path


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def bench_xgrammar(hf, ids: list[int], repeat: int) -> dict:
    import torch
    import xgrammar as xgr

    t = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=len(hf), stop_token_ids=[hf.eos_token_id])
    setup = time.perf_counter() - t
    compiles = []
    for k in range(repeat):  # a fresh compiler each time: no cache
        compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        t = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(variant(k)), any_whitespace=False, separators=(",", ":"))
        compiles.append(time.perf_counter() - t)
    compiled = xgr.GrammarCompiler(info, max_threads=2).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))
    mask = xgr.allocate_token_bitmask(1, len(hf))
    per_token = []
    for _ in range(repeat):
        m = xgr.GrammarMatcher(compiled)
        for tok in ids:
            t = time.perf_counter()
            m.fill_next_token_bitmask(mask, 0)
            allowed = bool((mask[0, tok // 32] >> (tok % 32)) & 1)
            per_token.append(time.perf_counter() - t)
            assert allowed, "the instance's token is masked out"
            assert m.accept_token(tok)
        m.fill_next_token_bitmask(mask, 0)
        assert m.accept_token(hf.eos_token_id) and m.is_terminated()
    del torch
    return {"setup": setup, "compiles": compiles, "per_token": per_token}


def bench_llguidance(hf, ids: list[int], repeat: int) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch as llt

    t = time.perf_counter()
    tok = llguidance.hf.from_tokenizer(hf, n_vocab=len(hf))
    setup = time.perf_counter() - t
    opts = {"whitespace_flexible": False}
    compiles = []
    for k in range(repeat):  # its lexer is built lazily: construction plus the first mask is its compile
        mask = llt.allocate_token_bitmask(1, len(hf))
        t = time.perf_counter()
        m = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_json_schema(variant(k), defaults=opts))
        llt.fill_next_token_bitmask(m, mask, 0)
        compiles.append(time.perf_counter() - t)
        assert not m.is_error(), m.get_error()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults=opts)
    mask = llt.allocate_token_bitmask(1, len(hf))
    per_token = []
    for _ in range(repeat):
        m = llguidance.LLMatcher(tok, grammar)
        for t_id in ids:
            t = time.perf_counter()
            llt.fill_next_token_bitmask(m, mask, 0)
            allowed = bool((mask[0, t_id // 32] >> (t_id % 32)) & 1)
            per_token.append(time.perf_counter() - t)
            assert allowed, "the instance's token is masked out"
            assert m.consume_token(t_id), m.get_error()
        assert m.is_accepting()
    return {"setup": setup, "compiles": compiles, "per_token": per_token}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", help="a tokenizer.json (default: train a 50k BPE on the standard library)")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    from transformers import PreTrainedTokenizerFast

    with tempfile.TemporaryDirectory() as d:
        path = Path(args.tokenizer) if args.tokenizer else train_tokenizer(Path(d))
        hf = PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token="<|endoftext|>")
    ids = hf.encode(json.dumps(INSTANCE, separators=(",", ":")), add_special_tokens=False)
    print(f"vocabulary {len(hf)}; instance {len(ids)} tokens; {args.repeat} repeats")
    print("| engine | tokenizer setup ms | schema compile ms (cold, median) | mask ms/token p50 | p99 | mean |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, fn in (("xgrammar", bench_xgrammar), ("llguidance", bench_llguidance)):
        try:
            r = fn(hf, ids, args.repeat)
        except ImportError as e:
            print(f"| {name} | not installed ({e.name}) | | | | |")
            continue
        pt = sorted(r["per_token"])
        print(f"| {name} | {ms(r['setup'])} | {ms(statistics.median(r['compiles']))} | "
              f"{ms(pt[len(pt) // 2])} | {ms(pt[int(len(pt) * 0.99)])} | {ms(statistics.fmean(pt))} |")


if __name__ == "__main__":
    main()
