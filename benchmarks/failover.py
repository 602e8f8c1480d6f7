"""Streaming sessions through the real sglang-router while one of two workers is killed (`kill -9`) mid-run.

Two servers share one `--storage-dir` with `--session-persist`, behind `sglang_router` (policy `manual`,
assignment `min_group`; a turn carries `session_params` and its session id as `x-smg-routing-key`). N sessions
send R rounds of turns (the first turn the whole first prompt, then a few new tokens each), all sessions of a round
at once. After round K the worker holding the most sessions is killed; its sessions' next turns reach the other
worker, which loads their state from storage. Printed per round: mean TTFT, the share of each turn's history served
from a state (`cached_tokens` / (prompt tokens - the turn's new tokens): 1.0 when every turn went on from its
state, loaded or live), turns retried after a 5xx (the router learning the worker is gone), and the survivor's
restores. Rounds before the kill are the baseline.

  python benchmarks/failover.py --sessions 8 --rounds 6 --kill-after 3 --first 512 --device cpu   # smoke
  python benchmarks/failover.py --model /tmp/m27 --sessions 16 --rounds 8 --kill-after 4 --first 2048
  python benchmarks/failover.py --model /tmp/nemotron-h-8b --sessions 16 --rounds 8 --kill-after 4 --first 2048

Needs `sglang-router` (`pip install sglang-router==0.3.2`; on the GPU machine its wheel is carried in `.whl/`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _server import free_port, launched, metric, sharing_one_device  # noqa: E402 (the script's folder)

BUNDLED = Path(__file__).resolve().parents[1] / "models" / "mamba2-tiny-pystdlib"


@contextlib.contextmanager
def router(worker_urls: list[str]):
    """sglang-router on a free port, health-checking every second, once every worker is healthy."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
         "--worker-urls", *worker_urls, "--policy", "manual", "--assignment-mode", "min_group",
         "--health-check-interval-secs", "1", "--health-failure-threshold", "1", "--log-level", "warn",
         "--prometheus-port", str(free_port())], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.TransportError, ValueError, KeyError):
                workers = httpx.get(url + "/workers", timeout=2).json()["workers"]
                if len(workers) == len(worker_urls) and all(w["is_healthy"] for w in workers):
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the router did not start: " + proc.stderr.read().decode()[-2000:])
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        if proc.poll() is None:
            proc.kill()


async def turn(c: httpx.AsyncClient, sid: str, ids: list[int], first: bool, out: int) -> dict:
    """One streamed turn through the router, retried every 0.5 s on a 5xx (at most 20 times)."""
    body = {"input_ids": ids, "stream": True,
            "session_params": {"id": sid, **({"open": True, "streaming": True} if first else {})},
            "sampling_params": {"max_new_tokens": out, "temperature": 0, "ignore_eos": True}}
    for retries in range(20):
        t0, ttft, meta = time.perf_counter(), None, None
        async with c.stream("POST", "/generate", json=body, headers={"x-smg-routing-key": sid}) as r:
            if r.status_code >= 500:
                await r.aread()
                await asyncio.sleep(0.5)
                continue
            if r.status_code != 200:
                raise RuntimeError(f"{sid}: {r.status_code} {(await r.aread()).decode()[:300]}")
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    if ttft is None and event.get("output_ids"):
                        ttft = time.perf_counter() - t0
                    meta = event["meta_info"]
        return {"ttft": ttft, "prompt": meta["prompt_tokens"], "cached": meta["cached_tokens"], "retries": retries}
    raise RuntimeError(f"{sid}: 20 retries")


async def run(url: str, workers: list[tuple[str, subprocess.Popen]], a: argparse.Namespace) -> list[dict]:
    rng = random.Random(a.seed)
    words = lambda n: [rng.randrange(3, a.vocab) for _ in range(n)]  # noqa: E731
    rows, killed = [], None
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        for r in range(a.rounds):
            if r == a.kill_after:
                counts = [metric(u, "mambaserve_sessions_open") for u, _ in workers]
                victim = max(range(len(workers)), key=lambda i: counts[i])
                workers[victim][1].send_signal(signal.SIGKILL)
                killed = {"worker": victim, "sessions_open": counts}
                restores_before = metric(workers[1 - victim][0], 'mambaserve_session_restores_total{result="loaded"}')
            new = a.first if r == 0 else a.turn
            answers = await asyncio.gather(*(turn(c, f"fo-{a.seed}-{k}", words(new), r == 0, a.output)
                                             for k in range(a.sessions)))
            history = [x["prompt"] - new for x in answers]
            rows.append({"round": r + 1, "after_kill": killed is not None and r >= a.kill_after,
                         "mean_ttft_s": statistics.mean(x["ttft"] for x in answers),
                         "state_share": (sum(x["cached"] for x in answers) / sum(history)) if sum(history) else None,
                         "retried_turns": sum(x["retries"] > 0 for x in answers)})
    if killed is not None:
        survivor = workers[1 - killed["worker"]][0]
        killed["survivor_loaded_restores"] = metric(
            survivor, 'mambaserve_session_restores_total{result="loaded"}') - restores_before
        killed["survivor_recomputed_restores"] = metric(survivor, 'mambaserve_session_restores_total{result="recomputed"}')
    return rows, killed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(BUNDLED))
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--kill-after", type=int, default=3, help="kill a worker after this many rounds")
    p.add_argument("--first", type=int, default=512, help="tokens of a session's first turn")
    p.add_argument("--turn", type=int, default=32, help="new tokens of each later turn")
    p.add_argument("--output", type=int, default=16, help="tokens answered per turn")
    p.add_argument("--vocab", type=int, default=4000)
    p.add_argument("--device", help="the servers' --device (default: theirs)")
    p.add_argument("--server-args", default="", help="more flags for both servers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="failover.json")
    a = p.parse_args()
    context = a.first + a.rounds * (a.turn + a.output) + 64
    with contextlib.ExitStack() as stack:
        storage = stack.enter_context(tempfile.TemporaryDirectory(prefix="mambaserve-failover-"))
        flags = ["--storage-dir", storage, "--session-persist", "--context-length", str(context),
                 *(["--device", a.device] if a.device else [])]
        workers = [stack.enter_context(launched(a.model, flags + sharing_one_device(i) + a.server_args.split(),
                                                process=True)) for i in range(2)]
        url = stack.enter_context(router([u for u, _ in workers]))
        rows, killed = asyncio.run(run(url, workers, a))
    print(f"{a.model}: {a.sessions} streaming sessions x {a.rounds} rounds through sglang-router, 2 workers on one "
          f"storage directory; first turn {a.first} tokens, then {a.turn} new + {a.output} answered")
    if killed:
        print(f"after round {a.kill_after}: worker {killed['worker']} killed (kill -9) holding "
              f"{killed['sessions_open'][killed['worker']]:g} of the sessions; the survivor loaded "
              f"{killed['survivor_loaded_restores']:g} from storage, recomputed {killed['survivor_recomputed_restores']:g}")
    print("| round | mean TTFT | history from a state | turns retried |")
    print("| --- | --- | --- | --- |")
    for r in rows:
        share = "-" if r["state_share"] is None else f"{r['state_share']:.3f}"
        mark = " (after the kill)" if r["after_kill"] else ""
        print(f"| {r['round']}{mark} | {r['mean_ttft_s'] * 1e3:.1f} ms | {share} | {r['retried_turns']} |")
    Path(a.json).write_text(json.dumps({"rows": rows, "killed": killed, "args": vars(a)}, indent=1))


if __name__ == "__main__":
    main()
