"""Host time of launching a step from its CUDA graph, the first launch against later ones, with the device idle
before each (the start of a multi-turn round): a hit round's extend step (8 sequences x 64 new tokens after
1,088 cached, each writing its page-aligned snapshot) and a decode step of 8 rows, through the model runner
with the graphs a server of 8 running requests captures (prefill up to 512 tokens). Random weights at the
real shape (``hybrid_step.SHAPES``); ``MAMBASERVE_PDL=0`` for the same without programmatic dependent launch.

  python3 benchmarks/graph_launch.py --shape granite-4.0-h-tiny
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from hybrid_step import SHAPES, build
from mambaserve.server.engine.batch import ForwardBatch, ForwardMode
from mambaserve.server.engine.kv_pool import KVPool
from mambaserve.server.engine.model_runner import ModelRunner
from mambaserve.server.engine.state_pool import MambaStatePool

ROWS, CONTEXT, PAGE = 24, 2048, 16
CACHED, NEW, SEQS = 1088, 64, 8


def launches(runner: ModelRunner, batch: ForwardBatch, reps: int) -> dict:
    """Host ms of ``runner.forward(batch)`` (first and median of the rest) and ms to the step's end."""
    host, total = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        runner.forward(batch)
        launched = time.perf_counter()
        torch.cuda.synchronize()
        host.append(1e3 * (launched - t))
        total.append(1e3 * (time.perf_counter() - t))
    return {"first_host_ms": host[0], "host_ms": statistics.median(host[1:]), "to_end_ms": statistics.median(total[1:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="granite-4.0-h-tiny", choices=sorted(SHAPES))
    ap.add_argument("--reps", type=int, default=25)
    a = ap.parse_args()
    dev = torch.device("cuda")
    model, dims = build(a.shape, dev, torch.bfloat16)
    pool = MambaStatePool.for_model(model, ROWS, torch.bfloat16, torch.float32, dev)
    per_row = CONTEXT // PAGE
    kv = KVPool.for_model(model, ROWS * per_row, PAGE, torch.bfloat16, dev)
    runner = ModelRunner(model, pool, dev, kv)
    t = time.perf_counter()
    runner.enable_cuda_graphs(SEQS, 512, SEQS, context_length=CONTEXT)
    out = {"shape": a.shape, "capture_s": time.perf_counter() - t}
    pages = [list(range(r * per_row, (r + 1) * per_row)) for r in range(ROWS)]
    end = CACHED + NEW
    # distinct random tokens: a MoE model's rows then route as a real batch's do (one token for all would send every
    # row to the same experts)
    ids = torch.randint(1, dims.vocab_size, (SEQS * NEW + SEQS,), generator=torch.Generator().manual_seed(0)).tolist()
    hit = ForwardBatch(ForwardMode.EXTEND, ids[:SEQS * NEW], [NEW] * SEQS, [CACHED] * SEQS, list(range(SEQS)),
                       snap=[(i, SEQS + i, end - PAGE) for i in range(SEQS)],
                       pages=[pages[i][:-(-end // PAGE)] for i in range(SEQS)])
    decode = ForwardBatch(ForwardMode.DECODE, ids[SEQS * NEW:], [1] * SEQS, [CACHED] * SEQS, list(range(SEQS)),
                          pages=[pages[i][:(CACHED + PAGE) // PAGE] for i in range(SEQS)])
    out["hit_extend"] = launches(runner, hit, a.reps)
    out["decode"] = launches(runner, decode, a.reps)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
