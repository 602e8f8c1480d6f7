"""One decode step under CUDA graphs against the memory-bandwidth bound, per batch size.

Builds random-weight Mamba2 models of real sizes (mamba2-130m / mamba2-2.7b dimensions, checkpoints
written by transformers as in e2e.py), loads them with the engine's loader, captures the decode CUDA
graphs through ``ModelRunner.enable_cuda_graphs`` and, for each batch size, prints in the same run:
  the graph replay time per step (CUDA events around each replay, median of --replays);
  the bandwidth bound: bytes read and written per step (every weight once; each row's conv and ssm
    state read and written once) / device-to-device copy bandwidth measured in this run;
  their ratio (the goal is within 1.3x of the bound).
With --profile: the kernels of one step (batch --profile-batch; torch.profiler around one graph replay) by total
device time, the number of kernels per step and per layer, and the share of the step spent between
kernels. With --projections: each projection of the model at batch 1, its norm kernel + cuBLAS against
the fused kernels.*norm_linear and a sweep of its tiles, as a fraction of copy bandwidth. --unfused
captures the graphs with norms and projections as separate kernels (KernelConfig(fuse_norm_linear=False),
the A/B baseline). --variants times the same graphs again, captured again, under other kernels.KernelConfig
settings (tiles, early reads, fusion, PDL of the gated norm) or environment variables (MAMBASERVE_PDL) in
the same process, set on the model with ``use_kernel_config`` and restored after.

  python3 benchmarks/decode_step.py --size 2.7b --profile
  python3 benchmarks/decode_step.py --size 130m,2.7b --batches 1,8,64 --json decode_step.json
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from e2e import SIZES, build_checkpoint, copy_bandwidth  # benchmarks/ is sys.path[0] when run as a script

DTYPE = torch.bfloat16
STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build_runner(size: str, max_batch: int, state_dtype: torch.dtype, unfused: bool = False):
    """A ModelRunner over a random-weight model of ``size`` with decode graphs up to ``max_batch``
    (``unfused``: norms and projections as separate kernels)."""
    from mambaserve.kernels import KernelConfig
    from mambaserve.server.model.loader import load_model
    from mambaserve.server.engine.model_runner import ModelRunner
    from mambaserve.server.engine.state_pool import MambaStatePool

    tmp = Path(tempfile.mkdtemp(prefix="mambaserve-decode-step-"))
    try:
        build_checkpoint(size, tmp, "cuda", DTYPE)  # only the files are needed: drop transformers' model
        gc.collect()
        torch.cuda.empty_cache()
        model, _ = load_model(tmp, DTYPE, torch.device("cuda"), KernelConfig(fuse_norm_linear=not unfused))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    pool = MambaStatePool.for_model(model, max_batch, DTYPE, state_dtype, "cuda")
    runner = ModelRunner(model, pool, torch.device("cuda"))
    runner.enable_cuda_graphs(max_batch)
    return runner


def prepare(runner, batch: int, vocab: int) -> torch.cuda.CUDAGraph:
    """Fill the graphs' static inputs for ``batch`` rows (slots 0..batch-1, padding up to the bucket) and
    return the graph that serves it."""
    g = runner.graphs
    bucket = next(b for b in g.buckets if b >= batch)
    g.inputs.ids[:batch].copy_(torch.randint(1, vocab, (batch,), device="cuda"))
    g.inputs.slots[:batch].copy_(torch.arange(batch, device="cuda"))
    g.inputs.slots[batch:bucket].fill_(-1)
    return g.graphs[bucket]


def replay_ms(graph: torch.cuda.CUDAGraph, replays: int, warmup: int = 20) -> float:
    for _ in range(warmup):
        graph.replay()
    marks = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
    for start, end in marks:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in marks)


def profile_step(graph: torch.cuda.CUDAGraph, num_layers: int, step_ms: float, top: int, batch: int = 1) -> dict:
    """Kernels of one graph replay, grouped by name; printed as a table, returned as a dict."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    device = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    kernels = [e for e in device if not e.name.startswith(("Memcpy", "Memset"))]
    if not kernels:
        print("the profiler saw no kernel inside the graph replay (CUPTI without graph-node tracing?): "
              "kernel counts unavailable", flush=True)
        return {}
    by_name: dict[str, list[float]] = collections.defaultdict(list)
    kernels.sort(key=lambda e: e.time_range.start)
    n_proj, i = sum("norm_linear" in e.name for e in kernels), 0
    for e in kernels:
        name = e.name
        if "norm_linear" in name:  # the fused projections run in_proj, out_proj per layer, then lm_head
            name += " (lm_head)" if i == n_proj - 1 else " (in_proj)" if i % 2 == 0 else " (out_proj)"
            i += 1
        by_name[name].append(e.time_range.elapsed_us())
    busy_us = sum(sum(v) for v in by_name.values())
    rows = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))
    title = f"kernel (one batch-{batch} step, graph replay)"
    print(f"\n{title:<88} {'calls':>6} {'total us':>9} {'mean us':>8} {'%':>5}")
    for name, times in rows[:top]:
        short = name if len(name) <= 88 else name[:85] + "..."
        print(f"{short:<88} {len(times):6d} {sum(times):9.1f} {sum(times) / len(times):8.2f} "
              f"{100 * sum(times) / busy_us:5.1f}")
    if len(rows) > top:
        rest = [t for _, times in rows[top:] for t in times]
        print(f"{'(' + str(len(rows) - top) + ' other kernels)':<88} {len(rest):6d} {sum(rest):9.1f}")
    gap = 1 - busy_us / 1e3 / step_ms
    print(f"kernels per step: {len(kernels)} ({len(kernels) / num_layers:.2f} per layer over {num_layers} layers; "
          f"{len(device) - len(kernels)} memcpy/memset); kernel time {busy_us / 1e3:.3f} ms of a "
          f"{step_ms:.3f} ms step: {100 * max(gap, 0):.0f}% between kernels", flush=True)
    if gap < 0:
        print("(kernels overlap: with programmatic dependent launch a kernel's time includes its wait for "
              "the one before; MAMBASERVE_PDL=0 gives per-kernel times)", flush=True)
    return {"kernels_per_step": len(kernels), "kernels_per_layer": len(kernels) / num_layers,
            "memcpy_memset": len(device) - len(kernels), "kernel_time_ms": busy_us / 1e3,
            "top": [{"name": n, "calls": len(t), "total_us": sum(t)} for n, t in rows[:top]]}


def graph_us(fn, calls: int = 16, replays: int = 20) -> float:
    """Device time of one ``fn()`` call: ``calls`` calls captured in a CUDA graph, median replay."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    return replay_ms(g, replays) * 1e3 / calls


def bench_projections(size: str, bw: float) -> list[dict]:
    """Batch-1 projections, unfused (norm kernel + cuBLAS) vs kernels.*norm_linear, with a tile sweep.
    Each call reads one of several weight copies (> 50 MB L2 in all), as a decode step reads every
    layer's weight once."""
    import torch.nn.functional as F

    from mambaserve.kernels import gated_rmsnorm, rmsnorm
    from mambaserve.kernels.norm_linear import _tiles, gated_rmsnorm_linear, rmsnorm_linear

    s = SIZES[size]
    H, d_inner = s["hidden_size"], 2 * s["hidden_size"]
    shapes = {"in_proj": (2 * d_inner + 2 * s["state_size"] + s["num_heads"], H),
              "out_proj": (H, d_inner), "lm_head": (s["vocab_size"], H)}
    sweep = [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w, STAGES=st) for bn in (4, 8) for bk in (512, 1024)
             for w in (2, 4) for st in (1, 4)]  # each with the default's other knobs (prefetch, ACC_2D)
    rows = []
    for name, (N, K) in shapes.items():
        copies = max(2, -(-200_000_000 // (N * K * 2)))
        ws = [torch.randn(N, K, device="cuda", dtype=DTYPE) for _ in range(copies)]
        x, z = (torch.randn(1, K, device="cuda", dtype=DTYPE) for _ in range(2))
        res, nw = torch.randn(1, K, device="cuda"), torch.ones(K, device="cuda", dtype=DTYPE)
        it = {"i": 0}

        def call(f):
            def go():
                it["i"] = (it["i"] + 1) % copies
                return f(ws[it["i"]])
            return go

        if name == "out_proj":
            unfused = lambda w: F.linear(gated_rmsnorm(x, z, nw, 1e-5, K), w)  # noqa: E731
            fused = lambda w, c=None: gated_rmsnorm_linear(x, z, nw, 1e-5, K, w, tiles=c)  # noqa: E731
        else:
            unfused = lambda w: F.linear(rmsnorm(x, res, nw, 1e-5, True)[0], w)  # noqa: E731
            fused = lambda w, c=None: rmsnorm_linear(x, res, nw, 1e-5, True, w, tiles=c)  # noqa: E731
        ref = graph_us(call(unfused), calls=copies * 4)
        configs = [_tiles(K)] + [{**_tiles(K), **c} for c in sweep]
        ours = {tuple(sorted(c.items())): graph_us(call(lambda w, c=c: fused(w, c)), calls=copies * 4)
                for c in configs}
        default = ours[tuple(sorted(_tiles(K).items()))]
        best_cfg, best = min(ours.items(), key=lambda kv: kv[1])
        frac = lambda us: N * K * 2 / (us * 1e-6) / bw  # noqa: E731
        rows.append({"size": size, "proj": name, "N": N, "K": K, "unfused_us": ref, "fused_us": default,
                     "best_us": best, "best_tiles": dict(best_cfg),
                     "sweep": [{"config": dict(c), "us": us} for c, us in ours.items()]})
        print(f"{size} {name:8} {N:6}x{K:5} b=1: norm + cuBLAS {ref:7.2f} us ({frac(ref):4.0%} of copy), fused "
              f"{default:7.2f} us ({frac(default):4.0%}), best {best:7.2f} us ({frac(best):4.0%}) "
              f"{dict(best_cfg)} -> {ref / default:4.2f}x unfused", flush=True)
        del ws
        torch.cuda.empty_cache()
    return rows


def apply_variant(model, v: dict):
    """Apply one --variants entry: its KernelConfig fields over the model's config (``use_kernel_config``;
    ``linear_tiles`` keyed by K, JSON's string keys made ints), and its ``"env.NAME": value`` entries in
    os.environ. Returns a function that restores both; capture the graphs again after either."""
    import dataclasses
    import os

    from mambaserve.kernels import KernelConfig

    fields = {k: value for k, value in v.items() if not k.startswith("env.")}
    if "linear_tiles" in fields:  # JSON keys are strings
        fields["linear_tiles"] = {int(k): t for k, t in fields["linear_tiles"].items()}
    if "state_update_small_tiles" in fields:
        fields["state_update_small_tiles"] = tuple(fields["state_update_small_tiles"])
    unknown = set(fields) - {f.name for f in dataclasses.fields(KernelConfig)}
    if unknown:
        raise SystemExit(f"unknown KernelConfig fields in --variants: {sorted(unknown)}")
    old_config = model.kernel_config
    model.use_kernel_config(dataclasses.replace(old_config, **fields))
    undo = [lambda: model.use_kernel_config(old_config)]
    for key, value in v.items():
        if key.startswith("env."):
            name, old = key[4:], os.environ.get(key[4:])
            os.environ[name] = str(value)
            undo.append(lambda n=name, o=old: os.environ.pop(n) if o is None else os.environ.__setitem__(n, o))
    return lambda: [u() for u in reversed(undo)]


def bench_size(size: str, batches: list[int], a: argparse.Namespace, bw: float) -> dict:
    runner = build_runner(size, max(batches), STATE_DTYPES[a.state_dtype], a.unfused)
    model, pool = runner.model, runner.pool
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # a tied head counts once
    state_bytes = pool.bytes_per_slot
    print(f"{size}: {model.dims.num_layers} layers, weights {weight_bytes / 1e9:.3f} GB, state "
          f"{state_bytes / 1e6:.2f} MB per row ({a.state_dtype} ssm), graphs for batches {runner.graphs.buckets}",
          flush=True)
    res = {"size": size, "weight_bytes": weight_bytes, "state_bytes_per_row": state_bytes, "decode": []}
    for b in batches:
        graph = prepare(runner, b, SIZES[size]["vocab_size"])
        step_ms = replay_ms(graph, a.replays)
        bound_ms = (weight_bytes + 2 * b * state_bytes) / bw * 1e3
        res["decode"].append({"batch": b, "step_ms": step_ms, "bound_ms": bound_ms, "ratio": step_ms / bound_ms})
        print(f"{size} decode b={b:3d}: {step_ms:8.3f} ms/step (graph replay, median of {a.replays}), bound "
              f"{bound_ms:8.3f} ms/step -> {step_ms / bound_ms:5.2f}x the bound", flush=True)
    for v in a.variants:
        undo = apply_variant(model, v)
        runner.enable_cuda_graphs(max(batches))  # the config is baked into the graphs: capture again
        for b in batches:
            step_ms = replay_ms(prepare(runner, b, SIZES[size]["vocab_size"]), a.replays)
            base = next(r["step_ms"] for r in res["decode"] if r["batch"] == b)
            res.setdefault("variants", []).append({"variant": v, "batch": b, "step_ms": step_ms})
            print(f"{size} decode b={b:3d} {json.dumps(v)}: {step_ms:8.3f} ms/step -> {base / step_ms:5.3f}x "
                  f"the default ({base:.3f} ms)", flush=True)
        if a.profile:
            graph = prepare(runner, a.profile_batch, SIZES[size]["vocab_size"])
            profile_step(graph, model.dims.num_layers, replay_ms(graph, a.replays), a.top, a.profile_batch)
        undo()
    if a.variants:
        runner.enable_cuda_graphs(max(batches))
    if a.profile:
        graph = prepare(runner, a.profile_batch, SIZES[size]["vocab_size"])
        res["profile"] = {"batch": a.profile_batch, **profile_step(graph, model.dims.num_layers,
                                                                   replay_ms(graph, a.replays), a.top, a.profile_batch)}
    del runner, model, pool
    gc.collect()
    torch.cuda.empty_cache()
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="130m,2.7b", help=f"comma-separated, of {', '.join(SIZES)}")
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--replays", type=int, default=200, help="timed graph replays per batch size")
    p.add_argument("--state-dtype", default="float32", choices=sorted(STATE_DTYPES),
                   help="ssm state dtype (the server's --state-dtype; default as the server's)")
    p.add_argument("--profile", action="store_true", help="profile one step: top kernels, kernels per step")
    p.add_argument("--profile-batch", type=int, default=1, help="the batch --profile profiles (one of --batches)")
    p.add_argument("--top", type=int, default=25, help="kernels listed by --profile")
    p.add_argument("--unfused", action="store_true",
                   help="norms and projections as separate kernels (norm kernel + cuBLAS) instead of fused: "
                        "KernelConfig(fuse_norm_linear=False), the A/B baseline")
    p.add_argument("--projections", action="store_true",
                   help="also time each batch-1 projection: norm + cuBLAS vs fused (and a tile sweep)")
    p.add_argument("--variants", type=json.loads, default=[],
                   help='JSON list of variants, each timed after the default with the graphs captured again: '
                        'an object of kernels.KernelConfig fields (over the default) and "env.NAME" entries, e.g. '
                        '\'[{"linear_tiles": {"5120": {"PREFETCH_COLS": 0}}}, {"early_state": false}, '
                        '{"env.MAMBASERVE_PDL": 0}]\'')
    p.add_argument("--json", help="write the results here")
    a = p.parse_args()
    sizes = a.size.split(",")
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        p.error(f"unknown size {', '.join(unknown)}; choose from {', '.join(SIZES)}")
    batches = [int(x) for x in a.batches.split(",")]
    if a.profile and a.profile_batch not in batches:
        p.error(f"--profile-batch {a.profile_batch} is not one of --batches {a.batches}")
    if not torch.cuda.is_available():
        sys.exit("decode_step.py needs a CUDA device (it times CUDA-graph replays); torch.cuda.is_available() "
                 "is False here")

    bw = copy_bandwidth("cuda")
    print(f"{torch.cuda.get_device_name()}: device-to-device copy {bw / 1e12:.3f} TB/s (read + write)", flush=True)
    res = {"device": torch.cuda.get_device_name(), "copy_bandwidth_GBps": bw / 1e9, "torch": torch.__version__,
           "norm_and_projection": "unfused" if a.unfused else "fused",
           "sizes": [bench_size(s, batches, a, bw) for s in sizes]}
    if a.projections:
        res["projections"] = [r for s in sizes for r in bench_projections(s, bw)]
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
