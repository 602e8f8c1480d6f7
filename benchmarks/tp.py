"""Tensor parallelism's decode speed: TP 2 against TP 1 and against two TP-1 replicas, per batch size.

Two processes, one per device (``torch.multiprocessing``; NCCL, or gloo on CPU), build the same random-weight
model of a real shape in place (no checkpoint: a 47B one would take minutes to write and read) and run the
engine's decode steps through the engine's model runner, the decode CUDA graphs captured with the all-reduces
inside. For each shape:

- TP 1 on each device at once: a step's time on device 0 (the TP-1 latency; device 1's at the same time is the
  second replica) and the two replicas' tokens per second together;
- TP 2 over both devices: a step's time, tokens per second, and the step's memory-bandwidth bound per rank (its
  weights' share, every row's state read and written, the rows' KV read, over the copy bandwidth measured);
- ``tp2_over_tp1`` (the goal at batch 1: <= 0.6) and ``tp2_over_replicas`` (throughput, batch 64/256);
- the time of one all-reduce of a decode row (``[batch, hidden]``) replayed in a CUDA graph: what each
  layer's sum costs.

A shape that does not fit one device (nemotron-h-47b, ~94 GB in bf16) runs at TP 2 only. Decode rows sit at
``--context`` tokens (their KV pages allocated; the values are whatever the pool holds, which does not change
the work).

  NCCL_NVLS_ENABLE=0 python benchmarks/tp.py                            # 2 GPUs: nemotron-h-8b, 2.7b, -47b
  python benchmarks/tp.py --shapes tiny,tiny-hybrid --device cpu --batches 1,4   # a CPU smoke run (gloo)
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import hybrid_step  # benchmarks/ is sys.path[0] when run as a script
from hybrid_step import SHAPES as HYBRID_SHAPES
from hybrid_step import copy_bandwidth
from mambaserve.server.engine.batch import ForwardBatch, ForwardMode
from mambaserve.server.engine.cuda_graphs import DecodeGraphs
from mambaserve.server.engine.kv_pool import KVPool
from mambaserve.server.engine.model_runner import ModelRunner
from mambaserve.server.engine.state_pool import MambaStatePool
from mambaserve.server.model.parallel import SINGLE, TP
from mambaserve.server.model.registry import ARCHITECTURES


def _nemotron_47b_pattern() -> str:
    """98 layers: 44 Mamba, 5 attention, 49 MLP (46.8B parameters at the widths below), attention spread evenly."""
    out = ""
    for i in range(49):
        out += ("*" if i in (8, 18, 28, 38, 47) else "M") + "-"
    return out


_MAMBA2 = dict(model_type="mamba2", architectures=["Mamba2ForCausalLM"], expand=2, n_groups=1, conv_kernel=4)
SHAPES = {
    # state-spaces/mamba2-2.7b's dims: one B/C group, so the gated norm's group spans the ranks
    "2.7b": ("Mamba2ForCausalLM", dict(_MAMBA2, hidden_size=2560, num_hidden_layers=64, num_heads=80, head_dim=64,
                                       state_size=128, vocab_size=50288, chunk_size=256)),
    "nemotron-h-8b": HYBRID_SHAPES["nemotron-h-8b"],
    # Nemotron-H-47B's widths (8 groups, 256 Mamba heads, 64 query / 8 KV heads); too large for one 80 GB GPU
    "nemotron-h-47b": ("NemotronHForCausalLM", dict(
        vocab_size=131072, hidden_size=8192, hybrid_override_pattern=_nemotron_47b_pattern(), mamba_num_heads=256,
        mamba_head_dim=64, n_groups=8, ssm_state_size=256, chunk_size=128, num_attention_heads=64,
        num_key_value_heads=8, head_dim=128, intermediate_size=30720, max_position_embeddings=8192)),
    "tiny": ("Mamba2ForCausalLM", dict(_MAMBA2, hidden_size=64, num_hidden_layers=2, num_heads=4, head_dim=32,
                                       state_size=16, vocab_size=512, chunk_size=64)),
    "tiny-hybrid": HYBRID_SHAPES["nemotron-h-tiny"],
}
# the fp32 state of a 47B row is 370 MiB per rank: 64 rows beside its 47 GB of weights per rank
MAX_BATCH = {"nemotron-h-47b": 64}


def build(shape: str, device: torch.device, dtype: torch.dtype, tp: TP):
    """``shape``'s model on ``device``, this rank's shard of it, with random weights."""
    return hybrid_step.build(shape, device, dtype, tp, SHAPES)


def full_bytes(shape: str, dtype: torch.dtype) -> int:
    """The whole model's weights."""
    arch_name, cfg = SHAPES[shape]
    arch = ARCHITECTURES[arch_name]
    with torch.device("meta"):
        model = arch.model_class(arch.read_dims(cfg))
    return sum(p.numel() for p in model.parameters()) * dtype.itemsize


def step_bytes(model, batch: int, context: int, pool: MambaStatePool, kv: KVPool | None) -> int:
    """What one decode step reads and writes on a rank: its weights once (the experts a step can touch), each
    row's state read and written, each row's KV read."""
    dims, weights, experts = model.dims, 0, 0
    for name, p in model.named_parameters():
        n = p.numel() * p.element_size()
        if p.dim() == 3:  # stacked routed experts
            experts += n
        else:
            weights += n
    moe = getattr(dims, "moe", None)
    if moe:
        weights += int(experts * min(moe.num_experts, batch * moe.top_k) / moe.num_experts)
    kv_read = kv.bytes_per_page // kv.page_size * context * batch if kv is not None else 0
    return weights + 2 * pool.bytes_per_slot * batch + kv_read


def allreduce_us(hidden: int, batch: int, dtype: torch.dtype, device: torch.device, tp: TP) -> dict:
    """One all-reduce of ``[batch, hidden]`` (what a layer sums), replayed 100 times in a CUDA graph (eagerly on
    CPU): NCCL's (what the server runs), and for comparison PyTorch's symmetric-memory all-reduces (P2P loads
    and stores through memory every rank maps; no multicast), where this torch has them."""
    x = torch.ones(batch, hidden, dtype=dtype, device=device)
    out = {dist.get_backend(tp.group): _replayed(lambda: tp.all_reduce(x), device)}
    if device.type == "cuda":
        try:
            import torch.distributed._symmetric_memory as symm

            buf = symm.empty(batch * hidden, dtype=dtype, device=device)
            name = tp.group.group_name
            symm.rendezvous(buf, name)
            out["symm_mem_one_shot"] = _replayed(lambda: torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", name),
                                                 device)
            out["symm_mem_two_shot"] = _replayed(lambda: torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", name),
                                                 device)
        except Exception as e:  # (alpha API: absent or changed in this torch)
            out["symm_mem"] = f"unavailable: {type(e).__name__}: {str(e)[:200]}"
    return out


def _replayed(fn, device: torch.device, n: int = 100) -> float:
    """Microseconds per call of ``fn``: ``n`` calls captured in one CUDA graph and replayed (eager on CPU)."""
    if device.type != "cuda":
        t = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t) / n * 1e6
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            for _ in range(n):
                fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        dist.barrier()
        t = time.perf_counter()
        g.replay()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(times)


def measure(shape: str, a, device: torch.device, dtype: torch.dtype, tp: TP) -> dict:
    """Decode step times at ``a.batches`` on this rank (every rank runs the same steps)."""
    model, dims = build(shape, device, dtype, tp)
    batches = [b for b in a.batches if b <= MAX_BATCH.get(shape, b)]
    rows = max(batches) + 1
    pool = MambaStatePool.for_model(model, rows, dtype, torch.float32, device)
    kv, pages = None, None
    at = getattr(model, "attention_dims", None)
    if at is not None:
        per_row = -(-(a.context + 1) // a.page_size)
        kv = KVPool.for_model(model, rows * per_row, a.page_size, dtype, device)
        pages = [list(range(r * per_row, (r + 1) * per_row)) for r in range(rows)]
    runner = ModelRunner(model, pool, device, kv)
    steps = {b: ForwardBatch(ForwardMode.DECODE, [1 + r % 7 for r in range(b)], [1] * b, [a.context] * b,
                             list(range(1, b + 1)), pages=pages[1:b + 1] if pages else None) for b in batches}
    graphs = device.type == "cuda" and model.capture_blocker(ForwardMode.DECODE) is None
    if graphs:
        g = DecodeGraphs(model, pool, max(batches), device, kv, (a.context + 1 + a.page_size) if kv else 0)
        g.buckets = sorted(batches)  # only the sizes timed: a 98-layer capture per bucket takes a while
        g.capture()
        runner.graphs = g
    bw = copy_bandwidth(device)
    out = {"graphs": graphs, "copy_GBs": bw / 1e9, "params_per_rank_M": sum(p.numel() for p in model.parameters()) / 1e6,
           "decode": {}}
    for b, batch in steps.items():
        for _ in range(3):
            runner.forward(batch)
        times = []
        for _ in range(a.reps):
            if tp.size > 1:
                dist.barrier(group=tp.cpu_group)
            if device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(a.steps):
                runner.forward(batch)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append((time.perf_counter() - t) / a.steps)
        ms = statistics.median(times) * 1e3
        bound = step_bytes(model, b, a.context, pool, kv) / bw * 1e3
        out["decode"][b] = {"step_ms": ms, "tok_s": b / ms * 1e3, "bound_ms": bound}
        if tp.size > 1:
            out["decode"][b]["allreduce_us"] = allreduce_us(dims.hidden_size, b, dtype, device, tp)
    del runner, pool, kv, model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def worker(rank: int, size: int, a, port: int, results) -> None:
    cuda = a.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size, timeout=datetime.timedelta(minutes=10))
    cpu = dist.new_group(backend="gloo") if cuda else dist.group.WORLD
    tp = TP(rank, size, dist.group.WORLD, cpu)
    dtype = torch.bfloat16 if cuda else torch.float32
    for shape in a.shapes:
        row: dict = {"shape": shape}
        fits = not cuda or full_bytes(shape, dtype) < 0.85 * torch.cuda.get_device_properties(device).total_memory
        if fits:  # TP 1 on every device at once: the latency, and the replicas' throughput
            dist.barrier(group=cpu)
            one = measure(shape, a, device, dtype, SINGLE)
            each = [None] * size
            dist.all_gather_object(each, one, group=cpu)
            row["tp1"] = each
        else:
            row["tp1"] = "does not fit one device"
        dist.barrier(group=cpu)
        row["tp2"] = measure(shape, a, device, dtype, tp)
        if rank == 0:
            results.put(row)
    dist.destroy_process_group()


def summary(row: dict, batches: list[int]) -> list[dict]:
    out = []
    tp2 = row["tp2"]["decode"]
    for b in (b for b in batches if b in tp2):
        r = {"shape": row["shape"], "batch": b, "tp2_ms": tp2[b]["step_ms"], "tp2_tok_s": tp2[b]["tok_s"],
             "tp2_bound_ms": tp2[b]["bound_ms"], "tp2_x_bound": tp2[b]["step_ms"] / tp2[b]["bound_ms"],
             "allreduce_us": tp2[b].get("allreduce_us")}
        if isinstance(row["tp1"], list):
            t1 = [rank["decode"][b] for rank in row["tp1"]]
            replicas = sum(x["tok_s"] for x in t1)
            r |= {"tp1_ms": t1[0]["step_ms"], "tp2_over_tp1": tp2[b]["step_ms"] / t1[0]["step_ms"],
                  "replicas_tok_s": replicas, "tp2_over_replicas": tp2[b]["tok_s"] / replicas}
        out.append(r)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="nemotron-h-8b,2.7b,nemotron-h-47b")
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--context", type=int, default=1024, help="tokens already in each decode row's KV (hybrids)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5, help="timings per batch size (the median is reported)")
    ap.add_argument("--steps", type=int, default=20, help="decode steps per timing")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", help="also write the full results here")
    a = ap.parse_args()
    a.shapes = a.shapes.split(",")
    a.batches = [int(b) for b in a.batches.split(",")]
    unknown = set(a.shapes) - set(SHAPES)
    if unknown:
        sys.exit(f"unknown shapes {sorted(unknown)}: {sorted(SHAPES)}")
    if a.device == "cuda" and torch.cuda.device_count() < a.tp:
        sys.exit(f"--tp {a.tp} needs {a.tp} GPUs; {torch.cuda.device_count()} visible")
    if a.device == "cuda" and os.environ.get("NCCL_NVLS_ENABLE") != "0":
        print("# note: NCCL_NVLS_ENABLE is not 0 (NVLink multicast on)", flush=True)
    with socket.socket() as sock:  # a free loopback port for the process group's store
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    t = time.monotonic()
    procs = [ctx.Process(target=worker, args=(r, a.tp, a, port, results)) for r in range(a.tp)]
    for p in procs:
        p.start()
    rows = []
    for _ in a.shapes:
        while results.empty():
            if any(p.exitcode not in (None, 0) for p in procs):
                sys.exit(f"a worker failed: exit codes {[p.exitcode for p in procs]}")
            time.sleep(0.5)
        row = results.get()
        rows.append(row)
        for line in summary(row, a.batches):
            print(json.dumps({k: (round(v, 4) if v == v else None) if isinstance(v, float) else v
                              for k, v in line.items()}), flush=True)
    for p in procs:
        p.join()
    print(f"# {a.tp} ranks, {time.monotonic() - t:.0f} s in all", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1, default=str)


if __name__ == "__main__":
    main()
