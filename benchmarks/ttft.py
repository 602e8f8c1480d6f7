"""Time to first token through HTTP, and where it goes.

For short prompts (--lengths, default 16 and 128 tokens), cold (a prompt never seen) and hit (the same
prompt sent a second time: all but its last token cached), streamed (time to the first chunk carrying a
token) and not (the whole answer of one token), one client and --concurrency clients at once: the mean
TTFT, and the mean share of each stage of the server's request timeline (mambaserve_request_stage_seconds,
scraped before and after each case). Then, in this process on the same device, the device time of the
forward pass a request of each length needs (cold: the prefill of the whole prompt, which also writes the
cache's snapshot before the last token; hit: the last token as a decode step from that snapshot; CUDA
graphs as served): the floor the TTFT is compared against.

  python benchmarks/ttft.py --size 2.7b                        # random-weight checkpoint, on the GPU
  python benchmarks/ttft.py --model models/mamba2-tiny-pystdlib  # any checkpoint (CPU works)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from _server import launched  # noqa: E402 (the script's folder is on sys.path)

STAGES = ("validated", "queued", "admitted", "launched", "first_token", "finished", "first_byte")


def stage_sums(text: str) -> dict[str, tuple[float, float]]:
    out: dict[str, list[float]] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name == "mambaserve_request_stage_seconds":
            for s in fam.samples:
                kind = s.name.rsplit("_", 1)[-1]
                if kind in ("count", "sum"):
                    out.setdefault(s.labels["stage"], [0.0, 0.0])[kind == "sum"] = s.value
    return {k: (v[0], v[1]) for k, v in out.items()}


async def one(c: httpx.AsyncClient, ids: list[int], stream: bool) -> float:
    """Seconds to the first token: the first chunk with a token (streamed) or the whole 1-token answer."""
    body = {"input_ids": ids, "stream": stream,
            "sampling_params": {"max_new_tokens": 8 if stream else 1, "temperature": 0, "ignore_eos": True}}
    t0 = time.perf_counter()
    if not stream:
        (await c.post("/generate", json=body)).raise_for_status()
        return time.perf_counter() - t0
    ttft = None
    async with c.stream("POST", "/generate", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if ttft is None and line.startswith("data: {") and json.loads(line[6:])["output_ids"]:
                ttft = time.perf_counter() - t0
    return ttft


async def run_case(c: httpx.AsyncClient, rng: random.Random, length: int, hit: bool, stream: bool,
                   clients: int, rounds: int, vocab: int) -> dict:
    before = stage_sums((await c.get("/metrics")).text)
    times = []
    for _ in range(rounds):
        prompts = [[rng.randrange(1, vocab) for _ in range(length)] for _ in range(clients)]
        if hit:  # the first send caches the prompt (all but its last token); only the resend is timed
            await asyncio.gather(*(one(c, p, False) for p in prompts))
            before = stage_sums((await c.get("/metrics")).text)
        times += await asyncio.gather(*(one(c, p, stream) for p in prompts))
    after = stage_sums((await c.get("/metrics")).text)
    n = len(times) if not hit else clients  # stage means over the timed requests (the last round for hits)
    shares = {s: 1e3 * (after.get(s, (0, 0))[1] - before.get(s, (0, 0))[1]) / n for s in STAGES}
    return {"length": length, "cache": "hit" if hit else "cold", "stream": stream, "clients": clients,
            "ttft_ms": 1e3 * statistics.mean(times), "p50_ms": 1e3 * statistics.median(times),
            "stages_ms": {s: round(v, 2) for s, v in shares.items() if v > 0}}


async def http_cases(url: str, a: argparse.Namespace) -> list[dict]:
    rng = random.Random(a.seed)
    out = []
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        for p in [[rng.randrange(1, a.vocab) for _ in range(64)] for _ in range(4)]:  # warm-up
            await one(c, p, True)
        for length in a.lengths:
            for clients in (1, a.concurrency):
                for hit in (False, True):
                    for stream in (False, True):
                        r = await run_case(c, rng, length, hit, stream, clients,
                                           a.rounds if clients == 1 else max(1, a.rounds // 4), a.vocab)
                        print(f"  {length:5d} tok {r['cache']:4s} {'stream' if stream else 'whole ':6s} "
                              f"x{clients:<3d} TTFT {r['ttft_ms']:7.2f} ms (p50 {r['p50_ms']:7.2f})  "
                              + " ".join(f"{k} {v}" for k, v in r["stages_ms"].items()), flush=True)
                        out.append(r)
    return out


def forward_floor(model: str, lengths: list[int], flags: list[str]) -> dict[int, dict]:
    """Device time (CUDA events around each step, 20 repeats, median) of one request's forward pass, as the
    engine runs it: cold, the whole prompt (and the snapshot before its last token into another slot); hit,
    the last token as a decode step from that snapshot."""
    import torch

    from mambaserve.server.cli import build_parser, config_from_args
    from mambaserve.server.engine.batch import ForwardBatch, ForwardMode
    from mambaserve.server.engine.engine import Engine

    engine = Engine(config_from_args(build_parser().parse_args(["serve", "--model", model, *flags])))
    runner = engine.scheduler.runner

    def timed(batch: ForwardBatch) -> float:
        ms = []
        for _ in range(23):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            runner.forward(batch)
            end.record()
            end.synchronize()
            ms.append(start.elapsed_time(end))
        return statistics.median(ms[3:])

    out = {}
    for n in lengths:
        cold = timed(ForwardBatch(ForwardMode.EXTEND, list(range(1, n + 1)), [n], [0], [0], snap=[(0, 1)]))
        hit = timed(ForwardBatch(ForwardMode.DECODE, [1], [1], [n - 1], [0]))
        out[n] = {"cold_ms": round(cold, 3), "hit_ms": round(hit, 3)}
        print(f"  {n:5d} tok: cold prefill {cold:.3f} ms, hit (the last token's decode step) {hit:.3f} ms", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint directory (else --size builds a random-weight one)")
    p.add_argument("--size", default="2.7b", help="random-weight checkpoint size (benchmarks/e2e.py SIZES)")
    p.add_argument("--lengths", type=int, nargs="+", default=[16, 128])
    p.add_argument("--concurrency", type=int, default=10)
    p.add_argument("--rounds", type=int, default=20, help="timed requests per single-client case")
    p.add_argument("--vocab", type=int, default=4000, help="prompt token ids are drawn below this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--flags", default="", help="extra server flags, one string")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args()
    flags = a.flags.split()
    with tempfile.TemporaryDirectory() as tmp:
        model = a.model
        if model is None:
            import torch

            from e2e import build_checkpoint

            model = str(Path(tmp) / a.size)
            build_checkpoint(a.size, Path(model), "cuda", torch.bfloat16)  # the model it returns is freed here
            torch.cuda.empty_cache()
        print(f"TTFT through HTTP ({model}, flags {flags or 'default'})", flush=True)
        with launched(model, flags) as url:
            cases = asyncio.run(http_cases(url, a))
        floor = {}
        import torch

        if torch.cuda.is_available():
            print("device time of one request's forward passes (in process)", flush=True)
            floor = forward_floor(model, a.lengths, flags)
    for r in cases:
        f = floor.get(r["length"])
        if f and r["clients"] == 1:
            r["device_ms"] = f["cold_ms"] if r["cache"] == "cold" else f["hit_ms"]
            r["ttft_over_device"] = round(r["ttft_ms"] / r["device_ms"], 2)
    if a.json:
        Path(a.json).write_text(json.dumps({"cases": cases, "forward": floor, "argv": sys.argv}, indent=1))


if __name__ == "__main__":
    main()
