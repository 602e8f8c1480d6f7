"""Forward speed of hybrid models (random weights, real shapes) through the model runner: prefill tokens/s
and decode step time per batch size, beside the memory-bandwidth bound of each decode step.

The model is built in place from its dims (no checkpoint written: an 8B random checkpoint takes minutes
to save and load), its KV pool and state pool sized for the largest batch. Decode rows sit at
``--context`` tokens each (their pages allocated; the KV values are whatever the pool holds, which does
not change the work). Decode is timed eagerly, then (on CUDA, unless ``--no-graphs``) replayed from the
decode CUDA graphs the server captures (``step_ms_graph``; block tables as wide as the rows' pages), MoE
layers included (their Triton experts do not sync with the host; where the torch expert loop runs instead,
decode is not captured and ``graphs`` says why). The bound counts every non-expert weight once, the experts a step can touch
(min(E, batch x top_k) per MoE layer), each row's state read and written, and each row's KV read, over the
measured device copy bandwidth.

  python benchmarks/hybrid_step.py --shape granite-4.0-h-tiny --batches 1,64,256
  python benchmarks/hybrid_step.py --shape nemotron-h-8b --batches 1,64 --context 2048
  python benchmarks/hybrid_step.py --shape nemotron-h-8b --batches 1,8,64,256 --reps 50   # graphs on vs off
  python benchmarks/hybrid_step.py --batches 1 --reps 50 --variants '[{"fuse_norm_linear": false}]'  # A/B configs
  python benchmarks/hybrid_step.py --batches 1,4,8,16 --variants '[{"fold_shared_mlp": false}]'   # granite's fold
  python benchmarks/hybrid_step.py --batches 1 --context 1100 --extend 8x64,8x80,8x96   # hits' extend steps
  python benchmarks/hybrid_step.py --shape tiny --device cpu          # a smoke run
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from mambaserve.server.engine.batch import ForwardBatch, ForwardMode
from mambaserve.server.engine.kv_pool import KVPool
from mambaserve.server.engine.model_runner import ModelRunner
from mambaserve.server.engine.state_pool import MambaStatePool
from mambaserve.server.model import hybrid_config
from mambaserve.server.model.registry import ARCHITECTURES

def _nemotron_8b_pattern() -> str:
    """52 layers with Nemotron-H-8B's counts (24 Mamba, 4 attention, 24 MLP), attention spread evenly (the
    published order differs in places; the work per step does not)."""
    out = ""
    for i in range(24):
        out += "M-"
        if i in (5, 11, 17, 23):
            out += "*"
    return out


# Published configs' shapes (vocab, widths, head counts); weights are random.
SHAPES = {
    "nemotron-h-8b": ("NemotronHForCausalLM", dict(
        vocab_size=131072, hidden_size=4096, hybrid_override_pattern=_nemotron_8b_pattern(),
        mamba_num_heads=128, mamba_head_dim=64, n_groups=8, ssm_state_size=128, chunk_size=128, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, intermediate_size=21504, max_position_embeddings=8192)),
    "granite-4.0-h-tiny": ("GraniteMoeHybridForCausalLM", dict(
        vocab_size=100352, hidden_size=1536, num_hidden_layers=40,
        layer_types=["attention" if i in (5, 15, 25, 35) else "mamba" for i in range(40)], num_attention_heads=12,
        num_key_value_heads=4, mamba_n_heads=48, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=128,
        mamba_chunk_size=256, num_local_experts=64, num_experts_per_tok=6, intermediate_size=512,
        shared_intermediate_size=1024, embedding_multiplier=12.0, residual_multiplier=0.22,
        attention_multiplier=0.0078125, logits_scaling=6.0)),
    # launch-bound: where decode graphs matter most (a GPU smoke run of graphs on vs off)
    "nemotron-h-tiny": ("NemotronHForCausalLM", dict(
        vocab_size=512, hidden_size=64, hybrid_override_pattern="M*-M-M-", mamba_num_heads=4, mamba_head_dim=16,
        n_groups=1, ssm_state_size=16, chunk_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=128)),
    "tiny": ("GraniteMoeHybridForCausalLM", dict(
        vocab_size=512, hidden_size=64, num_hidden_layers=4, layer_types=["mamba", "attention", "mamba", "mamba"],
        num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=4, mamba_d_state=16, mamba_chunk_size=64,
        num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, shared_intermediate_size=64)),
}


def build(shape: str, device: torch.device, dtype: torch.dtype, tp=None, shapes: dict | None = None):
    """``shape``'s model (of ``shapes``, default this file's) with random weights; with ``tp``, a rank's shard
    of it (benchmarks/tp.py)."""
    arch_name, cfg = (shapes or SHAPES)[shape]
    arch = ARCHITECTURES[arch_name]
    dims = arch.read_dims(cfg)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = arch.model_class(dims, None, *([tp] if tp is not None else []))
    model = model.to(dtype).to_empty(device=device)  # (in dtype from the start: a 47B shape's fp32 would not fit)
    model.tie_weights()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                p.uniform_(-1.0, 0.5)
            elif p.dim() >= 2:
                p.normal_(std=0.02)
            else:
                p.fill_(1.0)
        for m in model.mixers():
            for n in ("A_log", "D", "dt_bias"):
                getattr(m, n).data = getattr(m, n).data.float()
    model.refresh_derived()
    return model.eval(), dims


def copy_bandwidth(device: torch.device) -> float:
    if device.type != "cuda":
        return float("nan")
    a = torch.empty(1 << 28, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    best = 0.0
    for _ in range(5):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(5):
            b.copy_(a)
        torch.cuda.synchronize()
        best = max(best, 5 * 2 * a.numel() * 4 / (time.perf_counter() - t))
    return best


def timed(fn, device: torch.device, reps: int) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps


def decode_bytes(model, dims: hybrid_config.HybridDims, batch: int, context: int, pool, kv) -> int:
    expert_bytes, other = 0, 0
    for name, p in model.named_parameters():
        n = p.numel() * p.element_size()
        if ".experts." in name or "input_linear" in name and p.dim() == 3 or "output_linear" in name and p.dim() == 3:
            expert_bytes += n
        else:
            other += n
    if dims.moe:
        touched = min(dims.moe.num_experts, batch * dims.moe.top_k) / dims.moe.num_experts
        other += int(expert_bytes * touched)
    state = 2 * pool.bytes_per_slot * batch
    kv_read = kv.bytes_per_page // kv.page_size * context * batch if kv else 0
    return other + state + kv_read


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="granite-4.0-h-tiny", choices=sorted(SHAPES))
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--context", type=int, default=1024, help="tokens already in each decode row's KV")
    ap.add_argument("--prefill", type=int, default=2048, help="tokens of the prefill timed")
    ap.add_argument("--extend", default="",
                    help="ROWSxTOKENS[,...]: also time a cache hit's step, that many rows of new tokens each after "
                         "--context cached tokens (e.g. 8x80: a multi-turn round's hits), eager and from graphs")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--no-graphs", action="store_true", help="time decode eagerly only")
    ap.add_argument("--variants", type=json.loads, default=[],
                    help='JSON list of kernels.KernelConfig overrides, each timed on the graphs (captured again), '
                         'e.g. \'[{"fuse_norm_linear": false}, {"linear_tiles": {"1536": {"BLOCK_N": 8}}}]\'')
    ap.add_argument("--profile", action="store_true",
                    help="the kernels of one graph-replayed decode step per batch size (torch profiler), and of a prefill")
    a = ap.parse_args()
    device = torch.device(a.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, dims = build(a.shape, device, dtype)
    batches = [int(b) for b in a.batches.split(",")]
    extends = [tuple(int(x) for x in e.split("x")) for e in a.extend.split(",") if e]
    rows = max(batches + [r for r, _ in extends]) + 1
    pool = MambaStatePool.for_model(model, rows, dtype, torch.float32, device)
    per_row = -(-max(a.context + max([n for _, n in extends], default=1), a.prefill) // a.page_size)
    kv = KVPool.for_model(model, rows * per_row, a.page_size, dtype, device)
    runner = ModelRunner(model, pool, device, kv)
    pages = [list(range(r * per_row, (r + 1) * per_row)) for r in range(rows)]
    ids = torch.randint(1, dims.vocab_size, (a.prefill,)).tolist()
    prefill = ForwardBatch(ForwardMode.EXTEND, ids, [a.prefill], [0], [0], pages=[pages[0]])
    t_prefill = timed(lambda: runner.forward(prefill), device, max(1, a.reps // 5))
    bw = copy_bandwidth(device)
    out = {"shape": a.shape, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
           "dtype": str(dtype), "params_M": sum(p.numel() for p in model.parameters()) / 1e6,
           "prefill_tokens": a.prefill, "prefill_tok_s": a.prefill / t_prefill, "context": a.context,
           "copy_bandwidth_GBs": bw / 1e9, "decode": []}
    steps = {}
    for b in batches:
        steps[b] = batch = ForwardBatch(ForwardMode.DECODE, ids[:b] if b <= len(ids) else [1] * b, [1] * b,
                                        [a.context] * b, list(range(1, b + 1)), pages=pages[1:b + 1])
        t = timed(lambda: runner.forward(batch), device, a.reps)
        bound = decode_bytes(model, dims, b, a.context, pool, kv) / bw
        out["decode"].append({"batch": b, "step_ms": t * 1e3, "tok_s": b / t, "bound_ms": bound * 1e3,
                              "x_bound": t / bound if bound == bound else None})
    hits = {}
    for r, n in extends:  # rows whose first --context tokens are cached (a hit): their state slot holds them
        hits[r, n] = batch = ForwardBatch(ForwardMode.EXTEND, [1 + i % (dims.vocab_size - 1) for i in range(r * n)],
                                          [n] * r, [a.context] * r, list(range(1, r + 1)), pages=pages[1:r + 1])
        out.setdefault("extend", []).append({"rows": r, "tokens": n, "context": a.context,
                                             "step_ms": timed(lambda: runner.forward(batch), device, a.reps) * 1e3})
    blocker = model.capture_blocker(ForwardMode.DECODE)
    if blocker or a.no_graphs or device.type != "cuda":
        out["graphs"] = "off: " + (blocker or ("--no-graphs" if a.no_graphs else "CUDA graphs need a CUDA device"))
    else:
        t0 = time.perf_counter()
        runner.enable_cuda_graphs(max(batches), a.prefill, max([1] + [r for r, _ in extends]),
                                  context_length=per_row * a.page_size)
        out["graphs"] = (f"decode captured for batch sizes {runner.graphs.buckets}, prefill "
                         f"{'off' if runner.prefill_graphs is None else len(runner.prefill_graphs.graphs)}, in "
                         f"{time.perf_counter() - t0:.1f} s")
        if runner.prefill_graphs is not None:
            t = timed(lambda: runner.forward(prefill), device, max(1, a.reps // 5))
            out["prefill_tok_s_graph"] = a.prefill / t
        for row in out.get("extend", []):
            t = timed(lambda: runner.forward(hits[row["rows"], row["tokens"]]), device, a.reps)
            row["step_ms_graph"] = t * 1e3
        for row in out["decode"]:
            t = timed(lambda: runner.forward(steps[row["batch"]]), device, a.reps)
            row |= {"step_ms_graph": t * 1e3, "tok_s_graph": row["batch"] / t,
                    "graph_speedup": row["step_ms"] / (t * 1e3)}
        if a.profile:
            for name, step in [*((f"decode b={b}", steps[b]) for b in batches), ("prefill", prefill),
                               *((f"extend {r}x{n}", hits[r, n]) for r, n in extends)]:
                _profile(name, lambda: runner.forward(step))
        if a.variants:
            from decode_step import apply_variant  # (not at the top: decode_step imports e2e, which imports this)
        for v in a.variants:  # the same steps under another kernel config, its graphs captured again
            undo = apply_variant(model, v)
            runner.enable_cuda_graphs(max(batches), a.prefill, 1, context_length=per_row * a.page_size)
            times = {b: timed(lambda: runner.forward(steps[b]), device, a.reps) * 1e3 for b in batches}
            tok_s = a.prefill / timed(lambda: runner.forward(prefill), device, max(1, a.reps // 5))
            out.setdefault("variants", []).append({"variant": v, "step_ms_graph": times, "prefill_tok_s_graph": tok_s})
            print("# variant " + json.dumps(v) + ": " + ", ".join(
                f"b={b} {t:.3f} ms ({t / r['step_ms_graph']:.3f}x default)" for (b, t), r in zip(times.items(),
                                                                                          out["decode"]))
                  + f", prefill {tok_s / 1e3:.1f}k tok/s ({tok_s / out.get('prefill_tok_s_graph', tok_s):.3f}x)",
                  flush=True)
            undo()
    print(json.dumps(out, indent=1))


def _profile(name: str, fn) -> None:
    """Kernels of one call of ``fn`` (after a warm-up): count, and the top ones by device time."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.device_time for e in kernels)
    print(f"# {name}: {len(kernels)} kernels, {total / 1e3:.3f} ms of device time", flush=True)
    print(prof.key_averages().table(sort_by="device_time_total", row_limit=40, max_name_column_width=70), flush=True)


if __name__ == "__main__":
    main()
