"""Prefill throughput and TTFT of the engine under scan variants, alternating in one process (CUDA).

    python benchmarks/prefill_ab.py --variants '{"new": {}, "pointers": {"tma": false, "state_tma": false}}' \
        [--baseline old_ssd_scan.py] [--size 2.7b] [--rounds 3]

Each variant is a SCAN_CONFIG override for kernels/ssd_scan.py (the model's KernelConfig.scan_tiles); a variant
named "baseline*" runs the file given by --baseline (a previous ssd_scan.py; scan_ab.py's docstring says where
its ssd_scan_kernels.py goes) instead. Per round and variant: prefill tokens/s of 8 x 2048
tokens, TTFT of one 2048- and one 8192-token prompt (each after a warm-up of the same shape), and the host
time of one scan call at 2048 tokens (launch only, no synchronisation; rough, since the engine's scheduler
thread shares the interpreter); medians over the rounds at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e  # noqa: E402
import kernels as kb  # noqa: E402


def host_us(fn, n=50):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    dt = (time.perf_counter() - t) / n
    torch.cuda.synchronize()
    return dt * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default='{"default": {}}')
    ap.add_argument("--baseline")
    ap.add_argument("--size", default="2.7b", choices=sorted(e2e.SIZES))
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    import dataclasses

    import mambaserve.kernels as K
    from mambaserve.server.config import ServerConfig
    from mambaserve.server.engine.engine import Engine

    base_fn = None
    if a.baseline:
        base_fn = kb.scan_launcher(kb.load_file(a.baseline))
    new_fn = K.ssd_scan_varlen
    tmp = Path(tempfile.mkdtemp(prefix="mambaserve-prefill-ab-"))
    e2e.build_checkpoint(a.size, tmp, "cuda", torch.bfloat16)
    cfg = e2e.SIZES[a.size]
    engine = Engine(ServerConfig(model=str(tmp), tokenizer=str(e2e.TOKENIZER), device="cuda", dtype="bfloat16",
                                 max_running_requests=16, mamba_cache_size=24, chunked_prefill_size=8192,
                                 disable_radix_cache=True, context_length=8192 + 128, cuda_graph_max_bs=8))
    engine.start()
    gen = torch.Generator().manual_seed(0)

    def run(n, length):
        prompts = [torch.randint(1, cfg["vocab_size"], (length,), generator=gen).tolist() for _ in range(n)]
        return asyncio.run(e2e.timed_batch(engine, prompts, 1))

    x, dt, A, B, C, D, bias, pool, kw = kb.scan_inputs(1, 2048)
    default = engine.model.kernel_config
    res = {}
    for rnd in range(a.rounds):
        for name, override in json.loads(a.variants).items():
            engine.model.use_kernel_config(dataclasses.replace(default, scan_tiles=override))
            fn = base_fn if name.startswith("baseline") else new_fn
            K.ssd_scan_varlen = fn  # a previous file's launcher: the model calls kernels.ssd_scan_varlen
            run(8, 2048), run(1, 2048), run(1, 8192)  # warm-up: compiles per shape class
            _, ends = run(8, 2048)
            f2, _ = run(1, 2048)
            f8, _ = run(1, 8192)
            host = host_us(lambda: fn(x, dt, A, B, C, tiles=override, **kw))
            row = dict(prefill=16384 / max(ends), ttft_2k_ms=f2[0] * 1e3, ttft_8k_ms=f8[0] * 1e3, scan_host_us=host)
            for k, v in row.items():
                res.setdefault(name, {}).setdefault(k, []).append(v)
            print(rnd, name, {k: round(v, 1) for k, v in row.items()}, flush=True)
    engine.model.use_kernel_config(default)
    K.ssd_scan_varlen = new_fn
    for name, r in res.items():
        print("median", name, {k: round(statistics.median(v), 1) for k, v in r.items()}, flush=True)
    engine.stop()


if __name__ == "__main__":
    main()
