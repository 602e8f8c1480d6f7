"""Kernel benchmarks on a CUDA GPU: time, achieved bandwidth / FLOP/s, ratio to the device's measured
copy bandwidth, to the torch reference, and to the kernels users would otherwise run (mamba_ssm's
Triton ``selective_state_update`` / ``mamba_chunk_scan_combined``, causal-conv1d's torch reference).

    python benchmarks/kernels.py [--quick] [--json OUT.json] [--third-party third_party]

The third-party sources are imported from an ignored folder (``third_party/``, fetched from
state-spaces/mamba and Dao-AILab/causal-conv1d; never committed); only their pure-Triton / pure-torch
modules are loaded, without running the packages' ``__init__`` (which needs compiled extensions).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import inspect
import itertools
import json
import os
import sys
import types
from pathlib import Path

import torch

from _cuda_bench import graph_time, import_kernels_from_checkout  # noqa: E402 (the script's folder is on sys.path)

import_kernels_from_checkout()

import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

import importlib  # noqa: E402

# (the package re-exports functions under the module names, so import the modules explicitly)
conv1d, ssu_mod, ssd_scan, state_ops = (importlib.import_module(f"mambaserve.kernels.{m}") for m in
                                        ("conv1d", "selective_state_update", "ssd_scan", "state_ops"))
from mambaserve.kernels.config import KernelConfig  # noqa: E402
from mambaserve.kernels.gated_rmsnorm import gated_rmsnorm, gated_rmsnorm_ref  # noqa: E402

ROWS: list[dict] = []
COPY_BW = None  # bytes/s, measured first


def bench(fn, rep_ms=200):
    return do_bench(fn, warmup=25, rep=rep_ms, return_mode="median") * 1e-3  # seconds


def device_time(fn, n=10, key_len=48):
    """Summed device time per call (µs) of ``fn``'s kernels and its split per kernel (torch profiler, ``n``
    calls after 3 warm-ups)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    per = {}
    for e in prof.key_averages():
        t_us = getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) / n
        if t_us > 0:
            per[e.key[:key_len]] = round(t_us, 1)
    return sum(per.values()), per


def _exec_file(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def load_file(path: str, name: str = "ssd_scan_baseline"):
    """A Python file as a module (a previous version of a kernel file, for same-process A/Bs).

    A launcher whose jitted kernels are a module of their own (ssd_scan.py imports
    mambaserve.kernels.ssd_scan_kernels) runs that module's version from beside the file, named
    ``<file stem>_kernels.py`` (e.g. both from ``git show REV:kernels/...``): importing the checkout's
    would time the current kernels under the old launcher."""
    path = Path(path)
    own = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mambaserve.kernels.")
                and node.module.endswith("_kernels")):
            beside = path.with_name(f"{path.stem}_kernels.py")
            if not beside.exists():
                raise SystemExit(f"{path} imports {node.module}: put that file's version beside it as {beside}")
            own[node.module] = _exec_file(beside, f"{name}_kernels")
    saved = {m: sys.modules.get(m) for m in own}
    sys.modules.update(own)  # only while the file runs: its imports bind to its own kernels
    try:
        return _exec_file(path, name)
    finally:
        for m, old in saved.items():
            if old is None:
                sys.modules.pop(m, None)
            else:
                sys.modules[m] = old


def scan_launcher(mod):
    """``mod.ssd_scan_varlen`` called as the checkout's is: ``tiles=`` (one call's overrides of SCAN_CONFIG)
    and ``config=`` (a KernelConfig, its ``scan_tiles`` under ``tiles``). Previous files took the overrides
    as one ``config`` dict, the first ones none at all."""
    fn = mod.ssd_scan_varlen
    if "tiles" in inspect.signature(fn).parameters:
        return fn

    def launch(*args, tiles=None, config=None, **kw):
        overrides = {**(config.scan_tiles if config is not None else {}), **(tiles or {})}
        return fn(*args, **kw, **({"config": overrides} if overrides else {}))

    return launch


def record(kernel, shape, t, *, nbytes=None, flops=None, ref_t=None, ext_t=None, ext_name="", note=""):
    row = dict(kernel=kernel, shape=shape, us=t * 1e6, note=note)
    if nbytes is not None:
        row["GB/s"] = nbytes / t / 1e9
        row["of_copy"] = nbytes / t / COPY_BW
    if flops is not None:
        row["TFLOP/s"] = flops / t / 1e12
    if ref_t is not None:
        row["x_torch_ref"] = ref_t / t
    if ext_t is not None:
        row["x_" + ext_name] = ext_t / t
        row["ext"] = ext_name
    ROWS.append(row)
    print(json.dumps(row), flush=True)


def measure_copy_bw():
    a = torch.empty(2 * 1024**3 // 4, dtype=torch.float32, device="cuda").normal_()
    b = torch.empty_like(a)
    t = bench(lambda: b.copy_(a))
    del a, b
    return 2 * 2 * 1024**3 / t  # read + write


def load_third_party(root):
    """Import mamba_ssm's pure-Triton ops and causal-conv1d's torch references from ``root``."""
    ext = {}
    root = os.path.abspath(root)
    if not os.path.isdir(os.path.join(root, "mamba_ssm")):
        print(f"no third-party sources under {root}: comparing with the references only")
        return ext
    sys.path.insert(0, root)
    for pkg in ("mamba_ssm", "mamba_ssm.ops", "mamba_ssm.ops.triton", "mamba_ssm.utils", "causal_conv1d"):
        m = types.ModuleType(pkg)  # skip package __init__s: they import compiled extensions
        m.__path__ = [os.path.join(root, *pkg.split("."))]
        sys.modules[pkg] = m
    sys.modules["causal_conv1d_cuda"] = types.ModuleType("causal_conv1d_cuda")  # only refs are used
    try:
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update as m_ssu
        ext["ssu"] = m_ssu
    except Exception as e:  # noqa: BLE001
        print("mamba_ssm selective_state_update unavailable:", repr(e))
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
        ext["scan"] = mamba_chunk_scan_combined
    except Exception as e:  # noqa: BLE001
        print("mamba_chunk_scan_combined unavailable:", repr(e))
    try:
        from causal_conv1d.causal_conv1d_interface import causal_conv1d_ref, causal_conv1d_update_ref
        ext["conv_ref"], ext["conv_update_ref"] = causal_conv1d_ref, causal_conv1d_update_ref
    except Exception as e:  # noqa: BLE001
        print("causal_conv1d references unavailable:", repr(e))
    return ext


MODELS = {  # heads, head_dim, state, groups, conv_dim
    "mamba2-130m": (24, 64, 128, 1, 24 * 64 + 2 * 128),
    "mamba2-2.7b": (80, 64, 128, 1, 80 * 64 + 2 * 128),
    "nemotron-h-8b": (128, 64, 128, 8, 128 * 64 + 2 * 8 * 128),
}


def bench_ssu(ext, batches, models, sweep):
    for name in models:
        H, P, N, G, _ = MODELS[name]
        for Bsz in batches:
            slots = Bsz + 1
            pool = torch.randn(slots, H, P, N, device="cuda")
            x, z = torch.randn(Bsz, H, P, device="cuda", dtype=torch.bfloat16), None
            dt = torch.randn(Bsz, H, device="cuda", dtype=torch.bfloat16)
            A = -torch.rand(H, device="cuda")
            B = torch.randn(Bsz, G, N, device="cuda", dtype=torch.bfloat16)
            C = torch.randn_like(B)
            D, bias = torch.randn(H, device="cuda"), torch.randn(H, device="cuda")
            idx = torch.randperm(slots, device="cuda")[:Bsz]
            nbytes = 2 * Bsz * H * P * N * 4 + 2 * x.numel() * 2
            run = lambda **kw: ssu_mod.selective_state_update(pool, x, dt, A, B, C, D, z, bias,  # noqa: E731
                                                              state_indices=idx, **kw)
            t = bench(run)
            note = ""
            if sweep and Bsz * H >= 2560:
                best = None
                for bp in (8, 16, 32):
                    for w in (2, 4, 8):
                        tt = bench(lambda: run(block_p=bp, num_warps=w))
                        if best is None or tt < best[0]:
                            best = (tt, bp, w)
                note = f"best sweep BLOCK_P={best[1]} warps={best[2]}: {nbytes / best[0] / COPY_BW:.0%} of copy"
            ref_t = bench(lambda: ssu_mod.selective_state_update_ref(pool, x, dt, A, B, C, D, z, bias,
                                                                     state_indices=idx), rep_ms=50)
            ext_t = None
            if "ssu" in ext:
                # as Mamba2.step calls it: per-(head, p) tensors broadcast with stride 0, state indexed
                A_ = A[:, None, None].expand(H, P, N)
                dt_ = dt[:, :, None].expand(Bsz, H, P)
                bias_ = bias[:, None].expand(H, P)
                D_ = D[:, None].expand(H, P)
                ext_t = bench(lambda: ext["ssu"](pool, x, dt_, A_, B, C, D_, z, bias_, dt_softplus=True,
                                                 state_batch_indices=idx))
            record("selective_state_update", f"{name} b={Bsz} fp32 state", t, nbytes=nbytes, ref_t=ref_t,
                   ext_t=ext_t, ext_name="mamba_ssm", note=note)
            if Bsz == 1:
                gt = graph_time(run)
                record("selective_state_update", f"{name} b=1 in CUDA graph", gt, nbytes=nbytes,
                       note="per call, graph replay")
            del pool


def scan_flops(T, H, P, N, Q):
    # causal intra-chunk C.B^T and (scores).x (half of Q on average), chunk state, state->output
    return 2 * T * H * (Q / 2 * (N + P) + 2 * N * P)


def scan_inputs(nseq: int, L: int, spare_slots: int = 0):
    """bf16 inputs of the chunked scan at mamba2-2.7b dims for nseq sequences of L tokens, and its kwargs;
    the pool has ``spare_slots`` slots past the sequences'."""
    H, P, N, G, _ = MODELS["mamba2-2.7b"]
    T = nseq * L
    x = torch.randn(T, H, P, device="cuda", dtype=torch.bfloat16)
    dt = torch.randn(T, H, device="cuda", dtype=torch.bfloat16) - 2
    A = -torch.rand(H, device="cuda") * 4
    B = (torch.randn(T, G, N, device="cuda") * 0.3).to(torch.bfloat16)
    C = (torch.randn(T, G, N, device="cuda") * 0.3).to(torch.bfloat16)
    D, bias = torch.randn(H, device="cuda"), torch.randn(H, device="cuda")
    pool = torch.zeros(nseq + 1 + spare_slots, H, P, N, device="cuda")
    kw = dict(chunk_size=256, cu_seqlens=torch.arange(0, T + 1, L, dtype=torch.int32, device="cuda"),
              ssm_state=pool, state_indices=torch.arange(1, nseq + 1, device="cuda"),
              has_initial_state=torch.zeros(nseq, dtype=torch.bool, device="cuda"), D=D, dt_bias=bias,
              dt_softplus=True)
    return x, dt, A, B, C, D, bias, pool, kw


# Tile sweeps of the scan, one kernel at a time over the defaults (kernels/ssd_scan.py's SCAN_CONFIG).
SCAN_SWEEP = {
    "output": [{}, dict(block_n=64), dict(num_stages=1), dict(maxnreg=72), dict(maxnreg=96), dict(tma=False),
               dict(block_k=32), dict(num_warps=2, maxnreg=None, num_stages=1)],
    "state": [dict(state_tma=False), dict(state_wide_per_sm=1 << 20), dict(state_wide_per_sm=0)],
}


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def sweep_scan(run, pool, label):
    """Times each sweep config (full scan call); every config must give the default's y and state."""
    pool.zero_()
    y0, _ = run()
    s0 = pool.clone()
    best = {}
    for kernel, configs in SCAN_SWEEP.items():
        for cfg in configs:
            try:
                pool.zero_()
                y1, _ = run(tiles=cfg)  # same inputs: every config must compute the same y and state
                err = max(rel(y1, y0), rel(pool, s0))
                tt = bench(lambda: run(tiles=cfg), rep_ms=100)
            except Exception as e:  # noqa: BLE001 - e.g. out of shared memory
                print(f"scan {label} {kernel} config {cfg} failed: {repr(e)[:160]}", flush=True)
                continue
            print(f"scan {label} {kernel} {cfg}: {tt * 1e6:.1f} us, rel diff to default {err:.2e}", flush=True)
            if err < 1e-2 and (kernel not in best or tt < best[kernel][0]):
                best[kernel] = (tt, cfg)
    for kernel, (tt, cfg) in best.items():
        print(f"scan {label} best {kernel}: {tt * 1e6:.1f} us {cfg}", flush=True)
    return best


def bench_scan(ext, cases, sweep, base: KernelConfig):
    H, P, N, G, _ = MODELS["mamba2-2.7b"]
    Q = 256
    for nseq, L in cases:
        T = nseq * L
        x, dt, A, B, C, D, bias, pool, kw = scan_inputs(nseq, L)
        run = lambda tiles=None: ssd_scan.ssd_scan_varlen(x, dt, A, B, C, tiles=tiles, config=base, **kw)  # noqa: E731
        t = bench(run)
        note = ""
        if sweep:
            best = sweep_scan(run, pool, f"{nseq}x{L}")
            note = "; ".join(f"best {k}: {v[0] * 1e6:.0f} us {v[1]}" for k, v in best.items())
        ref_t = None
        if T <= 16384:
            ref_t = bench(lambda: ssd_scan.ssd_scan_varlen_ref(x, dt, A, B, C, **kw), rep_ms=100)
        ext_t = None
        if "scan" in ext:
            xb, dtb = x.view(nseq, L, H, P), dt.view(nseq, L, H)
            Bb, Cb = B.view(nseq, L, G, N), C.view(nseq, L, G, N)
            ext_t = bench(lambda: ext["scan"](xb, dtb, A, Bb, Cb, Q, D=D, dt_bias=bias, dt_softplus=True,
                                              return_final_states=True))
            print(f"mamba_ssm {nseq}x{L} autotuned:", mamba_configs(), flush=True)
        record("ssd_scan_varlen", f"2.7b {nseq}x{L} Q=256 bf16", t, flops=scan_flops(T, H, P, N, Q), ref_t=ref_t,
               ext_t=ext_t, ext_name="mamba_ssm", note=note)
        del pool


def mamba_configs():
    """The configs mamba_ssm's autotuner picked for its scan kernels (what we are compared with)."""
    out = {}
    for mod, names in [("ssd_chunk_state", ("_chunk_cumsum_fwd_kernel", "_chunk_state_fwd_kernel")),
                       ("ssd_state_passing", ("_state_passing_fwd_kernel",)), ("ssd_bmm", ("_bmm_chunk_fwd_kernel",)),
                       ("ssd_chunk_scan", ("_chunk_scan_fwd_kernel",))]:
        m = sys.modules.get(f"mamba_ssm.ops.triton.{mod}")
        for name in names:
            cfg = getattr(getattr(m, name, None), "best_config", None)
            if cfg is not None:
                out[name] = str(cfg)
    return out


def scan_breakdown(ext, configs=({},), base: KernelConfig | None = None):
    """Per-kernel device time of one scan call (ours with each of ``configs`` over ``base``'s tiles, and
    mamba_ssm's), through the torch profiler. The ratio of summed device times is the fair comparison:
    `mamba_chunk_scan_combined`'s wall time per call (bench_scan) sometimes includes host time (seen on the
    H100: 1045 us wall for 732 us of kernels), ours stays within ~3% of its device time."""
    H, P, N, G, _ = MODELS["mamba2-2.7b"]
    for nseq, L in [(8, 2048), (1, 16384)]:
        x, dt, A, B, C, D, bias, pool, kw = scan_inputs(nseq, L)
        kw.pop("dt_softplus")
        fns = {f"ours {json.dumps(cfg)}" if cfg else "ours": (lambda cfg=cfg: ssd_scan.ssd_scan_varlen(
            x, dt, A, B, C, tiles=cfg, config=base, **kw)) for cfg in configs}
        if "scan" in ext:
            xb, dtb = x.view(nseq, L, H, P), dt.view(nseq, L, H)
            Bb, Cb = B.view(nseq, L, G, N), C.view(nseq, L, G, N)
            fns["mamba_ssm"] = lambda: ext["scan"](xb, dtb, A, Bb, Cb, 256, D=D, dt_bias=bias, dt_softplus=True,
                                                   return_final_states=True)
        totals = {}
        for who, fn in fns.items():
            totals[who], per = device_time(fn)
            print(f"breakdown {who} {nseq}x{L} (us per call):", json.dumps(per), flush=True)
            ROWS.append(dict(kernel="scan breakdown " + who, shape=f"{nseq}x{L}", us=totals[who],
                             note=json.dumps(per)))
        if "mamba_ssm" in totals:
            print(f"breakdown {nseq}x{L}: device time x mamba_ssm =",
                  {who: round(totals["mamba_ssm"] / t, 3) for who, t in totals.items() if who != "mamba_ssm"},
                  flush=True)


def bench_conv(ext, batches):
    _, _, _, _, Dm = MODELS["mamba2-2.7b"]
    K = 4
    w = torch.randn(Dm, K, device="cuda")
    bias = torch.randn(Dm, device="cuda")
    for nseq, L in [(8, 2048), (1, 16384)]:
        T = nseq * L
        x = torch.randn(T, Dm, device="cuda", dtype=torch.bfloat16)
        pool = torch.zeros(nseq + 1, Dm, K - 1, device="cuda", dtype=torch.bfloat16)
        cu = torch.arange(0, T + 1, L, dtype=torch.int32, device="cuda")
        slots = torch.arange(1, nseq + 1, device="cuda")
        no = torch.zeros(nseq, dtype=torch.bool, device="cuda")
        t = bench(lambda: conv1d.causal_conv1d_varlen(x, w, bias, pool, cu, slots, no))
        ref_t = bench(lambda: conv1d.causal_conv1d_varlen_ref(x, w, bias, pool, cu, slots, no), rep_ms=50)
        ext_t = None
        if "conv_ref" in ext:
            xb = x.view(nseq, L, Dm).transpose(1, 2)
            ext_t = bench(lambda: ext["conv_ref"](xb, w, bias, activation="silu"), rep_ms=50)
        record("causal_conv1d_varlen", f"2.7b {nseq}x{L} K=4 bf16", t, nbytes=2 * x.numel() * 2, ref_t=ref_t,
               ext_t=ext_t, ext_name="causal_conv1d_ref")
    for Bsz in batches:
        x = torch.randn(Bsz, Dm, device="cuda", dtype=torch.bfloat16)
        pool = torch.randn(Bsz + 1, Dm, K - 1, device="cuda", dtype=torch.bfloat16)
        idx = torch.randperm(Bsz + 1, device="cuda")[:Bsz]
        t = bench(lambda: conv1d.causal_conv1d_update(x, pool, w, bias, idx))
        ref_t = bench(lambda: conv1d.causal_conv1d_update_ref(x, pool, w, bias, idx), rep_ms=50)
        ext_t = None
        if "conv_update_ref" in ext:
            st = pool[:Bsz].clone()
            ext_t = bench(lambda: ext["conv_update_ref"](x, st, w, bias, activation="silu"), rep_ms=50)
        nbytes = Bsz * Dm * (2 * (K - 1) * 2 + 2 * 2)
        record("causal_conv1d_update", f"2.7b b={Bsz} K=4 bf16", t, nbytes=nbytes, ref_t=ref_t, ext_t=ext_t,
               ext_name="causal_conv1d_ref")


def bench_state_ops(cases):
    """(model, layers, slots) cases: copy, clear and the masked scatter of ``slots`` slots' ssm states.
    Timed from CUDA graphs of 10 calls: eager calls leave a gap between launches (~3 us on an H100) that
    weighs on the small cases (the eager time is in the note); torch's clear (a host scalar) and scatter
    (nonzero synchronises) cannot be captured and are timed eagerly. Small cases rotate over disjoint slot sets so that
    consecutive calls do not find their slots in L2."""
    for name, n_layers, n_pairs in cases:
        H, P, N, _, _ = MODELS[name]
        E = H * P * N
        label = f"{name.removeprefix('mamba2-')} {n_layers} layers x {n_pairs}"
        nbytes = 2 * n_layers * n_pairs * E * 4
        sets = min(10, -(-300_000_000 // nbytes))
        pool = torch.randn(n_layers, 2 * n_pairs * sets + 1, H, P, N, device="cuda")
        steps = torch.randn(n_layers, n_pairs * sets, 2, H, P, N, device="cuda")
        step = torch.randint(0, 2, (n_pairs,), device="cuda")
        step[::4] = -1
        live = int((step >= 0).sum())
        args = [(torch.arange(1, n_pairs + 1, device="cuda") + 2 * n_pairs * i,
                 torch.arange(n_pairs + 1, 2 * n_pairs + 1, device="cuda") + 2 * n_pairs * i,
                 steps[:, n_pairs * i:n_pairs * (i + 1)]) for i in range(sets)]  # (src, dst, scatter source)
        turn = itertools.count()

        def rotate(fn):
            return lambda: fn(*args[next(turn) % sets])

        ops = [("copy_slots", f"{label} slots fp32", nbytes, True,
                lambda src, dst, _: state_ops.copy_slots(pool, src, dst),
                lambda src, dst, _: state_ops.copy_slots_ref(pool, src, dst)),
               ("clear_slots", f"{label} slots fp32", nbytes // 2, False,
                lambda _, dst, __: state_ops.clear_slots(pool, dst),
                lambda _, dst, __: state_ops.clear_slots_ref(pool, dst)),
               ("scatter_steps", f"{label} rows ({live} live) fp32", 2 * n_layers * live * E * 4, False,
                lambda _, dst, src: state_ops.scatter_steps(pool, src, dst, step),
                lambda _, dst, src: state_ops.scatter_steps_ref(pool, src, dst, step))]
        for kernel, shape, op_bytes, ref_in_graph, ours, ref in ops:
            t = graph_time(rotate(ours), n=10)
            ref_t = graph_time(rotate(ref), n=10) if ref_in_graph else bench(rotate(ref))
            record(kernel, shape, t, nbytes=op_bytes, ref_t=ref_t,
                   note=f"graph; eager {bench(rotate(ours)) * 1e6:.1f} us" + ("" if ref_in_graph else ", torch eager"))
        del pool, steps
        torch.cuda.empty_cache()


def bench_norm():
    for name in ("mamba2-2.7b", "nemotron-h-8b"):
        H, P, _, G, _ = MODELS[name]
        D = H * P
        for T in (64, 16384):
            xz = torch.randn(T, 2 * D, device="cuda", dtype=torch.bfloat16)
            x, z = xz[:, :D], xz[:, D:]
            w = torch.randn(D, device="cuda", dtype=torch.bfloat16)
            t = bench(lambda: gated_rmsnorm(x, z, w, 1e-5, D // G))
            ref_t = bench(lambda: gated_rmsnorm_ref(x, z, w, 1e-5, D // G))
            record("gated_rmsnorm", f"{name} T={T} G={G} bf16", t, nbytes=3 * T * D * 2, ref_t=ref_t)


def print_table():
    cols = ["kernel", "shape", "us", "GB/s", "of_copy", "TFLOP/s", "x_torch_ref", "x_ext", "note"]
    print("\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in ROWS:
        ext_key = next((k for k in r if k.startswith("x_") and k != "x_torch_ref"), None)
        vals = []
        for c in cols:
            v = r.get(ext_key) if c == "x_ext" else r.get(c)
            if c == "x_ext" and v is not None:
                vals.append(f"{v:.2f} ({r['ext']})")
            elif isinstance(v, float):
                vals.append(f"{v:.0%}" if c == "of_copy" else f"{v:.3g}" if c != "us" else f"{v:.1f}")
            else:
                vals.append("" if v is None else str(v))
        print("| " + " | ".join(vals) + " |")


def main():
    global COPY_BW
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="also sweep tile configs of the SSU and the scan")
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "kernels_bench.json"))
    ap.add_argument("--third-party", default=os.path.join(os.path.dirname(__file__), "..", "third_party"))
    ap.add_argument("--only", default="copy,ssu,scan,conv,state,norm")
    ap.add_argument("--scan-config", default="{}", help="JSON over kernels/ssd_scan.py's SCAN_CONFIG")
    ap.add_argument("--breakdown-configs", default="[{}]", help="JSON list of scan configs to break down")
    a = ap.parse_args()
    only = set(a.only.split(","))
    scan_base = KernelConfig(scan_tiles=json.loads(a.scan_config))  # under each call's sweep tiles
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    print(f"device: {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}, "
          f"triton {triton.__version__}", flush=True)
    COPY_BW = measure_copy_bw()
    record("device copy (torch)", "2 GiB fp32", 2 * 2 * 1024**3 / COPY_BW, nbytes=2 * 2 * 1024**3)
    ext = load_third_party(a.third_party)
    batches = [1, 8, 64, 512] if a.quick else [1, 8, 32, 64, 128, 256, 512]
    if "ssu" in only:
        bench_ssu(ext, batches, list(MODELS), a.sweep)
    if "breakdown" in only:
        scan_breakdown(ext, json.loads(a.breakdown_configs), scan_base)
    if "scan" in only:
        bench_scan(ext, [(8, 2048), (1, 16384)], a.sweep, scan_base)
    if "conv" in only:
        bench_conv(ext, [1, 64, 512])
    if "state" in only:
        bench_state_ops([("mamba2-2.7b", 16, 8)] if a.quick else
                        [(m, L, n) for m, L in (("mamba2-130m", 24), ("mamba2-2.7b", 64)) for n in (2, 8, 32)])
    if "norm" in only:
        bench_norm()
    print_table()
    with open(a.json, "w") as f:
        json.dump(dict(device=props.name, copy_GBps=COPY_BW / 1e9, torch=torch.__version__,
                       triton=triton.__version__, rows=ROWS), f, indent=1)


if __name__ == "__main__":
    main()
