"""Bounded soak: mixed traffic against a small pool, reporting whether anything wedges, fails or leaks.

Starts a server (loopback only) with a deliberately small state pool, so eviction never stops, and for
--duration seconds runs --workers concurrent clients, each cycling through:
  conversation   a chat resent whole every turn (/v1/completions), growing until --turns
  session        a streaming session: open, --turns turns of new tokens, close
  stream_abort   a streamed /generate the client drops after a few chunks
  timeout        a long non-streamed /generate the client gives up on (client-side timeout)
  bad            a flood of bad values: NaN, lone surrogates, wrong types, too-long prompts, oversized
                 bodies, unknown sessions, bad snapshot names
  plain          an ordinary short completion (the latency a bystander sees)
Every 2 s it samples the server's RSS and /get_server_info. At the end: requests and errors by kind
and status, p50/p99 latency per kind, RSS over time, and after the traffic stops, whether the pool is
fully accounted for (no request holds a slot) and /health_generate answers. Exit status 1 on any 5xx,
wedge (a request past --wedge-after seconds), leaked slot or failed health check.

  python3 benchmarks/soak.py --model models/mamba2-tiny-pystdlib --duration 300 --json soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import statistics
import time
from pathlib import Path

import httpx

from _server import launched  # noqa: E402 (the script's folder is on sys.path)

KINDS = ("conversation", "session", "stream_abort", "timeout", "bad", "plain")
BAD = [
    ("/v1/completions", b'{"prompt": "x", "temperature": NaN}'),
    ("/generate", b'{"text": "\\ud800 lone"}'),
    ("/generate", b'{"input_ids": [false, true]}'),
    ("/generate", b'{"text": "x", "sampling_params": {"seed": 18446744073709551616}}'),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": "many"}'),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 100000000}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "x"}]}'),
    ("/generate", b'{"text": "x", "session_params": {"id": "no-such-session"}}'),
    ("/sessions/no-such/snapshot", b'{"name": "../../etc/passwd"}'),
    ("/open_session", b'{"timeout": Infinity}'),
    ("/generate", b'{"text": "' + b"y" * 20000 + b'"}'),  # past the context length
    ("/v1/completions", b'{"prompt": "x", ' + b'"pad": "' + b"z" * (9 * 2**20) + b'"}'),  # past the body limit
]


class Stats:
    def __init__(self):
        self.latency: dict[str, list[float]] = collections.defaultdict(list)
        self.status: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.wedged = 0

    def record(self, kind: str, status: int | str, seconds: float) -> None:
        self.status[kind][status] += 1
        self.latency[kind].append(seconds)


async def timed(stats: Stats, kind: str, coro, wedge_after: float):
    t = time.monotonic()
    try:
        status = await asyncio.wait_for(coro, wedge_after)
    except asyncio.TimeoutError:
        stats.wedged += 1
        status = "wedged"
    except httpx.HTTPError as e:
        status = type(e).__name__
    stats.record(kind, status, time.monotonic() - t)


async def conversation(c: httpx.AsyncClient, rng: random.Random, a) -> int:
    history = "def f(x):\n"
    for _ in range(a.turns):
        history += rng.choice(["    return x\n", "print(f(1))\n", "import os\n", "class A:\n    pass\n"])
        r = await c.post("/v1/completions", json={"prompt": history, "max_tokens": 8, "temperature": 0})
        if r.status_code != 200:
            return r.status_code
        history += r.json()["choices"][0]["text"]
    return 200


async def session(c: httpx.AsyncClient, rng: random.Random, a) -> int:
    r = await c.post("/open_session", json={"streaming": True, "timeout": 60})
    if r.status_code != 200:
        return r.status_code
    sid = r.json()
    try:
        for _ in range(a.turns):
            body = {"text": rng.choice(["x = 1\n", "def g():\n", "# note\n"]), "session_params": {"id": sid},
                    "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
            r = await c.post("/generate", json=body)
            if r.status_code != 200:
                return r.status_code
    finally:
        await c.post("/close_session", json={"session_id": sid})
    return 200


async def stream_abort(c: httpx.AsyncClient, rng: random.Random, a) -> int:
    body = {"text": "for i in range(10):", "stream": True,
            "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
    async with c.stream("POST", "/generate", json=body) as r:
        n = 0
        async for line in r.aiter_lines():
            n += line.startswith("data: ")
            if n >= rng.randint(1, 5):
                break  # closing the response mid-stream: the server must abort the request
        return r.status_code


async def client_timeout(c: httpx.AsyncClient, rng: random.Random, a) -> int:
    body = {"text": "while True:", "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
    try:
        r = await c.post("/generate", json=body, timeout=rng.uniform(0.05, 0.5))
        return r.status_code
    except httpx.TimeoutException:
        return 499  # the client gave up, as intended


async def bad(c: httpx.AsyncClient, rng: random.Random, a) -> int:
    path, raw = rng.choice(BAD)
    r = await c.post(path, content=raw, headers={"content-type": "application/json"})
    return r.status_code


async def plain(c: httpx.AsyncClient, rng: random.Random, a) -> int:
    r = await c.post("/v1/completions", json={"prompt": "import sys\n", "max_tokens": 8, "temperature": 0})
    return r.status_code


RUN = {"conversation": conversation, "session": session, "stream_abort": stream_abort, "timeout": client_timeout,
       "bad": bad, "plain": plain}


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def soak(url: str, pid: int, a) -> dict:
    stats, samples = Stats(), []
    deadline = time.monotonic() + a.duration
    limits = httpx.Limits(max_connections=4 * a.workers)
    async with httpx.AsyncClient(base_url=url, timeout=a.wedge_after, limits=limits) as c:
        async def worker(i: int):
            rng = random.Random(a.seed * 1000 + i)
            while time.monotonic() < deadline:
                kind = rng.choice(KINDS)
                await timed(stats, kind, RUN[kind](c, rng, a), a.wedge_after)

        async def sampler():
            t0 = time.monotonic()
            while time.monotonic() < deadline:
                info = (await c.get("/get_server_info")).json()["internal_states"][0]
                samples.append({"t": round(time.monotonic() - t0, 1), "rss_mb": round(rss_mb(pid), 1), **info})
                await asyncio.sleep(2)

        await asyncio.gather(sampler(), *(worker(i) for i in range(a.workers)))
        # the traffic has stopped: every slot must be free or a cached snapshot, and generation must work
        await asyncio.sleep(1)
        final = (await c.get("/get_server_info")).json()["internal_states"][0]
        try:
            health = (await c.get("/health_generate", timeout=30)).status_code
        except httpx.HTTPError as e:
            health = type(e).__name__
    return {"stats": stats, "samples": samples, "final": final, "health_generate": health,
            "rss_end_mb": rss_mb(pid)}


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) >= 2 else (values[0] if values else 0.0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="../models/mamba2-tiny-pystdlib")
    p.add_argument("--duration", type=float, default=120, help="seconds of traffic")
    p.add_argument("--workers", type=int, default=12, help="concurrent clients")
    p.add_argument("--turns", type=int, default=12, help="turns per conversation and per session")
    p.add_argument("--wedge-after", type=float, default=60, help="a request slower than this counts as wedged")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-args", default="--mamba-cache-size 16 --max-running-requests 8 --session-timeout 60",
                   help="extra server flags (small pool: eviction all the time)")
    p.add_argument("--json", help="write the report here")
    a = p.parse_args()

    with launched(a.model, a.server_args.split(), process=True) as (url, proc):
        out = asyncio.run(soak(url, proc.pid, a))
    stats: Stats = out["stats"]
    print(f"{'kind':<14} {'requests':>8} {'p50 s':>8} {'p99 s':>8}  statuses")
    total = 0
    for kind in KINDS:
        lat = stats.latency.get(kind, [])
        total += len(lat)
        print(f"{kind:<14} {len(lat):8d} {pct(lat, 50):8.3f} {pct(lat, 99):8.3f}  {dict(stats.status[kind])}")
    five = sum(n for st in stats.status.values() for s, n in st.items() if isinstance(s, int) and s >= 500 and s != 503)
    rss = [s["rss_mb"] for s in out["samples"]]
    final = out["final"]
    leaked = final["held_by_requests"] + final["running"] + final["waiting"]
    print(f"requests {total}, 5xx {five}, wedged {stats.wedged}, leaked slots {leaked} (final accounting {final}), "
          f"/health_generate {out['health_generate']}")
    if rss:
        print(f"RSS MB: first {rss[0]}, max {max(rss)}, last {rss[-1]} over {len(rss)} samples")
    if a.json:
        Path(a.json).write_text(json.dumps({
            "args": vars(a), "requests": total, "server_errors": five, "wedged": stats.wedged, "leaked": leaked,
            "final": final, "health_generate": out["health_generate"], "samples": out["samples"],
            "by_kind": {k: {"requests": len(stats.latency.get(k, [])), "p50_s": pct(stats.latency.get(k, []), 50),
                            "p99_s": pct(stats.latency.get(k, []), 99),
                            "statuses": {str(s): n for s, n in stats.status[k].items()}} for k in KINDS}},
            indent=1))
    raise SystemExit(1 if five or stats.wedged or leaked or out["health_generate"] != 200 else 0)


if __name__ == "__main__":
    main()
