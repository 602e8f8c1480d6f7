"""A persisted session continued on another worker: its state loaded from storage against its history recomputed.

Two servers share one `--storage-dir` with `--session-persist` (as two pods of a fleet). For each history length, a
streaming session's first turn (the whole history, one answer token) runs on server A, which writes the session's
record and state; its next turn (a few new tokens) is sent to server B, which has never seen the session: B loads
its state from storage (`cached_tokens` = the history) and answers. Against it, on B in the same run: the same
number of tokens sent cold (new random ids, so no cache holds them): what a worker without the persisted state
would recompute. Printed per history: the turn's TTFT on B (loaded), the cold prompt's TTFT (recomputed), their
ratio, and B's `mambaserve_session_restore_seconds` (arrival to the state in a slot).

  python benchmarks/restore.py --model models/mamba2-tiny-pystdlib --histories 256,1024 --device cpu   # smoke
  python benchmarks/restore.py --model /tmp/m27 --histories 2048,8192,32768                           # GPU
  python benchmarks/restore.py --model /tmp/nemotron-h-8b --histories 2048,8192,32768                 # hybrid GPU

(`e2e.py --size 2.7b --keep-checkpoint /tmp/m27` and `e2e.py --size nemotron-h-8b --checkpoint /tmp/nemotron-h-8b`
build the random-weight checkpoints.)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _server import launched, metric, sharing_one_device  # noqa: E402 (the script's folder)

BUNDLED = Path(__file__).resolve().parents[1] / "models" / "mamba2-tiny-pystdlib"


def streamed(url: str, body: dict, headers: dict | None = None) -> tuple[float, dict]:
    """One streamed /generate: (seconds to the first token, the last event's meta_info)."""
    body = {**body, "stream": True}
    t0, ttft, meta = time.perf_counter(), None, {}
    with httpx.stream("POST", url + "/generate", json=body, headers=headers, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.read().decode()[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            if "error" in event:
                raise RuntimeError(str(event["error"]))
            if ttft is None and event.get("output_ids"):
                ttft = time.perf_counter() - t0
            meta = event.get("meta_info", meta)
    return ttft, meta


def restore_seconds(url: str) -> tuple[float, int]:
    """(sum, count) of the server's mambaserve_session_restore_seconds."""
    return (metric(url, "mambaserve_session_restore_seconds_sum"),
            int(metric(url, "mambaserve_session_restore_seconds_count")))


def run(a_url: str, b_url: str, histories: list[int], turn: int, repeat: int, vocab: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    words = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    greedy = {"temperature": 0, "ignore_eos": True}
    streamed(b_url, {"input_ids": words(histories[0]), "sampling_params": {"max_new_tokens": 1, **greedy}})  # warm
    rows = []
    for n in histories:
        loaded, cold, cached = [], [], []
        r0 = restore_seconds(b_url)
        for k in range(repeat):
            sid = f"restore-{n}-{k}-{seed}"
            first = {"input_ids": words(n), "session_params": {"id": sid, "open": True, "streaming": True},
                     "sampling_params": {"max_new_tokens": 1, **greedy}}
            _, meta = streamed(a_url, first, {"x-smg-routing-key": sid})
            if not meta.get("session_persisted", True):
                raise RuntimeError(f"server A did not persist session {sid}: {meta}")
            nxt = {"input_ids": words(turn), "session_params": {"id": sid, "close": True},
                   "sampling_params": {"max_new_tokens": 1, **greedy}}
            t, meta = streamed(b_url, nxt, {"x-smg-routing-key": sid})
            loaded.append(t)
            cached.append(meta.get("cached_tokens", 0))
            t, _ = streamed(b_url, {"input_ids": words(n + 1 + turn), "sampling_params": {"max_new_tokens": 1,
                                                                                             **greedy}})
            cold.append(t)
        r1 = restore_seconds(b_url)
        restores = r1[1] - r0[1]
        rows.append({"history": n, "loaded_ttft_s": statistics.median(loaded), "cold_ttft_s": statistics.median(cold),
                     "cached_tokens": min(cached), "restores": restores,
                     "restore_s": (r1[0] - r0[0]) / restores if restores else None})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(BUNDLED))
    p.add_argument("--histories", default="2048,8192,32768", help="history lengths in tokens")
    p.add_argument("--turn", type=int, default=16, help="new tokens of the continued turn")
    p.add_argument("--repeat", type=int, default=3, help="sessions per history (medians printed)")
    p.add_argument("--vocab", type=int, default=4000, help="draw token ids below this")
    p.add_argument("--device", help="the servers' --device (default: theirs)")
    p.add_argument("--server-args", default="", help="more flags for both servers")
    p.add_argument("--storage-dir", help="the shared storage directory (default: a new temporary one)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="restore.json")
    a = p.parse_args()
    histories = [int(x) for x in a.histories.split(",")]
    with contextlib.ExitStack() as stack:
        storage = a.storage_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="mambaserve-restore-"))
        flags = ["--storage-dir", storage, "--session-persist", "--context-length", str(max(histories) + a.turn + 64),
                 *(["--device", a.device] if a.device else [])]
        a_url, b_url = (stack.enter_context(launched(a.model, flags + sharing_one_device(i) + a.server_args.split()))
                        for i in range(2))
        rows = run(a_url, b_url, histories, a.turn, a.repeat, a.vocab, a.seed)
    print(f"{a.model}: a session's next turn ({a.turn} new tokens) on a second server, its state loaded from storage, "
          f"against the same number of tokens recomputed there (median of {a.repeat})")
    print("| history | loaded: TTFT | cached tokens | restore (server) | recomputed: TTFT | loaded / recomputed |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        restore = f"{r['restore_s'] * 1e3:.1f} ms" if r["restore_s"] is not None else "none counted"
        print(f"| {r['history']} | {r['loaded_ttft_s'] * 1e3:.1f} ms | {r['cached_tokens']} | {restore} | "
              f"{r['cold_ttft_s'] * 1e3:.1f} ms | {r['loaded_ttft_s'] / r['cold_ttft_s']:.2f}x |")
    Path(a.json).write_text(json.dumps({"model": a.model, "turn": a.turn, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
