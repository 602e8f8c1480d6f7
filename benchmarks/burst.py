"""Bursts through HTTP against the same bursts in process: does the HTTP path keep up with the engine?

N requests with random --prompt-length-token prompts and a fixed output length (ignore_eos) are sent at
once (SGLang bench_serving's request pattern at an infinite request rate), non-streamed `/generate`
through a server process, then `Engine.generate` in this process on the same checkpoint and flags.
Prints output tokens/s per burst: the first burst after start separately, then the best of the rest,
and the HTTP / in-process ratio.

  python benchmarks/burst.py --model /tmp/m27 --flags "--mamba-cache-size 300" --bursts 8x256,64x256,256x256,256x1024
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from _server import launched  # noqa: E402 (the script's folder is on sys.path)


def prompts(rng: random.Random, n: int, length: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(1, vocab) for _ in range(length)] for _ in range(n)]


STAGE = re.compile(r'^mambaserve_request_stage_seconds_(sum|count)\{stage="(\w+)"\} (\S+)$', re.M)


async def stage_totals(session: aiohttp.ClientSession, url: str) -> dict[tuple[str, str], float]:
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    return {(stage, kind): float(v) for kind, stage, v in STAGE.findall(text)}


def print_stages(means: dict[str, float]) -> None:
    """Mean seconds from the stage before to each stage (engine/timeline.py), over the burst's requests."""
    print("    stages (mean ms): " + ", ".join(f"{k} {1e3 * v:.1f}" for k, v in means.items()), flush=True)


async def http_burst(url: str, batch: list[list[int]], out: int) -> float:
    """aiohttp, as SGLang's bench_serving: httpx's pool takes seconds to take 256 concurrent answers in (a
    server holding them 2 s answered all 256 after 6.4-7.7 s through httpx, 2.3-2.5 s through aiohttp), which
    measured the client, not the server. One session per burst (pooled connections idle past the server's
    keep-alive get closed)."""
    bodies = [json.dumps({"input_ids": ids, "sampling_params": {"max_new_tokens": out, "temperature": 0,
                                                                 "ignore_eos": True}}) for ids in batch]

    async def post(s: aiohttp.ClientSession, body: str) -> tuple[int, dict, float]:
        async with s.post(url + "/generate", data=body, headers={"content-type": "application/json"}) as r:
            answer = await r.json(content_type=None)
            return r.status, answer, time.perf_counter()

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1200),
                                     connector=aiohttp.TCPConnector(limit=len(batch))) as s:
        before = await stage_totals(s, url)
        t0 = time.perf_counter()
        rs = await asyncio.gather(*(post(s, b) for b in bodies))
        wall = time.perf_counter() - t0
        after = await stage_totals(s, url)
    assert all(status == 200 and len(a["output_ids"]) == out for status, a, _ in rs), rs[0][1]
    done = sorted(t for _, _, t in rs)
    print_stages({stage: (after[stage, "sum"] - before.get((stage, "sum"), 0.0))
                  / max(1.0, after[stage, "count"] - before.get((stage, "count"), 0.0))
                  for stage, kind in after if kind == "sum"})
    print(f"    answers {1e3 * (done[0] - t0):.0f}-{1e3 * (done[-1] - t0):.0f} ms after the burst began", flush=True)
    return len(batch) * out / wall


async def engine_burst(engine, batch: list[list[int]], out: int, spread_ms: float = 0.0) -> float:
    """``spread_ms``: the requests arrive evenly over that long instead of at once (as HTTP spreads them)."""
    from mambaserve.server.engine import timeline
    from mambaserve.server.engine.request import SamplingParams

    params = SamplingParams(max_new_tokens=out, temperature=0, ignore_eos=True)
    lines: list[timeline.Timeline] = []

    async def one(k, ids):
        if spread_ms:
            await asyncio.sleep(spread_ms / 1e3 * k / len(batch))
        tl = timeline.Timeline()
        timeline.current.set(tl)  # (each gathered task runs in its own context)
        lines.append(tl)
        async for o in engine.generate(ids, params, stream=False):
            last = o
        tl.mark("first_byte")
        assert last.completion_tokens == out, last

    t0 = time.perf_counter()
    await asyncio.gather(*(one(k, ids) for k, ids in enumerate(batch)))
    rate = len(batch) * out / (time.perf_counter() - t0)
    sums: dict[str, float] = {}
    for tl in lines:
        for stage, seconds in tl.shares():
            sums[stage] = sums.get(stage, 0.0) + seconds
    print_stages({stage: total / len(lines) for stage, total in sums.items()})
    return rate


async def run_bursts(burst, bursts: list[tuple[int, int]], a: argparse.Namespace) -> dict[str, list[float]]:
    """``a.repeats`` bursts (or the size's own count) of each size through ``burst(prompts, output length)``, the
    same prompts on both sides."""
    rng = random.Random(a.seed)
    res = {}
    for n, length, *repeats in bursts:
        rates = [await burst(prompts(rng, n, a.prompt_length, a.vocab), length)
                 for _ in range(repeats[0] if repeats else a.repeats)]
        res[f"{n}x{length}"] = rates
        print(f"  {n:4d} requests x {length:5d} tokens: " + ", ".join(f"{r:8.0f}" for r in rates) + " tok/s",
              flush=True)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--flags", default="", help="server flags, one string (used for both sides)")
    p.add_argument("--bursts", default="8x256,64x256,256x256,256x1024",
                   help="requests x output tokens[x repeats], ...")
    p.add_argument("--repeats", type=int, default=2, help="bursts per size (the first of the first size is the "
                                                          "first burst after start)")
    p.add_argument("--prompt-length", type=int, default=128)
    p.add_argument("--vocab", type=int, default=4000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--in-process-only", action="store_true", help="skip the HTTP side")
    p.add_argument("--http-only", action="store_true", help="skip the in-process side (first burst against the next)")
    p.add_argument("--profile-server", metavar="PATH", help="record the server process with py-spy (collapsed "
                                                             "stacks per thread) during the HTTP bursts")
    p.add_argument("--arrival-spread-ms", type=float, default=0.0,
                   help="in process, also run each burst with its arrivals spread evenly over this long")
    a = p.parse_args()
    from mambaserve.server.cli import openmp_defaults

    openmp_defaults()  # the in-process side as the server runs (before torch loads)
    bursts = [tuple(int(x) for x in b.split("x")) for b in a.bursts.split(",")]
    flags = a.flags.split()
    longest = a.prompt_length + max(b[1] for b in bursts) + 8
    flags += ["--context-length", str(longest)]

    http = {}
    if not a.in_process_only:
        print(f"through HTTP ({a.model}, flags {flags})", flush=True)
        with launched(a.model, flags, process=True) as (url, proc):
            spy = None
            if a.profile_server:  # py-spy's samples of every server thread, idle ones too, over the HTTP bursts
                spy = subprocess.Popen(["py-spy", "record", "--pid", str(proc.pid), "--idle", "--threads", "-r", "100",
                                        "-f", "raw", "--nonblocking", "-o", a.profile_server])
            http = asyncio.run(run_bursts(lambda batch, length: http_burst(url, batch, length), bursts, a))
            if spy is not None:
                spy.send_signal(signal.SIGINT)  # py-spy writes its file on Ctrl-C
                spy.wait(timeout=60)

    if a.http_only:
        return
    print("in process (Engine.generate, same flags)", flush=True)
    from mambaserve.server.cli import build_parser, config_from_args
    from mambaserve.server.engine.engine import Engine

    engine = Engine(config_from_args(build_parser().parse_args(["serve", "--model", a.model, *flags])))
    engine.start()
    inproc = asyncio.run(run_bursts(lambda batch, length: engine_burst(engine, batch, length), bursts, a))
    spread = {}
    if a.arrival_spread_ms:
        print(f"in process, arrivals spread over {a.arrival_spread_ms:g} ms", flush=True)
        spread = asyncio.run(run_bursts(lambda batch, length: engine_burst(engine, batch, length, a.arrival_spread_ms),
                                        bursts, a))
    engine.stop()
    print("burst            HTTP first  HTTP best  in-process best  HTTP/in-process")
    for key in http:
        h, e = http[key], inproc[key]
        print(f"  {key:14s} {h[0]:10.0f} {max(h):10.0f} {max(e):16.0f} {max(h) / max(e):16.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"http": http, "in_process": inproc, "in_process_spread": spread,
                                            "argv": sys.argv}, indent=1))


if __name__ == "__main__":
    main()
