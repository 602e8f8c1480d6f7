"""Constrained decoding in the engine: decode tokens/s with a JSON schema against the same batch unconstrained,
grammar compile time (the tokenizer's one-time setup, a new schema, the cache), and the time to first token of
a tool-call request (``tool_choice`` required's grammar) against a plain one.

Builds a random-weight Mamba2 of ``--size`` (benchmarks/e2e.py's shapes) and serves it in process (scheduler
thread, overlap scheduling, CUDA graphs on a GPU: the masks are applied on the logits, outside the graphs).
Its tokenizer: a 50,257-token byte-level BPE trained on the Python standard library (``grammar_engines.py``'s,
~30 s) unless ``--tokenizer`` names a ``tokenizer.json``; at ``--size tiny`` the bundled model's. Random
weights write random JSON inside the grammar: every step computes a real mask. Each row runs the constrained
and the unconstrained batch alternately (``--repeat`` times) and reports the median.

  python benchmarks/structured.py --size 2.7b --batches 1,64                    # GPU (the lead's run)
  python benchmarks/structured.py --size tiny --device cpu --batches 1,4 --tokens 16 --repeat 1   # CPU smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from e2e import SIZES, TOKENIZER, build_checkpoint  # noqa: E402 (the script's folder is on sys.path)
from grammar_engines import train_tokenizer  # noqa: E402

# what an extraction agent asks for: a list of records, open-ended (the model decides when it is done)
SCHEMA = {"type": "object", "properties": {"records": {"type": "array", "items": {
    "type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0},
        "name": {"type": "string", "maxLength": 40},
        "kind": {"type": "string", "enum": ["person", "place", "org", "event"]},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4}},
    "required": ["id", "name", "kind", "score", "tags"], "additionalProperties": False}}},
    "required": ["records"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string", "maxLength": 64}, "limit": {"type": "integer"}},
    "required": ["query", "limit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}]


async def run_batch(engine, prompts, params, grammar) -> tuple[float, int, list[float]]:
    """(seconds from the last first token to the last finish, tokens after each first one, TTFTs)."""
    t0 = time.perf_counter()
    firsts, ends, counts = [], [], []

    async def one(p):
        first, n = None, 0
        async for out in engine.generate(p, params, grammar=grammar):
            n += len(out.token_ids)
            if first is None and out.token_ids:
                first = time.perf_counter() - t0
        firsts.append(first)
        ends.append(time.perf_counter() - t0)
        counts.append(n - 1)

    await asyncio.gather(*(one(p) for p in prompts))
    return max(ends) - max(firsts), sum(counts), firsts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="2.7b", choices=sorted(SIZES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--tokens", type=int, default=256, help="new tokens per request (at most)")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--tokenizer", help="a tokenizer.json (default: a trained 50k BPE; the bundled one at tiny)")
    ap.add_argument("--json", help="write the results here too")
    a = ap.parse_args()
    from transformers import PreTrainedTokenizerFast

    from mambaserve.server.api import tool_calls
    from mambaserve.server.config import ServerConfig
    from mambaserve.server.engine.engine import Engine
    from mambaserve.server.engine.request import SamplingParams

    batches = [int(x) for x in a.batches.split(",")]
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    tmp = Path(tempfile.mkdtemp(prefix="mambaserve-structured-"))
    build_checkpoint(a.size, tmp, a.device, dtype)
    if a.tokenizer or a.size != "tiny":
        t = time.perf_counter()
        path = Path(a.tokenizer) if a.tokenizer else train_tokenizer(tmp)
        tok = PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token="<|endoftext|>")
        for f in ("tokenizer.json", "tokenizer_config.json"):
            (tmp / f).unlink(missing_ok=True)
        tok.save_pretrained(tmp)
        print(f"tokenizer: {len(tok)} tokens ({time.perf_counter() - t:.1f} s)", flush=True)
    engine = Engine(ServerConfig(model=str(tmp), device=a.device, dtype="bfloat16" if a.device == "cuda" else "float32",
                                 max_running_requests=max(batches), mamba_cache_size=max(batches) + 8,
                                 disable_radix_cache=True, context_length=a.prompt + a.tokens + 64,
                                 cuda_graph_max_bs=max(batches)))
    engine.start()
    vocab = engine.dims.vocab_size
    gen = torch.Generator().manual_seed(0)

    def prompts(n):
        return [torch.randint(1, len(engine.tokenizer), (a.prompt,), generator=gen).tolist() for _ in range(n)]

    res = {"size": a.size, "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
           "vocab": vocab, "tokenizer": len(engine.tokenizer)}
    # compile: the tokenizer's grammar form (once per server), a schema never seen, the same from the cache
    t = time.perf_counter()
    engine.grammars._tokenizer()
    res["tokenizer_setup_ms"] = (time.perf_counter() - t) * 1e3
    t = time.perf_counter()
    grammar = engine.grammars.compile("json_schema", json.dumps(SCHEMA))
    res["compile_first_ms"] = (time.perf_counter() - t) * 1e3
    t = time.perf_counter()
    engine.grammars.compile("json_schema", json.dumps(SCHEMA))
    res["compile_cached_ms"] = (time.perf_counter() - t) * 1e3
    plain = SamplingParams(max_new_tokens=a.tokens, temperature=1.0, ignore_eos=True)
    constrained = SamplingParams(max_new_tokens=a.tokens, temperature=1.0, ignore_eos=True,
                                 constraint=("json_schema", json.dumps(SCHEMA)))
    asyncio.run(run_batch(engine, prompts(2), plain, None))  # warm-up
    asyncio.run(run_batch(engine, prompts(2), constrained, grammar))
    res["decode"] = []
    for b in batches:
        rates = {"plain": [], "json_schema": []}
        for _ in range(a.repeat):
            for name, params, g in (("plain", plain, None), ("json_schema", constrained, grammar)):
                secs, tokens, _ = asyncio.run(run_batch(engine, prompts(b), params, g))
                rates[name].append(tokens / secs)
        row = {"batch": b, **{f"{k}_tokens_per_s": statistics.median(v) for k, v in rates.items()}}
        row["ratio"] = row["json_schema_tokens_per_s"] / row["plain_tokens_per_s"]
        res["decode"].append(row)
        print(row, flush=True)
    # a tool call's TTFT: the tool grammar compiled on first use (cold), then from the cache, against no grammar
    fmt = tool_calls.HERMES
    lark = tool_calls.grammar(TOOLS, fmt, True, tool_calls.special_tags(fmt, engine.tokenizer))
    tool = SamplingParams(max_new_tokens=8, temperature=1.0, constraint=("lark", lark))
    ttft = {}
    for name, params, compile_it in (("plain", SamplingParams(max_new_tokens=8, temperature=1.0), False),
                                     ("tool_call_cold", tool, True), ("tool_call_cached", tool, True)):
        t = time.perf_counter()
        g = engine.grammars.compile(*params.constraint) if compile_it else None
        compile_s = time.perf_counter() - t
        _, _, firsts = asyncio.run(run_batch(engine, prompts(1), params, g))
        ttft[name + "_ms"] = (compile_s + firsts[0]) * 1e3
    res["ttft"] = ttft
    engine.stop()
    print(f"\n{res['size']} on {res['device']}; vocabulary {vocab} (tokenizer {res['tokenizer']})")
    print(f"grammar: tokenizer setup {res['tokenizer_setup_ms']:.0f} ms (once per server); JSON schema compile "
          f"{res['compile_first_ms']:.1f} ms first use, {res['compile_cached_ms']:.3f} ms cached")
    print("| batch | unconstrained tok/s | JSON schema tok/s | ratio |\n| --- | --- | --- | --- |")
    for r in res["decode"]:
        print(f"| {r['batch']} | {r['plain_tokens_per_s']:.0f} | {r['json_schema_tokens_per_s']:.0f} | {r['ratio']:.2f} |")
    print("TTFT ms: " + ", ".join(f"{k[:-3]} {v:.1f}" for k, v in ttft.items()))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
