"""How much session snapshots stall a neighbour's stream (issue 33, item 2).

A server with --session-snapshot-dir holding N snapshot files (copies of one real snapshot); one client
streams a long generation while M clients snapshot their own streaming sessions back to back. The
neighbour's stream is measured by the gaps between its chunks: tokens/s, p99 and longest gap, and the
same stream alone in the same server (the baseline). Snapshot latency and count are printed beside.

  python benchmarks/snapshot_stall.py --files 0,2000 --snapshotters 8 --seconds 10
  python benchmarks/snapshot_stall.py --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from _server import launched  # noqa: E402 (the script's folder is on sys.path)

MODEL = str(Path(__file__).resolve().parents[1] / "models" / "mamba2-tiny-pystdlib")


async def neighbour(c: httpx.AsyncClient, tokens: int, stop: asyncio.Event | None = None) -> dict:
    """One streamed generation; the arrival time of every chunk."""
    body = {"input_ids": [5, 6, 7], "stream": True,
            "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}}
    times, counts = [], []
    async with c.stream("POST", "/generate", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                times.append(time.perf_counter())
                counts.append(json.loads(line[5:])["meta_info"]["completion_tokens"])
                if stop is not None and stop.is_set():
                    break
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {"tokens_per_s": round((counts[-1] - counts[0]) / (times[-1] - times[0]), 1),
            "p50_gap_ms": round(1e3 * statistics.median(gaps), 2),
            "p99_gap_ms": round(1e3 * sorted(gaps)[int(0.99 * (len(gaps) - 1))], 2),
            "max_gap_ms": round(1e3 * max(gaps), 1), "tokens": counts[-1]}


async def snapshotter(c: httpx.AsyncClient, i: int, until: float) -> list[float]:
    sid = (await c.post("/open_session", json={"streaming": True})).json()
    r = await c.post("/generate", json={"input_ids": [9, 10, 11 + i], "session_params": {"id": sid},
                                        "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    r.raise_for_status()
    took = []
    while time.perf_counter() < until:
        t = time.perf_counter()
        r = await c.post(f"/sessions/{sid}/snapshot", json={"name": f"bench-{i}"})
        r.raise_for_status()
        took.append(time.perf_counter() - t)
    await c.post("/close_session", json={"session_id": sid})
    return took


async def measure(url: str, files: int, snapshotters: int, seconds: float, directory: Path) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        # one real snapshot, copied N times: every file a scan could read
        sid = (await c.post("/open_session", json={"streaming": True})).json()
        await c.post("/generate", json={"input_ids": [3, 4], "session_params": {"id": sid},
                                        "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
        (await c.post(f"/sessions/{sid}/snapshot", json={"name": f"seed-{files}"})).raise_for_status()
        seed = directory / f"seed-{files}"
        for k in range(files):
            shutil.copyfile(seed, directory / f"copy-{k}")
        alone = await neighbour(c, 400)
        until = time.perf_counter() + seconds
        stop = asyncio.Event()
        snaps = [asyncio.ensure_future(snapshotter(c, i, until)) for i in range(snapshotters)]
        busy = asyncio.ensure_future(neighbour(c, 30_000, stop))
        took = [t for ts in await asyncio.gather(*snaps) for t in ts]
        stop.set()
        beside = await busy
        await c.post("/close_session", json={"session_id": sid})
        for p in directory.iterdir():
            p.unlink()
    return {"files": files, "snapshotters": snapshotters, "alone": alone, "beside_snapshots": beside,
            "snapshots": len(took), "snapshot_p50_ms": round(1e3 * statistics.median(took), 1) if took else None,
            "snapshot_max_ms": round(1e3 * max(took), 1) if took else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--files", default="0,2000", help="snapshot files in the directory, one run per value")
    ap.add_argument("--snapshotters", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--json")
    a = ap.parse_args()
    directory = Path(tempfile.mkdtemp(prefix="snapshot-stall-"))
    flags = ["--session-snapshot-dir", str(directory), "--session-snapshot-max-per-session", "100000",
             "--session-snapshot-max-bytes", "1TiB", "--context-length", "32768", "--max-sessions", "100000"]
    results = []
    try:
        with launched(a.model, flags) as url:
            for files in (int(x) for x in a.files.split(",")):
                res = asyncio.run(measure(url, files, a.snapshotters, a.seconds, directory))
                print(json.dumps(res), flush=True)
                results.append(res)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
