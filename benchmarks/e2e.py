"""End-to-end engine speed on random-weight Mamba2 and hybrid models of real sizes, beside transformers.

Builds a random-weight `Mamba2ForCausalLM` of the chosen size in place (saved as a real checkpoint),
serves it with the in-process engine (scheduler thread, CUDA graphs, Triton kernels; no HTTP), and
prints in the same run:
  decode tokens/s at several batch sizes (the best of --repeats batches), and the memory-bandwidth bound for each
    (weights + per-request state read and written per step / measured device copy bandwidth);
    with overlap scheduling and, as the in-run baseline, without it (--disable-overlap-schedule);
  prefill tokens/s; TTFT of one 2k and one 8k prompt;
  transformers' `generate` on the same weights (its torch path) as the baseline.

Hybrid shapes (nemotron-h-8b, granite-4.0-h-tiny: `hybrid_step.SHAPES`) take a hybrid path: transformers
first (its decode step per batch, the difference of two `generate` lengths so its prefill is left out,
and one forward over the prefill batch), its model freed, then the engine (decode from CUDA graphs, MoE models'
too; radix cache off); one table with the ratios. Prefill is also set against a FLOP bound
(2 x the weights a token multiplies: experts by top_k / E, no embedding; attention and scan FLOPs not
counted) at ``--peak-tflops``.

  python benchmarks/e2e.py --size 130m
  python benchmarks/e2e.py --size 2.7b --batches 1,8,64,256
  python benchmarks/e2e.py --size nemotron-h-8b --checkpoint /tmp/nemotron-h-8b   # builds it once, then reuses it
  python benchmarks/e2e.py --size granite-tiny --device cpu                          # a smoke run of the hybrid path
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from hybrid_step import SHAPES, decode_bytes  # noqa: E402 (the script's folder is on sys.path)

SIZES = {  # mamba2-130m / mamba2-2.7b dimensions (state-spaces checkpoints: n_groups 1, vocab 50288)
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_heads=4, head_dim=32, state_size=16, vocab_size=4096,
                 chunk_size=64),
    "130m": dict(hidden_size=768, num_hidden_layers=24, num_heads=24, head_dim=64, state_size=128, vocab_size=50288,
                 chunk_size=256),
    "2.7b": dict(hidden_size=2560, num_hidden_layers=64, num_heads=80, head_dim=64, state_size=128, vocab_size=50288,
                 chunk_size=256),
}
TOKENIZER = Path(__file__).resolve().parents[1] / "models" / "mamba2-tiny-pystdlib"
# hybrid shapes: (architecture, transformers config kwargs)
HYBRIDS = {
    "nemotron-h-8b": SHAPES["nemotron-h-8b"],
    "granite-4.0-h-tiny": SHAPES["granite-4.0-h-tiny"],
    "granite-tiny": SHAPES["tiny"],
    "nemotron-tiny": ("NemotronHForCausalLM", dict(
        vocab_size=512, hidden_size=64, hybrid_override_pattern="M-*M-", mamba_num_heads=4, mamba_head_dim=32,
        n_groups=2, ssm_state_size=16, chunk_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=96)),
}


def build_checkpoint(size: str, out: Path, device: str, dtype: torch.dtype):
    from transformers import Mamba2Config, Mamba2ForCausalLM

    cfg = Mamba2Config(n_groups=1, expand=2, conv_kernel=4, tie_word_embeddings=True, eos_token_id=0,
                       bos_token_id=0, pad_token_id=0, **SIZES[size])
    torch.manual_seed(0)
    with torch.device(device):
        model = Mamba2ForCausalLM(cfg).to(dtype).eval()
    model.save_pretrained(out, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / f, out / f)
    return model


def tokenizer_size() -> int:
    """Token ids of the bundled tokenizer, which the built checkpoints ship."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(TOKENIZER / "tokenizer.json")).get_vocab_size()


def build_hybrid_checkpoint(size: str, out: Path, device: str, dtype: torch.dtype):
    """A random-weight transformers model of the shape, saved with the bundled tokenizer; returns it. Its vocabulary
    holds every id of that tokenizer (a tiny shape's 512 rows answered every text request with 400 "token ids out
    of range"); the real shapes' are larger already."""
    import transformers

    arch, kw = HYBRIDS[size]
    kw = {**kw, "vocab_size": max(kw["vocab_size"], tokenizer_size())}
    model_type = {"NemotronHForCausalLM": "nemotron_h", "GraniteMoeHybridForCausalLM": "granitemoehybrid"}[arch]
    cfg = transformers.AutoConfig.for_model(model_type, eos_token_id=0, bos_token_id=0, pad_token_id=0, **kw)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    model.save_pretrained(out, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / f, out / f)
    return model


def copy_bandwidth(device: str, trials: int = 5) -> float:
    """Bytes read + written per second by a large device-to-device copy: the best of ``trials`` timings
    (CUDA events, 5 copies each). One wall-clock timing varied from 2.78 to 3.00 TB/s between processes
    on the same H100, and a low reading makes every "x the bound" ratio look better than it is."""
    if device != "cuda":
        return float("nan")
    a = torch.empty(1 << 28, dtype=torch.float32, device=device)  # 1 GiB
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    best_ms = float("inf")
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            b.copy_(a)
        end.record()
        end.synchronize()
        best_ms = min(best_ms, start.elapsed_time(end) / 5)
    return 2 * a.numel() * 4 / (best_ms * 1e-3)


async def timed_batch(engine, prompts, max_new: int):
    """Run requests together; returns (first-token times, finish times) relative to the start."""
    from mambaserve.server.engine.request import SamplingParams

    params = SamplingParams(max_new_tokens=max_new, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    firsts, ends = [], []

    async def one(p):
        first = None
        async for out in engine.generate(p, params):
            if first is None and out.token_ids:
                first = time.perf_counter() - t0
        firsts.append(first)
        ends.append(time.perf_counter() - t0)

    await asyncio.gather(*(one(p) for p in prompts))
    return firsts, ends


def decode_step_ms(engine, prompts, new: int, overlap: bool, repeats: int) -> float:
    """ms per decode step of ``prompts()`` (a fresh batch each time) run together: (last finish - last first
    token) / (new - 1), the best of ``repeats`` batches (a step's time is what the device allows; a slower batch
    met something else on the host)."""
    engine.scheduler.overlap = overlap  # the scheduler reads the flag between steps; it is idle here
    best = float("inf")
    for _ in range(repeats):
        firsts, ends = asyncio.run(timed_batch(engine, prompts(), new))
        best = min(best, (max(ends) - max(firsts)) / (new - 1) * 1e3)
    return best


def prefill_and_ttft(engine, prompts, n_req: int, n_tok: int, ttft_lens: list[int]) -> tuple[float, list[dict]]:
    """Prefill tokens/s of ``n_req`` x ``n_tok`` prompts at once, and the TTFT of one prompt per length
    (each after a warm-up run of its shape: kernels compile per shape class)."""
    asyncio.run(timed_batch(engine, prompts(n_req, n_tok), 1))
    _, ends = asyncio.run(timed_batch(engine, prompts(n_req, n_tok), 1))
    tps = n_req * n_tok / max(ends)
    print(f"prefill {n_req}x{n_tok}: {tps:10.1f} tok/s", flush=True)
    ttft = []
    for n in ttft_lens:
        asyncio.run(timed_batch(engine, prompts(1, n), 1))
        firsts, _ = asyncio.run(timed_batch(engine, prompts(1, n), 1))
        ttft.append({"prompt": n, "ttft_ms": firsts[0] * 1e3})
        print(f"TTFT {n:5}-token prompt: {firsts[0] * 1e3:8.1f} ms", flush=True)
    return tps, ttft


def hf_generate_tps(model, batch: int, prompt_len: int, new: int, vocab: int, device: str) -> float:
    ids = torch.randint(1, vocab, (batch, prompt_len), device=device)
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids[:, :8], max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        model.generate(ids, **kw)
        if device == "cuda":
            torch.cuda.synchronize()
    return batch * new / (time.perf_counter() - t)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def hf_decode_step_s(model, batch: int, prompt_len: int, vocab: int, device: str, steps: int) -> float:
    """Seconds per decode step of transformers' ``generate``: (time for 2 + ``steps`` tokens - time for
    2) / ``steps``, so its prefill of the prompt is not counted."""
    ids = torch.randint(1, vocab, (batch, prompt_len), device=device)

    def gen(n: int) -> float:
        _sync(device)
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)
        _sync(device)
        return time.perf_counter() - t

    gen(2)  # warm-up
    step = (min(gen(2 + steps) for _ in range(2)) - min(gen(2) for _ in range(2))) / steps  # best of 2: less noise
    if step <= 0:
        print(f"transformers b={batch}: {steps} decode steps took less than the timing noise; raise --hf-tokens")
        return float("nan")
    return step


def hf_prefill_tps(model, n_req: int, n_tok: int, vocab: int, device: str, piece: int | None = None) -> float:
    """Prompt tokens/s of transformers forwards over ``n_req`` x ``n_tok`` tokens (last logits only), ``piece``
    requests a forward (default all at once)."""
    piece = piece or n_req
    ids = torch.randint(1, vocab, (n_req, n_tok), device=device)
    with torch.no_grad():
        model(ids[:1, :64], use_cache=False, logits_to_keep=1)  # warm-up
        _sync(device)
        t = time.perf_counter()
        for i in range(0, n_req, piece):
            model(ids[i:i + piece], use_cache=False, logits_to_keep=1)
        _sync(device)
    return n_req * n_tok / (time.perf_counter() - t)


def unless_oom(device: str, fn, *args):
    """``fn(*args)``, or None where it ran out of device memory, the memory it held given back (transformers'
    pure-torch scan at batch 64 and at 8 x 2,048 ran an H100 out of memory before any engine number)."""
    try:
        return fn(*args)
    except torch.cuda.OutOfMemoryError:
        pass  # (leaving the except block drops the traceback, and with it the frames' tensors)
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return None


def hf_prefill_fitting(model, n_req: int, n_tok: int, vocab: int, device: str) -> tuple[float | None, int]:
    """(transformers' prefill tokens/s, requests per forward): all at once, else in halves, quarters... that fit
    (None, 0: not even one request fits)."""
    piece = n_req
    while piece >= 1:
        tps = unless_oom(device, hf_prefill_tps, model, n_req, n_tok, vocab, device, piece)
        if tps is not None:
            return tps, piece
        print(f"transformers prefill {piece}x{n_tok}: out of memory", flush=True)
        piece //= 2
    return None, 0


def matmul_params_per_token(model, dims) -> int:
    """Weights a prompt token multiplies in the engine's model: every 2-D+ weight but the embedding and
    LM head (prefill computes logits for last tokens only), the routed experts scaled by top_k / E."""
    total = 0
    for name, p in model.named_parameters():
        if p.dim() < 2 or "embed" in name or "lm_head" in name or "conv1d" in name:
            continue
        if dims.moe and (p.dim() == 3 or ".experts." in name):  # routed experts ([E, ...] stacked)
            total += p.numel() * dims.moe.top_k // dims.moe.num_experts
        else:
            total += p.numel()
    return total


def run_hybrid(a: argparse.Namespace) -> dict:
    """transformers first, then the engine on the same checkpoint (never both in device memory)."""
    from mambaserve.server.config import ServerConfig
    from mambaserve.server.engine.engine import Engine

    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    vocab = HYBRIDS[a.size][1]["vocab_size"]
    batches = [int(x) for x in a.batches.split(",")]
    hf_batches = [int(x) for x in (a.hf_batches or a.batches).split(",")]
    n_req, n_tok = (int(x) for x in a.prefill.split("x"))
    ttft_lens = [int(x) for x in a.ttft.split(",")] if a.ttft else []
    prompt_len = 32
    ckpt = Path(a.checkpoint) if a.checkpoint else Path(tempfile.mkdtemp(prefix="mambaserve-e2e-"))
    t = time.perf_counter()
    if (ckpt / "config.json").exists():
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype).to(a.device).eval()  # (device_map needs accelerate)
        print(f"loaded {ckpt} into transformers in {time.perf_counter() - t:.1f} s", flush=True)
    else:
        hf = build_hybrid_checkpoint(a.size, ckpt, a.device, dtype)
        print(f"built random {a.size} checkpoint at {ckpt} in {time.perf_counter() - t:.1f} s", flush=True)
    torch.manual_seed(0)
    res = {"size": a.size, "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
           "hf": [], "decode": [], "prefill": None, "ttft": []}
    for b in hf_batches:
        step = unless_oom(a.device, hf_decode_step_s, hf, b, prompt_len, vocab, a.device, a.hf_tokens)
        if step is None:
            res["hf"].append({"batch": b, "oom": True})
            print(f"transformers decode b={b:4}: out of memory", flush=True)
            continue
        res["hf"].append({"batch": b, "step_ms": step * 1e3, "tokens_per_s": b / step})
        print(f"transformers decode b={b:4}: {b / step:10.1f} tok/s, {step * 1e3:8.2f} ms/step", flush=True)
    hf_prefill, hf_piece = hf_prefill_fitting(hf, n_req, n_tok, vocab, a.device)
    if hf_prefill is not None:
        print(f"transformers prefill {n_req}x{n_tok}" + (f" ({hf_piece} a forward)" if hf_piece < n_req else "")
              + f": {hf_prefill:10.1f} tok/s", flush=True)
    del hf
    gc.collect()
    if a.device == "cuda":
        torch.cuda.empty_cache()

    ctx = max([n_tok, *ttft_lens, prompt_len]) + a.decode_tokens + 64
    t = time.perf_counter()
    running = max(batches + [n_req])
    engine = Engine(ServerConfig(model=str(ckpt), device=a.device, dtype="bfloat16" if a.device == "cuda" else "float32",
                                 max_running_requests=running, mamba_cache_size=running, chunked_prefill_size=8192,
                                 disable_radix_cache=True, context_length=ctx, cuda_graph_max_bs=max(batches),
                                 kernel_cache_dir=a.kernel_cache_dir))
    engine.start()
    print(f"engine ready in {time.perf_counter() - t:.1f} s (CUDA graphs captured: "
          f"{engine.scheduler.runner.graphs is not None}); {engine.pool.allocator.capacity} state slots, "
          f"{engine.kv_pool.allocator.capacity if engine.kv_pool else 0} KV pages", flush=True)
    bw = copy_bandwidth(a.device)
    res["copy_bandwidth_GBps"] = bw / 1e9
    gen = torch.Generator().manual_seed(0)

    def prompts(n, length):
        return [torch.randint(1, vocab, (length,), generator=gen).tolist() for _ in range(n)]

    asyncio.run(timed_batch(engine, prompts(2, 16), 4))  # warm-up
    engine.mark_ready()  # compiles from here on are counted as serving's: they should not happen
    context = prompt_len + a.decode_tokens // 2  # the decode window's mean KV length
    for b in batches:
        bound = decode_bytes(engine.model, engine.dims, b, context, engine.pool, engine.kv_pool) / bw
        row = {"batch": b, "bound_ms": bound * 1e3}
        if a.sequential_baseline:
            row["sequential_step_ms"] = decode_step_ms(engine, lambda: prompts(b, prompt_len), a.decode_tokens,
                                                       False, a.repeats)
        row["step_ms"] = decode_step_ms(engine, lambda: prompts(b, prompt_len), a.decode_tokens, True, a.repeats)
        row["tokens_per_s"] = b / row["step_ms"] * 1e3
        res["decode"].append(row)
        print(f"decode b={b:4}: {row['tokens_per_s']:10.1f} tok/s, {row['step_ms']:8.2f} ms/step"
              + (f" (without overlap {row['sequential_step_ms']:8.2f})" if a.sequential_baseline else ""), flush=True)
    tps, res["ttft"] = prefill_and_ttft(engine, prompts, n_req, n_tok, ttft_lens)
    flops = 2 * matmul_params_per_token(engine.model, engine.dims) * tps
    res["prefill"] = {"requests": n_req, "tokens": n_tok, "tokens_per_s": tps, "hf_tokens_per_s": hf_prefill,
                      "hf_requests_per_forward": hf_piece, "matmul_tflops": flops / 1e12,
                      "peak_share": flops / 1e12 / a.peak_tflops}
    res["kernel_compiles"] = dict(engine.compiles)
    res["startup_s"] = dict(engine.startup)
    engine.stop()
    print_hybrid_table(res, a.peak_tflops)
    if not a.checkpoint:
        shutil.rmtree(ckpt, ignore_errors=True)
    return res


def print_hybrid_table(res: dict, peak_tflops: float) -> None:
    hf = {r["batch"]: r for r in res["hf"] if not r.get("oom")}
    oom = {r["batch"] for r in res["hf"] if r.get("oom")}
    print(f"\n{res['size']} on {res['device']} (copy bandwidth {res['copy_bandwidth_GBps']:.0f} GB/s)")
    print("| decode batch | mambaserve tok/s | ms/step | bound ms | x bound | transformers tok/s | x transformers |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in res["decode"]:
        h = hf.get(r["batch"])
        x_bound = r["step_ms"] / r["bound_ms"] if r["bound_ms"] == r["bound_ms"] else float("nan")
        print(f"| {r['batch']} | {r['tokens_per_s']:.1f} | {r['step_ms']:.2f} | {r['bound_ms']:.3f} | {x_bound:.2f} | "
              + (f"{h['tokens_per_s']:.1f} | {r['tokens_per_s'] / h['tokens_per_s']:.1f}x |" if h else
                 "out of memory | — |" if r["batch"] in oom else "— | — |"))
    p = res["prefill"]
    hf_prefill = (f"{p['hf_tokens_per_s']:.0f}" + (f" ({p['hf_requests_per_forward']} a forward)"
                                                   if p["hf_requests_per_forward"] != p["requests"] else "")
                  + f" | {p['tokens_per_s'] / p['hf_tokens_per_s']:.1f}x |" if p["hf_tokens_per_s"] else
                  "out of memory | — |")
    print(f"| prefill {p['requests']}x{p['tokens']} | {p['tokens_per_s']:.0f} tok/s | {p['matmul_tflops']:.1f} TFLOP/s "
          f"(weights) = {p['matmul_tflops'] / peak_tflops:.2f} of {peak_tflops:g} | | | " + hf_prefill)
    for r in res["ttft"]:
        print(f"| TTFT {r['prompt']} tokens | {r['ttft_ms']:.1f} ms | | | | | |")
    print(f"kernel compiles: {res['kernel_compiles']['warmup']} before ready, {res['kernel_compiles']['serving']} after "
          f"(start: " + ", ".join(f"{k} {v:.1f} s" for k, v in res["startup_s"].items()) + ")")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="130m", choices=sorted(SIZES) + sorted(HYBRIDS))
    p.add_argument("--batches", default="1,8,64,256")
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="decode batches timed per size: the best counts")
    p.add_argument("--hf-tokens", type=int, default=32,
                   help="tokens generated by the transformers baseline (hybrids: the decode steps it times)")
    p.add_argument("--hf-batches", help="batches of the transformers baseline (default: 1,8; hybrids: --batches)")
    p.add_argument("--prefill", default="8x2048", help="requests x tokens for prefill throughput")
    p.add_argument("--ttft", default="2048,8192")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", default="e2e.json")
    p.add_argument("--keep-checkpoint", help="move the generated checkpoint here instead of deleting it")
    p.add_argument("--checkpoint", help="hybrids: the checkpoint to use, built here (and kept) when absent")
    p.add_argument("--sequential-baseline", action="store_true",
                   help="hybrids: also time each decode batch without overlap scheduling (Mamba2 sizes always do)")
    p.add_argument("--kernel-cache-dir", help="Triton's compile cache for the engine (the server flag of that name)")
    p.add_argument("--peak-tflops", type=float, default=989.0,
                   help="dense bf16 peak for the hybrid prefill ratio (H100 SXM: 989)")
    a = p.parse_args()
    if a.size in HYBRIDS:
        res = run_hybrid(a)
        Path(a.json).write_text(json.dumps(res, indent=1))
        return

    from mambaserve.server.config import ServerConfig
    from mambaserve.server.engine.engine import Engine

    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    batches = [int(x) for x in a.batches.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="mambaserve-e2e-"))
    t = time.perf_counter()
    hf = build_checkpoint(a.size, tmp, a.device, dtype)
    print(f"built random {a.size} checkpoint in {time.perf_counter() - t:.1f} s", flush=True)
    cfg = SIZES[a.size]
    n_req, n_tok = (int(x) for x in a.prefill.split("x"))
    ttft_lens = [int(x) for x in a.ttft.split(",")]
    ctx = max([n_tok, *ttft_lens]) + a.decode_tokens + 64
    t = time.perf_counter()
    engine = Engine(ServerConfig(model=str(tmp), tokenizer=str(TOKENIZER), device=a.device,
                                 dtype="bfloat16" if a.device == "cuda" else "float32",
                                 max_running_requests=max(batches + [n_req]), mamba_cache_size=max(batches + [n_req]) + 8,
                                 chunked_prefill_size=8192, disable_radix_cache=True, context_length=ctx,
                                 cuda_graph_max_bs=max(batches), kernel_cache_dir=a.kernel_cache_dir))
    engine.start()
    print(f"engine ready in {time.perf_counter() - t:.1f} s (CUDA graphs captured: "
          f"{engine.scheduler.runner.graphs is not None})", flush=True)
    bw = copy_bandwidth(a.device)
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    state_bytes = engine.pool.bytes_per_slot
    gen = torch.Generator().manual_seed(0)

    def prompts(n, length):
        return [torch.randint(1, cfg["vocab_size"], (length,), generator=gen).tolist() for _ in range(n)]

    res = {"size": a.size, "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
           "copy_bandwidth_GBps": bw / 1e9, "weight_bytes": weight_bytes, "state_bytes_per_request": state_bytes,
           "decode": [], "hf": [], "prefill": None, "ttft": []}
    asyncio.run(timed_batch(engine, prompts(2, 16), 4))  # warm-up (allocator)
    engine.mark_ready()
    for b in batches:
        row = {"batch": b, "bound_ms": (weight_bytes + 2 * b * state_bytes) / bw * 1e3}
        for overlap in (False, True):
            row["step_ms" if overlap else "sequential_step_ms"] = decode_step_ms(engine, lambda: prompts(b, 32),
                                                                              a.decode_tokens, overlap, a.repeats)
        row["tokens_per_s"] = b / row["step_ms"] * 1e3
        res["decode"].append(row)
        print(f"decode b={b:4}: {row['tokens_per_s']:10.1f} tok/s, {row['step_ms']:7.3f} ms/step (without overlap "
              f"{row['sequential_step_ms']:7.3f}: {row['sequential_step_ms'] / row['step_ms']:4.2f}x), bandwidth bound "
              f"{row['bound_ms']:7.3f} ms/step -> {row['step_ms'] / row['bound_ms']:5.2f}x the bound", flush=True)
    tps, res["ttft"] = prefill_and_ttft(engine, prompts, n_req, n_tok, ttft_lens)
    res["prefill"] = {"requests": n_req, "tokens": n_tok, "tokens_per_s": tps}
    res["kernel_compiles"] = dict(engine.compiles)
    print(f"kernel compiles: {engine.compiles['warmup']} before ready, {engine.compiles['serving']} after", flush=True)
    engine.stop()
    for b in [int(x) for x in (a.hf_batches or "1,8").split(",")]:
        hf_tps = unless_oom(a.device, hf_generate_tps, hf, b, 32, a.hf_tokens, cfg["vocab_size"], a.device)
        if hf_tps is None:
            res["hf"].append({"batch": b, "oom": True})
            print(f"transformers generate b={b}: out of memory", flush=True)
            continue
        ours = next((d["tokens_per_s"] for d in res["decode"] if d["batch"] == b), None)
        res["hf"].append({"batch": b, "tokens_per_s": hf_tps})
        print(f"transformers generate b={b}: {hf_tps:8.1f} tok/s" +
              (f" -> mambaserve decode is {ours / hf_tps:6.1f}x" if ours else ""), flush=True)
    Path(a.json).write_text(json.dumps(res, indent=1))
    if a.keep_checkpoint:
        shutil.move(str(tmp), a.keep_checkpoint)
    else:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
