"""Per-turn latency of long conversations: resending history vs sessions.

S concurrent conversations x T turns; each turn adds --new-tokens random tokens and asks for
--output-tokens. Modes:
  reread     no session, no prefix cache: every turn sends and re-reads the whole history
  resend     no session: every turn sends the whole history (prefix reuse through the radix cache)
  session    non-streaming session: the turn sends new tokens, the server branches from the last turn
             through the radix cache
  streaming  streaming session: the turn prefills only its new tokens on the session's live state
Prints the mean per-turn latency of the last 10 turns per mode, the ratio to resend, and for streaming
turn 10 vs turn T (flat = the cost does not grow with the conversation).

  python benchmarks/session_latency.py --model models/mamba2-tiny-pystdlib
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

import httpx

from _server import launched  # noqa: E402 (the script's folder is on sys.path)


async def conversation(c: httpx.AsyncClient, mode: str, a: argparse.Namespace, seed: int) -> list[float]:
    rng = random.Random(seed)
    sid = None
    if mode not in ("resend", "reread"):
        sid = (await c.post("/open_session", json={"streaming": mode == "streaming"})).json()
    history: list[int] = []
    times = []
    for _ in range(a.turns):
        new = [rng.randrange(1, 4000) for _ in range(a.new_tokens)]
        body = {"sampling_params": {"max_new_tokens": a.output_tokens, "temperature": 0, "ignore_eos": True}}
        if sid:
            body |= {"input_ids": new, "session_params": {"id": sid}}
        else:
            body["input_ids"] = history + new
        t0 = time.perf_counter()
        r = await c.post("/generate", json=body)
        times.append(time.perf_counter() - t0)
        r.raise_for_status()
        history += new + r.json()["output_ids"]
    if sid:
        await c.post("/close_session", json={"session_id": sid})
    return times


async def run_mode(url: str, mode: str, a: argparse.Namespace) -> list[float]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        per_conv = await asyncio.gather(*(conversation(c, mode, a, seed) for seed in range(a.sessions)))
    return [statistics.mean(t[i] for t in per_conv) for i in range(a.turns)]  # mean over conversations, per turn


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/mamba2-tiny-pystdlib")
    p.add_argument("--server-args", default="")
    p.add_argument("--sessions", type=int, default=4)
    p.add_argument("--turns", type=int, default=300)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--output-tokens", type=int, default=8)
    p.add_argument("--modes", default="reread,resend,session,streaming")
    p.add_argument("--out", default="session_latency.json")
    a = p.parse_args()
    ctx = a.turns * (a.new_tokens + a.output_tokens) + 64
    flags = a.server_args.split() + ["--context-length", str(ctx), "--max-sessions", str(a.sessions + 4)]
    results = {}
    modes = a.modes.split(",")
    for server_flags, group in ((flags + ["--disable-radix-cache"], [m for m in modes if m == "reread"]),
                                (flags, [m for m in modes if m != "reread"])):
        if not group:
            continue
        with launched(a.model, server_flags) as url:
            for mode in group:
                t0 = time.perf_counter()
                results[mode] = run_mode_sync(url, mode, a)
                print(f"{mode:>9}: {a.sessions} x {a.turns} turns in {time.perf_counter() - t0:.1f} s", flush=True)
    last = {m: statistics.mean(v[-10:]) for m, v in results.items()}
    print(f"\nmean latency of the last 10 turns ({a.sessions} concurrent conversations, {a.new_tokens} tokens in, "
          f"{a.output_tokens} out, history up to {ctx - 64} tokens)")
    base_mode = "reread" if "reread" in last else "resend"
    base = last.get(base_mode)
    for m, v in last.items():
        ratio = f"  {base_mode}/this = {base / v:5.2f}x" if base else ""
        print(f"  {m:>9}: {v * 1e3:8.1f} ms{ratio}")
    if "streaming" in results and a.turns >= 10:
        s = results["streaming"]
        print(f"  streaming turn 10: {s[9] * 1e3:.1f} ms, turn {a.turns}: {s[-1] * 1e3:.1f} ms "
              f"(last-10 mean / turns 6-15 mean = {last['streaming'] / statistics.mean(s[5:15]):.2f})")
    with open(a.out, "w") as f:
        json.dump({"args": vars(a), "per_turn_s": results, "last10_mean_s": last}, f, indent=1)
    print(f"wrote {a.out}")


def run_mode_sync(url, mode, a):
    return asyncio.run(run_mode(url, mode, a))


if __name__ == "__main__":
    main()
