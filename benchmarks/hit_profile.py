"""Where a multi-turn round's time to first token goes, in process: rounds of chats with a barrier (every
chat's next turn is its prompt + answer + new tokens), each round's TTFT and cached tokens, every step the
scheduler launched (mode, rows, tokens, host time, device time between CUDA events), Triton compiles per
round (new entries in a fresh TRITON_CACHE_DIR), and for one round the torch profiler's kernel and host tables
(and a Chrome trace). The same rounds with ``--disable-radix-cache`` are the baseline (``--compare``).

  python benchmarks/hit_profile.py --shape nemotron-h-8b --checkpoint /tmp/nemotron-h-8b --compare --profile-round 3
  python benchmarks/hit_profile.py --shape nemotron-tiny --device cpu --request-length 64 --question-length 16 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path


def _fresh_triton_cache() -> Path:
    path = Path(tempfile.mkdtemp(prefix="triton-cache-"))
    os.environ["TRITON_CACHE_DIR"] = str(path)  # before triton is imported: its knobs read it then
    return path


def _cache_entries(path: Path) -> int:
    return sum(1 for _ in path.iterdir()) if path.exists() else 0


class StepLog:
    """Wraps ``runner.forward``: each launched step's mode, rows, tokens, host time, and device time
    between two CUDA events (read after the round, so nothing here waits for the device)."""

    def __init__(self, runner, cuda: bool):
        import torch

        self.rows: list[dict] = []
        self.cuda = cuda
        inner = runner.forward

        def forward(batch):
            t0 = time.perf_counter()
            ev = None
            if self.cuda:
                ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                ev[0].record()
            out = inner(batch)
            if ev is not None:
                ev[1].record()
            self.rows.append({"t": t0, "mode": batch.mode.name, "seqs": batch.batch_size, "tokens": batch.num_tokens,
                              "host_ms": (time.perf_counter() - t0) * 1e3, "ev": ev,
                              "ops": len(batch.state_ops.ops)})
            return out

        runner.forward = forward

    def take(self, since: float) -> list[dict]:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
        out = []
        for r in self.rows:
            ev = r.pop("ev", None)
            if ev is not None:
                r["device_ms"] = ev[0].elapsed_time(ev[1])
            r["t_ms"] = (r.pop("t") - since) * 1e3
            out.append(r)
        self.rows = []
        return out


async def _round(engine, prompts: list[list[int]], max_new: int) -> list[dict]:
    from mambaserve.server.engine import timeline
    from mambaserve.server.engine.request import SamplingParams

    params = SamplingParams(max_new_tokens=max_new, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()

    async def one(p):
        tl = timeline.Timeline()
        timeline.current.set(tl)
        first, toks, cached = None, [], 0
        async for out in engine.generate(p, params):
            if out.error:
                raise RuntimeError(out.error)
            if first is None and out.token_ids:
                first = time.perf_counter() - t0
            toks += out.token_ids
            cached = out.cached_tokens
        stages = {s: (t - tl.marks["received"]) * 1e3 for s, t in tl.marks.items()}
        return {"ttft_ms": first * 1e3, "answer": toks, "cached": cached, "prompt": len(p), "stages_ms": stages}

    return list(await asyncio.gather(*(one(p) for p in prompts)))


def run(a, mode: str, ckpt: Path, vocab: int, cache_dir: Path) -> dict:
    import torch

    from mambaserve.server.config import ServerConfig
    from mambaserve.server.engine.engine import Engine

    extra = dict(disable_radix_cache=True) if mode == "no-cache" else {}
    if a.mamba_cache_size:
        extra["mamba_cache_size"] = a.mamba_cache_size
    t = time.perf_counter()
    entries0 = _cache_entries(cache_dir)
    engine = Engine(ServerConfig(model=str(ckpt), device=a.device, dtype="bfloat16" if a.device == "cuda" else "float32",
                                 max_running_requests=a.clients, cuda_graph_max_bs=a.clients, **extra))
    engine.start()
    ready_s = time.perf_counter() - t
    print(f"[{mode}] engine ready in {ready_s:.1f} s ({_cache_entries(cache_dir) - entries0} kernels compiled); "
          f"{engine.pool.allocator.capacity} state slots, {engine.kv_pool.allocator.capacity if engine.kv_pool else 0} "
          f"KV pages", flush=True)
    steps = StepLog(engine.scheduler.runner, a.device == "cuda")
    gen = torch.Generator().manual_seed(0)

    def rand(n):
        return torch.randint(1, vocab, (n,), generator=gen).tolist()

    prompts = [rand(a.request_length) for _ in range(a.clients)]
    rounds = []
    for k in range(1, a.rounds + 1):
        entries = _cache_entries(cache_dir)
        prof = None
        if k == a.profile_round and mode == "cache" and a.device == "cuda":
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                      torch.profiler.ProfilerActivity.CUDA])
            prof.__enter__()
        t0 = time.perf_counter()
        res = asyncio.run(_round(engine, prompts, a.output_length))
        wall = time.perf_counter() - t0
        if prof is not None:
            prof.__exit__(None, None, None)
            _profile_tables(prof, a, mode)
        step_rows = steps.take(t0)
        compiles = _cache_entries(cache_dir) - entries
        ttft = [r["ttft_ms"] for r in res]
        cached = sum(r["cached"] for r in res) / max(1, sum(r["prompt"] - 1 for r in res))
        row = {"round": k, "ttft_mean_ms": statistics.mean(ttft), "ttft_max_ms": max(ttft), "hit_rate": cached,
               "wall_ms": wall * 1e3, "compiles": compiles, "steps": step_rows,
               "stages_ms": {s: statistics.mean(r["stages_ms"].get(s, float("nan")) for r in res)
                             for s in ("queued", "admitted", "launched", "first_token")}}
        rounds.append(row)
        first_steps = [s for s in step_rows if s["t_ms"] <= max(ttft)]
        print(f"[{mode}] round {k}: TTFT mean {row['ttft_mean_ms']:7.1f} ms max {row['ttft_max_ms']:7.1f} ms, "
              f"hit rate {cached:.3f}, compiles {compiles}, stages "
              + " ".join(f"{s} {v:.1f}" for s, v in row["stages_ms"].items()), flush=True)
        for s in first_steps:
            print(f"    step at {s['t_ms']:7.1f} ms: {s['mode']:6} seqs {s['seqs']:3} tokens {s['tokens']:5} "
                  f"ops {s['ops']:3} host {s['host_ms']:6.2f} ms device {s.get('device_ms', float('nan')):7.2f} ms",
                  flush=True)
        prompts = [p + r["answer"] + rand(a.question_length) for p, r in zip(prompts, res)]
    engine.stop()
    del engine
    if a.device == "cuda":
        torch.cuda.empty_cache()
    return {"mode": mode, "ready_s": ready_s, "rounds": rounds}


def _profile_tables(prof, a, mode: str) -> None:
    avg = prof.key_averages()
    for key in ("self_device_time_total", "self_cuda_time_total"):
        try:
            print(avg.table(sort_by=key, row_limit=a.profile_rows, max_name_column_width=70), flush=True)
            break
        except (AttributeError, KeyError, ValueError):
            continue
    print(avg.table(sort_by="self_cpu_time_total", row_limit=a.profile_rows, max_name_column_width=70), flush=True)
    if a.trace:
        raw = Path(tempfile.mkdtemp()) / "trace.json"
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as f, gzip.open(a.trace, "wb") as g:
            shutil.copyfileobj(f, g)
        print(f"trace: {a.trace}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="nemotron-h-8b")
    p.add_argument("--checkpoint", help="built once there (random weights), reused after")
    p.add_argument("--device", default="cuda")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--request-length", type=int, default=1024)
    p.add_argument("--question-length", type=int, default=64)
    p.add_argument("--output-length", type=int, default=16)
    p.add_argument("--mamba-cache-size", type=int)
    p.add_argument("--compare", action="store_true", help="also the same rounds with --disable-radix-cache")
    p.add_argument("--profile-round", type=int, default=0, help="torch profiler over this round (cache mode, CUDA)")
    p.add_argument("--profile-rows", type=int, default=30)
    p.add_argument("--trace", help="a gzipped Chrome trace of the profiled round")
    p.add_argument("--json")
    a = p.parse_args()
    cache_dir = _fresh_triton_cache()
    import torch

    from e2e import HYBRIDS, build_hybrid_checkpoint  # noqa: E402 (the script's folder is on sys.path)

    ckpt = Path(a.checkpoint or tempfile.mkdtemp(prefix="mambaserve-hit-"))
    if not (ckpt / "config.json").exists():
        t = time.perf_counter()
        build_hybrid_checkpoint(a.shape, ckpt, a.device, torch.bfloat16 if a.device == "cuda" else torch.float32)
        print(f"built random {a.shape} checkpoint at {ckpt} in {time.perf_counter() - t:.1f} s", flush=True)
        if a.device == "cuda":
            torch.cuda.empty_cache()
    vocab = min(HYBRIDS[a.shape][1]["vocab_size"], 50000)
    out = {"shape": a.shape, "modes": [run(a, "cache", ckpt, vocab, cache_dir)]}
    if a.compare:
        out["modes"].append(run(a, "no-cache", ckpt, vocab, cache_dir))
    print(f"\n{a.shape}: mean TTFT per round (ms)")
    print("| mode | " + " | ".join(f"round {r['round']}" for r in out["modes"][0]["rounds"]) + " |")
    for m in out["modes"]:
        print(f"| {m['mode']} | " + " | ".join(f"{r['ttft_mean_ms']:.0f} ({r['hit_rate']:.2f})" for r in m["rounds"])
              + " |")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
