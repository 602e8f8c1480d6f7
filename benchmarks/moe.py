"""MoE experts on a CUDA GPU: the fused Triton op (``kernels/moe.py``) against the torch expert loop it replaced and
against the bound of reading the experts' weights, at granite-4.0-h-tiny's MoE shape (hidden 1536, 64 experts,
top-6, SwiGLU experts of 512: the dims come from ``hybrid_step.py``'s config of that model), bf16, one layer.

    python benchmarks/moe.py                          # 1, 16, 64, 256 tokens (decode) + 2048, 8192 (prefill)
    python benchmarks/moe.py --tokens 1,64 --sweep    # + a tile sweep per token count (~1 minute each)
    python benchmarks/moe.py --tokens 16,64,256,512 --align-ab   # + both align steps, alone and in the whole op
    python benchmarks/moe.py --tokens 1,8,64,256 --shared-fold     # + the shared MLP as two more experts
    python benchmarks/moe.py --tokens 1,8,16 --router     # + the decode router: norm, projection, top-k in one launch
    python benchmarks/moe.py --tokens 32,64 --router --router-tiles '[{"BLOCK_E": 16}, {"BLOCK_E": 64, "num_warps": 8}]'
    python benchmarks/moe.py --shape tiny --device cpu --tokens 1,8   # smoke run: the reference on both sides

Routing: the softmax top-k of random router logits (Granite's router on random weights: about uniform over the
experts). The weights exist ``--layers`` times (8: 2.4 GB) and the calls cycle through the copies, so every call
reads its experts from HBM, as in a model with 40 such layers (one copy would sit in the 50 MB L2 at small batch).

Columns: ``kernel`` is the Triton op's time per call replayed from a CUDA graph (it has no host sync, so it is
capturable; what a graph-captured decode step pays), ``eager`` the same op launched from Python, ``align`` its
routing-align step alone (graph; one token runs none; in brackets the sort-based torch align, its reference: a Triton
program per expert up to ``ALIGN_PER_EXPERT_MAX_PAIRS`` pairs, three launches above), ``loop`` the torch reference (eager: its host sync per call makes it
uncapturable), ``bound`` the time to read the weights of the experts the routing touches (plus x and the output)
at the measured copy bandwidth, or to do the FLOPs at the published bf16 peak if that is longer. Before timing,
each token count's output is checked against the loop's (relative error printed; over 2e-2 stops the run).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F

from _cuda_bench import copy_bandwidth  # benchmarks/ is the script's folder, so on sys.path
from hybrid_step import SHAPES
from mambaserve.kernels import moe
from mambaserve.kernels.swiglu import silu_mul
from mambaserve.server.model.registry import ARCHITECTURES

# published: H100 SXM5 3.35 TB/s and 989 dense bf16 TFLOP/s (PCIe 2.0 TB/s, 756; H200 4.8 TB/s, 989)
PEAKS = {"H100 PCIe": 756e12, "H100 NVL": 835e12, "H100": 989e12, "H200": 989e12}
# tile candidates of --sweep: the up and down kernels are timed separately (the whole op with one varied)
SWEEP_BLOCK_M = (16, 32, 64, 128)
SWEEP_KERNEL = [dict(block_n=n, block_k=k, warps=4, stages=s) for n in (16, 32, 64, 128) for k in (64, 128)
                for s in (3, 5)]
SWEEP_KERNEL += [dict(block_n=n, block_k=256, warps=2, stages=4) for n in (16, 32)]
SWEEP_KERNEL += [dict(block_n=128, block_k=64, warps=8, stages=3), dict(block_n=64, block_k=128, warps=8, stages=4)]


def moe_dims(shape: str):
    arch, cfg = SHAPES[shape]
    d = ARCHITECTURES[arch].read_dims(cfg)
    if d.moe is None:
        raise SystemExit(f"{shape} has no MoE layers")
    return d.hidden_size, d.moe, d.mlp.intermediate_size


def fold_shared(w1, w2, router, sw1, sw2):
    """Granite's shared SwiGLU MLP (``sw1`` [2S, H] gate rows first, ``sw2`` [H, S]) two ways, per weight copy: the
    router's and the shared gate/up rows in one matrix (as the model holds them), and the shared MLP as S / I more
    experts stacked after the routed ones (``moe.fold_gated_mlp``, as the model holds them too, for decode). None
    where S is not a multiple of I."""
    folds = [moe.fold_gated_mlp(a, b, c, d) for a, b, c, d in zip(w1, w2, sw1, sw2)]
    if folds[0] is None:
        return None
    return [torch.cat([router, s]) for s in sw1], [f[0] for f in folds], [f[1] for f in folds]


def shared_fold(x, ids, wts, w1, w2, router, sw2, folds, calls: int) -> dict:
    """Granite's MoE layer with its shared MLP as the model runs it (the router's and the shared gate/up projections
    in one GEMM, the activation, the shared down GEMM, its output added in the experts' sum) against the shared MLP
    folded into the op as more experts that every token takes with weight 1 and the router's GEMM alone: one op
    instead of three launches (``folds``: ``fold_shared``'s). Returns both times (us, graph-replayed) and the folded
    output's relative difference from the unfolded one."""
    fused, w1e, w2e = folds
    E, T, V = w1[0].shape[0], x.shape[0], w1e[0].shape[0] - w1[0].shape[0]
    ids_e = torch.cat([ids, torch.arange(E, E + V, device=ids.device).expand(T, V).to(ids.dtype)], 1)
    wts_e = torch.cat([wts, torch.ones(T, V, device=wts.device, dtype=wts.dtype)], 1)

    def unfolded(i):
        both = F.linear(x, fused[i])
        add = F.linear(silu_mul(both[:, E:]), sw2[i])
        return moe.moe_experts(x, ids, wts, w1[i], w2[i], add=add)

    def folded(i):
        F.linear(x, router)  # the router's logits, on their own now (routing is fixed here)
        return moe.moe_experts(x, ids_e, wts_e, w1e[i], w2e[i])

    err = rel_err(folded(0), unfolded(0))
    out = {"unfolded_us": graph_time(unfolded, calls) * 1e6, "folded_us": graph_time(folded, calls) * 1e6,
           "fold_rel_err": err}
    print(f"#   shared MLP folded, {T} tokens: {out['folded_us']:.1f} us against {out['unfolded_us']:.1f} us "
          f"unfolded ({out['folded_us'] / out['unfolded_us']:.2f}x), relative difference {err:.1e}", flush=True)
    return out


def peak_flops() -> float:
    name = torch.cuda.get_device_name().replace(" ", "").lower()
    return next((v for k, v in PEAKS.items() if k.replace(" ", "").lower() in name), PEAKS["H100"])


def graph_time(fn, calls: int) -> float:
    """Median seconds per call of ``fn(i)`` for i in range(calls), replayed from one CUDA graph."""
    from triton.testing import do_bench

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(calls):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(i)
    t = do_bench(g.replay, warmup=5, rep=100, return_mode="median") * 1e-3 / calls
    del g
    return t


def eager_time(fn, calls: int, device: torch.device) -> float:
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(lambda: [fn(i) for i in range(calls)], warmup=3, rep=100, return_mode="median") * 1e-3 / calls
    fn(0)
    t = time.perf_counter()
    for i in range(calls):
        fn(i)
    return (time.perf_counter() - t) / calls


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def sweep(x, ids, wts, w1, w2, calls, E, block_ms=SWEEP_BLOCK_M):
    """The best tiles for this token count: per BLOCK_M, the up kernel's candidates with the down kernel at its
    default, then the down kernel's with the best up; prints the winner and how far the default is from it."""
    default = moe.moe_tiles(ids.numel(), E)
    time_of = lambda tiles: graph_time(lambda i: moe.moe_experts(x, ids, wts, w1[i], w2[i], tiles=tiles), calls)
    best, best_t = dict(default), time_of(default)
    for bm in block_ms:
        cur = {**default, "block_m": bm}
        for part in ("up", "down"):
            results = []
            for c in SWEEP_KERNEL:
                tiles = {**cur, **{f"{part}_{k}": v for k, v in c.items()}}
                try:
                    results.append((time_of(tiles), tiles))
                    print(f"#   {part} {json.dumps(tiles)}: {results[-1][0] * 1e6:.1f} us", flush=True)
                except Exception as e:  # a tile set that does not fit (shared memory): skip it, say so
                    print(f"#   skip {part} {c}: {type(e).__name__}")
            t, cur = min(results, key=lambda r: r[0])
        if t < best_t:
            best, best_t = cur, t
    print(f"#   sweep, {ids.shape[0]} tokens: best {best_t * 1e6:.1f} us (default {time_of(default) * 1e6:.1f} us): "
          f"{json.dumps(best)}", flush=True)
    return best, best_t


def align_ab(x, ids, wts, w1, w2, calls: int, E: int, repeats: int = 3) -> dict:
    """Both align steps (a program per expert, three launches) at this routing, alternating ``repeats`` times: the
    align alone (its output checked equal to the torch align's first) and the whole op, best of the repeats (us)."""
    bm = moe.moe_tiles(ids.numel(), E)["block_m"]
    ref = moe.moe_align_ref(ids, E, bm)
    kept = moe.ALIGN_PER_EXPERT_MAX_PAIRS
    out = {}
    try:
        for _ in range(repeats):
            for name, cap in (("per_expert", ids.numel()), ("split", 0)):
                moe.ALIGN_PER_EXPERT_MAX_PAIRS = cap
                al = moe.moe_align(ids, E, bm)
                if not (torch.equal(al.sorted_pairs, ref.sorted_pairs) and torch.equal(al.block_expert, ref.block_expert)):
                    raise SystemExit(f"{ids.shape[0]} tokens: the {name} align differs from the torch align")
                alone = graph_time(lambda i: moe.moe_align(ids, E, bm), 1) * 1e6
                op = graph_time(lambda i: moe.moe_experts(x, ids, wts, w1[i], w2[i]), calls) * 1e6
                best = out.get(name, (alone, op))
                out[name] = (min(best[0], alone), min(best[1], op))
    finally:
        moe.ALIGN_PER_EXPERT_MAX_PAIRS = kept
    print(f"#   align A/B, {ids.shape[0]} tokens: " + ", ".join(
        f"{n} align {a_:.1f} us, op {o:.1f} us" for n, (a_, o) in out.items()), flush=True)
    return {f"{n}_{part}_us": v for n, (a_, o) in out.items() for part, v in (("align", a_), ("op", o))}


def router_ab(T: int, H: int, E: int, k: int, always: int, calls: int, device, dtype, repeats: int = 3,
              tiles: list[dict] = ()) -> dict:
    """Granite's decode router as the model runs it at folded steps (``always`` shared experts appended): the
    residual-add norm, the router's projection and its top-k softmax in one launch (``rmsnorm_topk_softmax``)
    against three (``rmsnorm``, cuBLAS, ``topk_softmax``), ``calls`` weight copies, alternating ``repeats`` times, best
    of each (us a call), and the fused launch again under each of ``tiles`` (``ROUTE_TILES`` overrides). The fused
    outputs are checked first: the residual and the normed rows equal to the three launches', the chosen experts'
    logits to theirs."""
    from mambaserve.kernels.rmsnorm import rmsnorm
    from mambaserve.kernels.topk_softmax import rmsnorm_topk_softmax, topk_softmax

    h, x = torch.randn(T, H, device=device, dtype=dtype), torch.randn(T, H, device=device, dtype=dtype)
    rw = [torch.randn(E, H, device=device, dtype=dtype) * H ** -0.5 for _ in range(calls)]
    nw = [torch.rand(H, device=device, dtype=dtype) + 0.5 for _ in range(calls)]
    counters = torch.zeros(T, dtype=torch.int32, device=device)

    def three(i):
        normed, res = rmsnorm(h, x, nw[i], 1e-5, scale=0.22)
        logits = F.linear(normed, rw[i])
        return normed, res, logits, *topk_softmax(logits, k, dtype, always=always)

    def fused(i, t=None):
        return rmsnorm_topk_softmax(h, x, nw[i], 1e-5, 0.22, rw[i], k, dtype, always=always, counters=counters,
                                    tiles=t)

    normed, res, logits, ids, _ = three(0)
    f_normed, f_res, f_ids, _ = fused(0)
    picked = logits.float().gather(1, ids[:, :k].long()), logits.float().gather(1, f_ids[:, :k].long())
    if not (torch.equal(f_normed, normed) and torch.equal(f_res, res) and torch.allclose(*picked, rtol=1e-2)):
        raise SystemExit(f"{T} tokens: the fused router's outputs differ from the three launches'")
    best = {"router_three_us": float("inf"), "router_fused_us": float("inf")}
    for _ in range(repeats):
        best["router_three_us"] = min(best["router_three_us"], graph_time(three, calls) * 1e6)
        best["router_fused_us"] = min(best["router_fused_us"], graph_time(fused, calls) * 1e6)
    print(f"#   router, {T} tokens: fused {best['router_fused_us']:.2f} us, three launches "
          f"{best['router_three_us']:.2f} us", flush=True)
    for t in tiles:
        us = min(graph_time(lambda i: fused(i, t), calls) for _ in range(repeats)) * 1e6
        best.setdefault("router_tiles_us", []).append({"tiles": t, "us": us})
        print(f"#   router, {T} tokens, tiles {json.dumps(t)}: {us:.2f} us", flush=True)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="granite-4.0-h-tiny", choices=[s for s in SHAPES if "nemotron" not in s])
    ap.add_argument("--tokens", default="1,16,64,256,2048,8192")
    ap.add_argument("--layers", type=int, default=8, help="copies of the weights the calls cycle through")
    ap.add_argument("--sweep", action="store_true", help="also search tiles per token count")
    ap.add_argument("--sweep-block-m", default=",".join(map(str, SWEEP_BLOCK_M)), help="BLOCK_M values the sweep tries")
    ap.add_argument("--tiles", type=json.loads, default=[], help="JSON list of tile overrides, each timed too")
    ap.add_argument("--align-ab", action="store_true",
                    help="also both align steps (a program per expert, three launches), alone and in the whole op")
    ap.add_argument("--shared-fold", action="store_true",
                    help="also the layer with its shared MLP folded into the op as more experts, against unfolded")
    ap.add_argument("--router", action="store_true",
                    help="also the decode router: norm, projection and top-k in one launch, against three")
    ap.add_argument("--router-tiles", type=json.loads, default=[],
                    help='with --router: JSON list of ROUTE_TILES overrides, each timed too '
                         '(e.g. \'[{"BLOCK_E": 16}]\')')
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "moe_bench.json"))
    a = ap.parse_args()
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    H, m, S = moe_dims(a.shape)
    E, k, I = m.num_experts, m.top_k, m.intermediate_size
    torch.manual_seed(0)
    L = a.layers if cuda else 1
    w1 = [torch.randn(E, 2 * I, H, device=device, dtype=dtype) * H ** -0.5 for _ in range(L)]
    w2 = [torch.randn(E, H, I, device=device, dtype=dtype) * I ** -0.5 for _ in range(L)]
    router = torch.randn(E, H, device=device, dtype=dtype) * H ** -0.5
    if a.shared_fold and cuda:
        sw2 = [torch.randn(H, S, device=device, dtype=dtype) * S ** -0.5 for _ in range(L)]
        folds = fold_shared(w1, w2, router, [torch.randn(2 * S, H, device=device, dtype=dtype) * H ** -0.5
                                             for _ in range(L)], sw2)
        if folds is None:
            print(f"# --shared-fold: the shared MLP's width {S} is not a multiple of the experts' {I}", flush=True)
    expert_bytes = (2 * I * H + H * I) * w1[0].element_size()
    bw = copy_bandwidth() if cuda else float("nan")
    peak = peak_flops() if cuda else float("nan")
    head = {"shape": a.shape, "hidden": H, "experts": E, "top_k": k, "intermediate": I, "dtype": str(dtype),
            "device": torch.cuda.get_device_name() if cuda else "cpu", "copy_bandwidth_TBs": bw / 1e12,
            "peak_bf16_TFLOPs": peak / 1e12, "torch": torch.__version__,
            "triton": __import__("triton").__version__, "layers": L}
    print("# " + json.dumps(head), flush=True)
    rows = []
    for T in [int(t) for t in a.tokens.split(",")]:
        x = torch.randn(T, H, device=device, dtype=dtype)
        logits, ids = (x @ router.t()).float().topk(k, dim=-1)
        wts = torch.softmax(logits, -1).to(dtype)
        run = lambda i: moe.moe_experts(x, ids, wts, w1[i % L], w2[i % L])  # noqa: E731
        loop = lambda i: moe.moe_experts_ref(x, ids, wts, w1[i % L], w2[i % L])  # noqa: E731
        err = rel_err(run(0), loop(0))
        if err > 2e-2:  # the two round to bf16 at different places: a few 1e-3 apart
            raise SystemExit(f"{T} tokens: the kernel's output is {err:.2e} (relative) off the loop's; no timings")
        touched = int(ids.unique().numel())
        nbytes = touched * expert_bytes + 2 * T * H * x.element_size()
        flops = 2 * T * k * (2 * I * H + H * I)
        bound = max(nbytes / bw, flops / peak)
        t_loop = eager_time(loop, L, device)
        t_eager = eager_time(run, L, device)
        if cuda:
            t_kernel = graph_time(run, L)
            bm = moe.moe_tiles(ids.numel(), E)["block_m"]
            t_align = graph_time(lambda i: moe.moe_align(ids, E, bm), 1)
            t_align_torch = graph_time(lambda i: moe.moe_align_ref(ids, E, bm), 1)
        else:
            t_kernel, t_align, t_align_torch = t_eager, float("nan"), float("nan")
        row = {"tokens": T, "experts_touched": touched, "rel_err": err, "kernel_us": t_kernel * 1e6,
               "eager_us": t_eager * 1e6, "align_us": t_align * 1e6, "align_torch_us": t_align_torch * 1e6, "loop_us": t_loop * 1e6,
               "bound_us": bound * 1e6, "loop_over_kernel": t_loop / t_kernel, "kernel_over_bound": t_kernel / bound,
               "GB_s": nbytes / t_kernel / 1e9, "TFLOP_s": flops / t_kernel / 1e12}
        if cuda and T > 1:  # the weight (and intermediate) tiles through TMA descriptors instead
            tma = lambda i: moe.moe_experts(x, ids, wts, w1[i % L], w2[i % L], tiles={"tma": True})  # noqa: E731
            row.update(tma_err=rel_err(tma(0), loop(0)), tma_us=graph_time(tma, L) * 1e6)
        for j, tiles in enumerate(a.tiles if cuda else []):  # --tiles: each override set timed
            fn = lambda i: moe.moe_experts(x, ids, wts, w1[i % L], w2[i % L], tiles=tiles)  # noqa: E731
            try:
                row[f"tiles_{j}_us"] = graph_time(fn, L) * 1e6
            except Exception as e:  # a tile set that does not fit: say so, go on
                row[f"tiles_{j}_us"] = f"{type(e).__name__}"
        if a.shared_fold and cuda and folds is not None:
            row.update(shared_fold(x, ids, wts, w1, w2, router, sw2, folds, L))
        if a.router and cuda:  # (Granite's shared MLP, folded: S / I experts every token takes)
            row.update(router_ab(T, H, E, k, S // I if S % I == 0 else 0, L, device, dtype, tiles=a.router_tiles))
        if a.align_ab and cuda and T > 1:
            row.update(align_ab(x, ids, wts, w1, w2, L, E))
        if a.sweep and cuda:
            best, best_t = sweep(x, ids, wts, w1, w2, L, E,
                                 [int(b) for b in a.sweep_block_m.split(",")])
            row.update(sweep_best=best, sweep_us=best_t * 1e6)
        rows.append(row)
        print("# " + json.dumps({r: (round(v, 4) if isinstance(v, float) else v) for r, v in row.items()}), flush=True)
    print()
    print("| tokens | experts read | kernel (graph) | eager | align (torch align) | torch loop | loop / kernel | "
          "bound | kernel / bound | GB/s | TFLOP/s | rel. err |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        align = "none" if r["tokens"] == 1 else f"{r['align_us']:.1f} ({r['align_torch_us']:.1f}) us"  # 1: direct
        print(f"| {r['tokens']} | {r['experts_touched']} | {r['kernel_us']:.1f} us | {r['eager_us']:.1f} us | "
              f"{align} | {r['loop_us']:.0f} us | {r['loop_over_kernel']:.1f}x | "
              f"{r['bound_us']:.1f} us | "
              f"{r['kernel_over_bound']:.2f}x | {r['GB_s']:.0f} | {r['TFLOP_s']:.1f} | {r['rel_err']:.1e} |")
    with open(a.json, "w") as f:
        json.dump({**head, "rows": rows}, f, indent=1)
    print(f"# wrote {a.json}")


if __name__ == "__main__":
    main()
