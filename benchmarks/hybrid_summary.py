"""The table of issue 28 from a `hybrid_session.sh` run: one column per shape, from the JSON files it wrote.

  python benchmarks/hybrid_summary.py --out /tmp/out nemotron-h-8b granite-4.0-h-tiny

Rows: multi-turn TTFT of rounds 2-4 with the radix cache against `--disable-radix-cache` (8 chats x 4 rounds), the
same at 12 state slots, the slowest round of an 8-round run against the median of rounds >= 2, the first round
on a fresh server (a cold compile cache) against the same round on a server started after it (a warm one), time
to ready on each, decode step time over the bandwidth bound at each batch, prefill's share of the bf16 peak,
kernel compiles after ready (every server of the run and the e2e engine: should be 0), full garbage collections
after ready (each stops the server: few and short), the transformers baseline.
A file the run did not write leaves its cells empty.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def _load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def _ms(s: float) -> str:
    return f"{s * 1e3:.0f} ms" if s < 10 else f"{s:.1f} s"


def _span(values: list[float]) -> str:
    lo, hi = _ms(min(values)), _ms(max(values))
    if lo == hi:
        return lo
    return f"{lo[:-3]}-{hi}" if lo.endswith(" ms") and hi.endswith(" ms") else f"{lo}-{hi}"


def _later_rounds(run: dict | None, mode: str = "radix") -> list[float]:
    return [r["mean_ttft_s"] for r in run["results"][mode][1:4]] if run and mode in run["results"] else []


def column(out: Path, shape: str) -> dict[str, str]:
    e2e = _load(out / f"e2e_{shape}.json")
    mt = _load(out / f"multiturn_{shape}.json")
    slots = _load(out / f"multiturn_{shape}_slots_12.json")
    long = _load(out / f"multiturn_{shape}_rounds_8.json")
    cells: dict[str, str] = {}
    hit, cold = _later_rounds(mt), _later_rounds(mt, "no_cache")
    if hit and cold:
        ratios = [h / c for h, c in zip(hit, cold)]
        cells["hits"] = f"{_span(hit)} vs {_span(cold)} ({min(ratios):.2f}-{max(ratios):.2f}x)"
    if small := _later_rounds(slots):
        cells["slots"] = _span(small) + (f" ({min(s / c for s, c in zip(small, cold)):.2f}-"
                                         f"{max(s / c for s, c in zip(small, cold)):.2f}x)" if cold else "")
    if long and "radix" in long["results"]:
        later = [r["mean_ttft_s"] for r in long["results"]["radix"][1:]]
        worst = max(range(len(later)), key=lambda i: later[i])
        med = statistics.median(later)
        cells["rounds"] = (f"round {worst + 2}: {_ms(later[worst])} / median {_ms(med)} = "
                           f"{later[worst] / med:.2f}x")
    if mt and long and "radix" in mt["results"] and "radix" in long["results"]:
        fresh, warm = mt["results"]["radix"][0]["mean_ttft_s"], long["results"]["radix"][0]["mean_ttft_s"]
        cells["first"] = f"{_ms(fresh)} vs {_ms(warm)} ({fresh / warm:.2f}x)"
        ready = [mt["servers"].get("radix", {}).get("ready_s"), long["servers"].get("radix", {}).get("ready_s")]
        if None not in ready:
            cells["ready"] = f"{ready[0]:.0f} s / {ready[1]:.0f} s"
    if e2e:
        cells["decode"] = " / ".join(f"{r['step_ms'] / r['bound_ms']:.2f}" for r in e2e["decode"]
                                     if r["bound_ms"] == r["bound_ms"])
        p = e2e["prefill"]
        cells["prefill"] = f"{p['peak_share']:.2f} ({p['tokens_per_s']:.0f} tok/s)" if "peak_share" in p else ""
        hf = [f"b={r['batch']} " + ("OOM" if r.get("oom") else f"{r['tokens_per_s']:.0f} tok/s") for r in e2e["hf"]]
        piece = p.get("hf_requests_per_forward")
        hf.append("prefill " + ("OOM" if not p.get("hf_tokens_per_s") else f"{p['hf_tokens_per_s']:.0f} tok/s"
                                + (f" ({piece} a forward)" if piece and piece < p["requests"] else "")))
        cells["transformers"] = ", ".join(hf)
    after = [("e2e", (e2e or {}).get("kernel_compiles", {}).get("serving"))]
    for name, run in (("multi-turn", mt), ("12 slots", slots), ("8 rounds", long)):
        for mode, srv in ((run or {}).get("servers") or {}).items():
            after.append((f"{name} {mode}", srv["kernel_compiles"].get("serving")))
    watched = [srv["gc_pauses"] for run in (mt, slots, long) for srv in ((run or {}).get("servers") or {}).values()
               if "gc_pauses" in srv]
    if full := [g["2"] for g in watched if g.get("2", {}).get("count")]:
        cells["gc"] = (f"{sum(g['count'] for g in full)}, the longest <= "
                       f"{1e3 * max(g['longest_le'] for g in full):g} ms")
    elif watched:
        cells["gc"] = "0"
    counted = [(n, c) for n, c in after if c is not None]
    if counted:
        cells["compiles"] = str(sum(c for _, c in counted)) + "".join(f" ({n}: {c})" for n, c in counted if c)
    return cells


ROWS = [
    ("hits", "multi-turn (8 chats x 4 rounds, 1,024 + 64, barrier): TTFT with hits vs `--disable-radix-cache`, "
             "rounds 2-4"),
    ("slots", "the same with `--mamba-cache-size 12` (x no cache)"),
    ("rounds", "8 rounds, default pool: slowest round / median of rounds >= 2"),
    ("first", "first round: fresh server (cold compile cache) vs a server started after it (warm)"),
    ("ready", "time to ready: cold / warm compile cache"),
    ("decode", "decode, graphs, x the bandwidth bound at each batch (e2e --batches)"),
    ("prefill", "prefill (e2e --prefill), share of bf16 peak"),
    ("compiles", "kernel compiles after ready (every server and the e2e engine)"),
    ("gc", "full garbage collections after ready (every multi-turn server), the longest"),
    ("transformers", "transformers baseline (e2e)"),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shapes", nargs="+")
    p.add_argument("--out", default="/tmp/out", help="the folder hybrid_session.sh wrote its JSON files to")
    a = p.parse_args()
    cols = {s: column(Path(a.out), s) for s in a.shapes}
    print("| | " + " | ".join(a.shapes) + " |")
    print("| --- |" + " --- |" * len(a.shapes))
    for key, label in ROWS:
        print(f"| {label} | " + " | ".join(cols[s].get(key, "") for s in a.shapes) + " |")


if __name__ == "__main__":
    main()
