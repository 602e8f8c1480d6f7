"""Multi-turn chat benchmark: does the radix cache turn a conversation's history into cache hits?

C concurrent clients each hold a conversation of R rounds. Round 1 sends a random prompt of
--request-length tokens; each later round sends the whole history (previous prompt + answer) plus a
new question of --question-length tokens. Requests start as a Poisson process (--request-rate per
second, inf = all at once), optionally with a barrier between rounds. Prints per round the mean TTFT
and the cache hit rate (sum cached / sum prompt tokens); writes JSON.

A hybrid checkpoint (`e2e.py --size nemotron-h-8b --checkpoint DIR` builds one) runs the same way; a mode the
server refuses to start (a hybrid's radix cache where it is not built) is reported as refused, with the
server's reason, and the other modes still run.

--sessions N adds N clients that hold a streaming session each (each round sends its new question only; the
session keeps the history), beside the resent chats; the hit rate printed is the resent chats' alone (a
session's turn hits its live state by construction). --variant FLAGS runs the server again with those flags
added and prints both: e.g. whether --session-persist costs the chats their hits on a small pool (issue 31):

  python benchmarks/multiturn.py --model models/mamba2-tiny-pystdlib --compare
  python benchmarks/multiturn.py --url http://127.0.0.1:30000
  python benchmarks/multiturn.py --model /tmp/nemotron-h-8b --compare --clients 8 --rounds 4
  python benchmarks/multiturn.py --clients 6 --sessions 4 --rounds 6 --request-length 64 --question-length 16 \
      --output-length 16 --server-args "--mamba-cache-size 8 --host-cache-size 4MiB --storage-dir /tmp/st" \
      --variant=--session-persist
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

import aiohttp
import httpx

from _server import gc_pauses, kernel_compiles, launched  # noqa: E402 (the script's folder is on sys.path)
from ttft import STAGES, stage_sums  # noqa: E402


async def one_request(s: aiohttp.ClientSession, url: str, ids: list[int], out_len: int,
                      session: dict | None = None) -> tuple[float, list[int], int, float, float | None]:
    """Stream one /generate (with ``session``: a turn of that streaming session, ``session_params``); returns
    (TTFT seconds, output ids, cached tokens, when it was sent: time.monotonic(), the clock of the server's
    debug log, seconds per output token after the first: None for one token)."""
    body = json.dumps({"input_ids": ids, "stream": True, **({"session_params": session} if session else {}),
                       "sampling_params": {"max_new_tokens": out_len, "temperature": 0, "ignore_eos": True}})
    t0 = time.monotonic()  # after encoding the body (thousands of ids): the client's time is not TTFT
    ttft, last, done = None, None, None
    async with s.post(url + "/generate", data=body, headers={"content-type": "application/json"}) as r:
        r.raise_for_status()
        async for raw in r.content:  # one SSE line at a time
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            last = json.loads(line[6:])
            done = time.monotonic() - t0
            if ttft is None and last["output_ids"]:
                ttft = done
    n = len(last["output_ids"])
    return ttft, last["output_ids"], last["meta_info"]["cached_tokens"], t0, (done - ttft) / (n - 1) if n > 1 else None


async def run_benchmark(url: str, a: argparse.Namespace) -> list[dict]:
    rng = random.Random(a.seed)
    vocab_hi = 4000 if a.vocab is None else a.vocab
    convs = [[rng.randrange(1, vocab_hi) for _ in range(a.request_length)] for _ in range(a.clients)]
    rounds = [dict(ttft=[], sent=[], tpot=[], cached=0, prompt=0) for _ in range(a.rounds)]
    barrier = asyncio.Barrier(a.clients) if a.round_barrier else None
    stages: dict = {}

    async def client(k: int, c: aiohttp.ClientSession):
        history = convs[k]
        for r in range(a.rounds):
            if a.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(a.request_rate / a.clients))
            ttft, out, cached, sent, tpot = await one_request(c, url, history, a.output_length)
            rounds[r]["ttft"].append(ttft)
            rounds[r]["sent"].append(sent)
            if tpot is not None:
                rounds[r]["tpot"].append(tpot)
            rounds[r]["cached"] += cached
            rounds[r]["prompt"] += len(history)
            history = history + out + [rng.randrange(1, vocab_hi) for _ in range(a.question_length)]
            if barrier:
                await barrier.wait()
                if k == 0:  # every request of the round has answered: its share of the server's stages
                    nonlocal stages
                    async with c.get(url + "/metrics") as m:
                        now = stage_sums(await m.text())
                    rounds[r]["stages_ms"] = {s: round(1e3 * (now.get(s, (0, 0))[1] - stages.get(s, (0, 0))[1])
                                                       / a.clients, 2) for s in STAGES}
                    stages = now
                await barrier.wait()

    async def session(k: int, c: aiohttp.ClientSession):
        """A streaming session's client: each round sends its new tokens only (not counted in the chats' rounds)."""
        new = [rng.randrange(1, vocab_hi) for _ in range(a.request_length)]
        for r in range(a.rounds):
            sp = {"id": f"bench-{k}", **({"open": True, "streaming": True} if r == 0 else {}),
                  **({"close": True} if r == a.rounds - 1 else {})}
            _, out, _, _, _ = await one_request(c, url, new, a.output_length, sp)
            new = [rng.randrange(1, vocab_hi) for _ in range(a.question_length)]

    # aiohttp, as burst.py: httpx's pool spreads concurrent requests' sends and reads over milliseconds, which a
    # hit's TTFT (tens of ms) would count as the server's
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600),
                                     connector=aiohttp.TCPConnector(limit=a.clients + a.sessions + 8)) as c:
        await asyncio.gather(*(client(k, c) for k in range(a.clients)), *(session(k, c) for k in range(a.sessions)))
    return [{"round": i + 1, "mean_ttft_s": statistics.mean(r["ttft"]), "min_ttft_s": min(r["ttft"]),
             "max_ttft_s": max(r["ttft"]), "requests": sorted(zip(r["sent"], r["ttft"])),
             "mean_tpot_s": statistics.mean(r["tpot"]) if r["tpot"] else None,
             "hit_rate": r["cached"] / r["prompt"], "prompt_tokens": r["prompt"], "stages_ms": r.get("stages_ms", {})} for i, r in enumerate(rounds)]


CACHE_COUNTERS = ("mambaserve_prefix_cache_hit_tokens_total", "mambaserve_prefix_cache_capacity_miss_tokens_total",
                  "mambaserve_cache_evictions_total")


def cache_counters(url: str) -> dict[str, float]:
    """The server's hits by tier, capacity misses and evictions by tier, at the end of the run."""
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(CACHE_COUNTERS):
            name, value = line.rsplit(" ", 1)
            out[name.replace("mambaserve_", "").replace("_total", "")] = float(value)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="benchmark a running server instead of launching one")
    p.add_argument("--model", default="models/mamba2-tiny-pystdlib")
    p.add_argument("--server-args", default="", help="extra flags for the launched server")
    p.add_argument("--compare", action="store_true", help="run with the radix cache and with --disable-radix-cache")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--request-length", type=int, default=512)
    p.add_argument("--question-length", type=int, default=64)
    p.add_argument("--output-length", type=int, default=32)
    p.add_argument("--request-rate", type=float, default=float("inf"))
    p.add_argument("--round-barrier", action="store_true")
    p.add_argument("--vocab", type=int, help="draw prompt token ids below this (default 4000)")
    p.add_argument("--sessions", type=int, default=0, help="streaming sessions beside the resent chats")
    p.add_argument("--variant", help="run the server again with these flags added, and compare")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="multiturn.json")
    a = p.parse_args()

    results, refused, servers = {}, {}, {}
    if a.url:
        results["server"] = asyncio.run(run_benchmark(a.url, a))
        servers["server"] = {"kernel_compiles": kernel_compiles(a.url)}
    else:
        base = a.server_args.split() + ["--context-length", str(a.request_length + a.rounds * (
            a.question_length + a.output_length) + 64)]
        modes = {"radix": base, "no_cache": base + ["--disable-radix-cache"]} if a.compare else {"radix": base}
        if a.variant:
            modes["variant"] = base + a.variant.split()
        for name, flags in modes.items():  # each mode a storage directory of its own: nothing carries over
            if "--storage-dir" in flags:
                i = flags.index("--storage-dir") + 1
                flags[i] = f"{flags[i]}/{name}"
        for name, flags in modes.items():
            t = time.perf_counter()
            try:
                with launched(a.model, flags) as url:
                    ready = time.perf_counter() - t  # process start to /health 200: load, warm-up, graphs
                    results[name] = asyncio.run(run_benchmark(url, a))
                    servers[name] = {"ready_s": round(ready, 1), "kernel_compiles": kernel_compiles(url),
                                     "cache": cache_counters(url), "gc_pauses": gc_pauses(url)}
            except RuntimeError as e:
                if not str(e).startswith("server did not start"):
                    raise
                refused[name] = str(e).split(": ", 2)[-1]
    print(f"{a.clients} clients x {a.rounds} rounds, request {a.request_length} + question {a.question_length}, "
          f"output {a.output_length} tokens" + (f"; {a.sessions} streaming sessions beside" if a.sessions else "")
          + (f"; variant: {a.variant}" if a.variant else ""))
    for name, why in refused.items():
        print(f"{name}: the server refused to start: {why}")
    names = list(results)
    both = "radix" in results and "no_cache" in results
    print("round " + "".join(f"| {n:>10} TTFT ms (min-max)  hit rate " for n in names)
          + ("| TTFT ratio no_cache/radix" if both else ""))
    for i in range(a.rounds):
        row = f"{i + 1:5} "
        for n in names:
            r = results[n][i]
            spread = f"({r['min_ttft_s'] * 1e3:.0f}-{r['max_ttft_s'] * 1e3:.0f})"
            row += f"| {r['mean_ttft_s'] * 1e3:18.1f} {spread:>11} {r['hit_rate']:9.3f} "
        if both:
            row += f"| {results['no_cache'][i]['mean_ttft_s'] / results['radix'][i]['mean_ttft_s']:8.2f}x"
        print(row)
    if a.round_barrier:
        print("mean stage shares per request (ms; mambaserve_request_stage_seconds), by round:")
        for n in names:
            for r in results[n]:
                print(f"  {n} round {r['round']}: " + " ".join(f"{s} {v}" for s, v in r["stages_ms"].items() if v))
    for n in names:  # rounds 2 on: the chats resend what the server saw (round 1 is compulsory misses)
        later = results[n][1:] or results[n]
        print(f"{n}: hit rate of rounds 2-{a.rounds}: "
              f"{sum(r['hit_rate'] * r['prompt_tokens'] for r in later) / sum(r['prompt_tokens'] for r in later):.3f}")
    for n in names:
        tpots = [r["mean_tpot_s"] for r in results[n] if r["mean_tpot_s"] is not None]
        if tpots:
            print(f"{n}: time per output token after the first (ms), by round: "
                  + " ".join(f"{1e3 * t:.2f}" for t in tpots))
    for n, srv in servers.items():
        if srv.get("cache"):
            print(f"{n} server: " + ", ".join(f"{k} {v:g}" for k, v in srv["cache"].items()))
    for n, srv in servers.items():
        c = srv["kernel_compiles"]
        print(f"{n} server: ready in {srv.get('ready_s', '?')} s, kernel compiles {c.get('warmup')} before ready, "
              f"{c.get('serving')} after" + "".join(
                  f"; gen {g} garbage collections {p['count']} ({1e3 * p['seconds']:.1f} ms in all, the longest <= "
                  f"{1e3 * p['longest_le']:g} ms)" for g, p in sorted(srv.get("gc_pauses", {}).items()) if p["count"]))
    with open(a.out, "w") as f:
        json.dump({"args": vars(a) | {"request_rate": str(a.request_rate)}, "results": results, "refused": refused,
                   "servers": servers}, f, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
