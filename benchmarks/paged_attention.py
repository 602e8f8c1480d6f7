"""Paged attention on a CUDA GPU (the attention layers of hybrid models): time per call, achieved bandwidth
(decode, write_kv) or FLOP/s (prefill) against the H100's published limits and the measured copy bandwidth,
and the ratio to the torch reference and to ``torch.nn.functional.scaled_dot_product_attention`` over the
same K/V stored densely (what a non-paged engine would run), all in this process.

    python benchmarks/paged_attention.py [--sweep] [--page-size 16] [--json OUT.json]

Shapes: nemotron-h-8b's attention (32 query heads, 8 KV heads, head_dim 128) and granite-4.0-h-tiny's
(12 / 4 / 128), bf16. Every time is the median of CUDA-graph replays (20 calls a graph), so launch
overhead is not counted for any of the three. Decode bytes: the K/V of every sequence's tokens (what
any implementation must read), plus q and the output. ``--sweep`` also times tile variants (~1 minute more).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F

import _cuda_bench  # noqa: E402 (the script's folder is on sys.path)

_cuda_bench.import_kernels_from_checkout()

from triton.testing import do_bench  # noqa: E402

from mambaserve.kernels import paged_attention as pa  # noqa: E402

SHAPES = {"nemotron-h-8b": (32, 8, 128), "granite-4.0-h-tiny": (12, 4, 128)}
# published limits: H100 SXM5 HBM3 3.35 TB/s and 989 dense bf16 TFLOP/s (PCIe: 2.0 TB/s, 756; H200: 4.8 TB/s, 989)
LIMITS = {"H100 PCIe": (2.0e12, 756e12), "H100 NVL": (3.9e12, 835e12), "H100": (3.35e12, 989e12),
          "H200": (4.8e12, 989e12)}
H100 = LIMITS["H100"]
ROWS: list[dict] = []
COPY_BW = None
REF_BUDGET = 12 * 1024**3  # bytes the torch references may allocate (they gather K/V in fp32 per query head)


def device_limits() -> tuple[str, float, float]:
    name = torch.cuda.get_device_name()
    for key, (bw, fl) in LIMITS.items():
        if key.replace(" ", "").lower() in name.replace(" ", "").lower():
            return key, bw, fl
    return "H100 (assumed)", *H100


def graph_time(fn, n=20, rep_ms=100) -> float:
    return _cuda_bench.graph_time(fn, n, rep_ms=rep_ms, warmup_ms=10)


def record(kernel, shape, t, *, nbytes=None, flops=None, ref_t=None, sdpa_t=None, note=""):
    _, bw, fl = LIM
    row = dict(kernel=kernel, shape=shape, us=round(t * 1e6, 2))
    if nbytes is not None:
        row["GB/s"] = round(nbytes / t / 1e9, 1)
        row["of_peak_bw"] = round(nbytes / t / bw, 3)
        row["of_copy"] = round(nbytes / t / COPY_BW, 3)
    if flops is not None:
        row["TFLOP/s"] = round(flops / t / 1e12, 1)
        row["of_peak_flops"] = round(flops / t / fl, 3)
    if ref_t is not None:
        row["x_torch_ref"] = round(ref_t / t, 2)
    if sdpa_t is not None:
        row["x_sdpa"] = round(sdpa_t / t, 2)
    if note:
        row["note"] = note
    ROWS.append(row)
    print(json.dumps(row), flush=True)


def paged_cache(lens, Hkv, D, page_size, dtype=torch.bfloat16):
    """K/V caches holding ``lens`` tokens per sequence on pages scattered at random; the block table."""
    need = [-(-L // page_size) for L in lens]
    num_pages = max(1, sum(need))
    k_cache = torch.randn(num_pages, page_size, Hkv, D, device="cuda", dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(num_pages, device="cuda", dtype=torch.int32)
    table = torch.zeros(len(lens), max(need + [1]), dtype=torch.int32, device="cuda")
    start = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[start:start + n]
        start += n
    return k_cache, v_cache, table


def dense_kv(k_cache, v_cache, table, L):
    """Sequences of equal length ``L`` as SDPA's dense ``[B, Hkv, L, D]``."""
    B = table.shape[0]
    k = k_cache[table.long()].reshape(B, -1, *k_cache.shape[2:])[:, :L].transpose(1, 2).contiguous()
    v = v_cache[table.long()].reshape(B, -1, *v_cache.shape[2:])[:, :L].transpose(1, 2).contiguous()
    return k, v


def sdpa(q, k, v, **kw):
    """``(fn, label)``: SDPA on the first backend that takes these inputs, flash attention first; GQA through
    ``enable_gqa`` where the backend has it, else K/V repeated per query head (more bytes: said in the label)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = q.shape[1] // k.shape[1]
    kr, vr = (k, v) if g == 1 else (k.repeat_interleave(g, 1), v.repeat_interleave(g, 1))
    tries = [(SDPBackend.FLASH_ATTENTION, True), (SDPBackend.FLASH_ATTENTION, False),
             (SDPBackend.EFFICIENT_ATTENTION, False), (SDPBackend.MATH, True)]
    for backend, gqa in tries:
        kk, vv, extra = (k, v, {"enable_gqa": True}) if gqa else (kr, vr, {})

        def fn(kk=kk, vv=vv, extra=extra, backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, kk, vv, **extra, **kw)
        try:
            fn()
        except (RuntimeError, TypeError):
            continue
        return fn, f"sdpa={backend.name.lower()}" + ("" if gqa or g == 1 else "(kv repeated)")
    raise RuntimeError("no SDPA backend took these inputs")


def bench_decode(shape, B, ctx, page_size, tiles=None, compare=True):
    Hq, Hkv, D = SHAPES[shape]
    lens = [ctx] * B
    k_cache, v_cache, table = paged_cache(lens, Hkv, D, page_size)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(B, Hq, D, device="cuda", dtype=torch.bfloat16)
    scale = D ** -0.5
    t = graph_time(lambda: pa.paged_decode_attention(q, k_cache, v_cache, table, seq_lens, scale, tiles=tiles))
    nbytes = 2 * B * ctx * Hkv * D * 2 + 2 * q.numel() * 2
    splits = (tiles or {}).get("splits") or pa.decode_splits(B, Hkv, table.shape[1] * page_size,
                                                             torch.cuda.get_device_properties(0).multi_processor_count,
                                                             (tiles or {}).get("block_n", pa.DECODE_TILES["block_n"]))
    ref_t = sdpa_t = None
    label = ""
    if compare:
        if B * table.shape[1] * page_size * Hq * D * 4 * 4 < REF_BUDGET:
            ref_t = graph_time(lambda: pa.paged_decode_attention_ref(q, k_cache, v_cache, table, seq_lens, scale),
                               n=2, rep_ms=50)
        k, v = dense_kv(k_cache, v_cache, table, ctx)
        qd = q[:, :, None]
        fn, label = sdpa(qd, k, v, scale=scale)
        sdpa_t = graph_time(fn)
        # the same answer as the dense attention (a benchmark of a wrong kernel is worthless)
        out = pa.paged_decode_attention(q, k_cache, v_cache, table, seq_lens, scale, tiles=tiles)
        dense = fn()[:, :, 0]
        err = ((out.float() - dense.float()).norm() / dense.float().norm()).item()
        assert err < 2e-2, f"decode {shape} B={B} ctx={ctx}: relative error {err:.3g} against SDPA"
        del k, v
    record("paged_decode", f"{shape} B={B} ctx={ctx} page={page_size}", t, nbytes=nbytes, ref_t=ref_t,
           sdpa_t=sdpa_t, note=f"splits={splits} {label}" + (f" tiles={tiles}" if tiles else ""))
    return t


def bench_prefill(shape, B, new, prefix, page_size, tiles=None, compare=True):
    Hq, Hkv, D = SHAPES[shape]
    L = prefix + new
    k_cache, v_cache, table = paged_cache([L] * B, Hkv, D, page_size)
    q = torch.randn(B * new, Hq, D, device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(0, B * new + 1, new, dtype=torch.int32, device="cuda")
    seq_lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
    scale = D ** -0.5
    args = (q, k_cache, v_cache, table, cu, seq_lens, scale)
    t = graph_time(lambda: pa.paged_prefill_attention(*args, tiles=tiles))
    visible = B * (new * prefix + new * (new + 1) // 2)
    flops = 4 * visible * Hq * D
    ref_t = sdpa_t = None
    label = ""
    if compare:
        if B * L * Hq * D * 4 * 4 + B * Hq * new * L * 4 * 3 < REF_BUDGET:
            ref_t = graph_time_host(lambda: pa.paged_prefill_attention_ref(*args))
        k, v = dense_kv(k_cache, v_cache, table, L)
        qd = q.view(B, new, Hq, D).transpose(1, 2)
        if prefix == 0:
            fn, label = sdpa(qd, k, v, is_causal=True, scale=scale)
        else:  # bottom-right causal: the new tokens are the last `new` of L
            from torch.nn.attention.bias import causal_lower_right
            fn, label = sdpa(qd, k, v, attn_mask=causal_lower_right(new, L), scale=scale)
        sdpa_t = graph_time(fn)
        out = pa.paged_prefill_attention(*args, tiles=tiles)
        dense = fn().transpose(1, 2).reshape(B * new, Hq, D)
        err = ((out.float() - dense.float()).norm() / dense.float().norm()).item()
        assert err < 2e-2, f"prefill {shape} B={B} new={new} prefix={prefix}: relative error {err:.3g} against SDPA"
        del k, v
    record("paged_prefill", f"{shape} B={B} new={new} prefix={prefix} page={page_size}", t, flops=flops,
           ref_t=ref_t, sdpa_t=sdpa_t, note=label + (f" tiles={tiles}" if tiles else ""))
    return t


def graph_time_host(fn, rep_ms=100) -> float:
    """The prefill reference synchronises with the host (lengths on the host): timed without a graph."""
    return do_bench(fn, warmup=2, rep=rep_ms, return_mode="median") * 1e-3


def bench_write_kv(shape, T, page_size):
    _, Hkv, D = SHAPES[shape]
    num_pages = -(-T // page_size) + 8
    k_cache = torch.zeros(num_pages, page_size, Hkv, D, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    k, v = (torch.randn(T, Hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    slots = torch.randperm(num_pages * page_size, device="cuda")[:T]
    t = graph_time(lambda: pa.write_kv(k, v, k_cache, v_cache, slots))
    # the reference's boolean mask synchronises with the host: timed without a graph
    ref_t = graph_time_host(lambda: pa.write_kv_ref(k, v, k_cache, v_cache, slots), rep_ms=50)
    record("write_kv", f"{shape} T={T} page={page_size}", t, nbytes=2 * 2 * T * Hkv * D * 2, ref_t=ref_t)


def sweep(page_size):
    print("# decode tiles (nemotron-h-8b)")
    for B, ctx in ((1, 32768), (64, 2048), (256, 4096)):
        best = None
        for block_n in (32, 64, 128):
            for warps in (2, 4, 8):
                for stages in (1, 2, 3):
                    tiles = dict(block_n=block_n, num_warps=warps, num_stages=stages)
                    try:
                        t = bench_decode("nemotron-h-8b", B, ctx, page_size, tiles=tiles, compare=False)
                    except Exception as e:  # noqa: BLE001 - a variant that does not compile (shared memory)
                        print(f"# {tiles}: {type(e).__name__}")
                        continue
                    best = min(best or (t, tiles), (t, tiles), key=lambda x: x[0])
        print(f"# best decode B={B} ctx={ctx}: {best[1]} {best[0] * 1e6:.1f} us")
    print("# prefill tiles (nemotron-h-8b)")
    for B, new, prefix in ((1, 4096, 0), (4, 512, 4096)):
        best = None
        for rows in (64, 128):
            for block_n in (32, 64, 128):
                for warps in (4, 8):
                    for stages in (2, 3):
                        tiles = dict(rows=rows, block_n=block_n, num_warps=warps, num_stages=stages)
                        try:
                            t = bench_prefill("nemotron-h-8b", B, new, prefix, page_size, tiles=tiles, compare=False)
                        except Exception as e:  # noqa: BLE001
                            print(f"# {tiles}: {type(e).__name__}")
                            continue
                        best = min(best or (t, tiles), (t, tiles), key=lambda x: x[0])
        print(f"# best prefill B={B} new={new} prefix={prefix}: {best[1]} {best[0] * 1e6:.1f} us")


def main():
    global COPY_BW, LIM
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="also time tile variants of decode and prefill")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "paged_attention_bench.json"))
    args = ap.parse_args()
    torch.manual_seed(0)
    LIM = device_limits()
    COPY_BW = _cuda_bench.copy_bandwidth()
    print(f"# {torch.cuda.get_device_name()}: limits of {LIM[0]}: {LIM[1] / 1e12:.2f} TB/s, "
          f"{LIM[2] / 1e12:.0f} bf16 TFLOP/s; measured copy {COPY_BW / 1e12:.2f} TB/s; torch {torch.__version__}, "
          f"triton {__import__('triton').__version__}")
    ps = args.page_size
    for shape, B, ctx in (("nemotron-h-8b", 1, 2048), ("nemotron-h-8b", 1, 32768), ("nemotron-h-8b", 64, 2048),
                          ("nemotron-h-8b", 256, 1024), ("nemotron-h-8b", 256, 4096), ("granite-4.0-h-tiny", 64, 4096)):
        bench_decode(shape, B, ctx, ps)
    bench_decode("nemotron-h-8b", 64, 2048, 1)  # page size 1: token-granular gathers
    for shape, B, new, prefix in (("nemotron-h-8b", 1, 4096, 0), ("nemotron-h-8b", 8, 1024, 0),
                                  ("nemotron-h-8b", 4, 512, 4096), ("granite-4.0-h-tiny", 1, 8192, 0)):
        bench_prefill(shape, B, new, prefix, ps)
    bench_write_kv("nemotron-h-8b", 8192, ps)
    if args.sweep:
        sweep(ps)
    with open(args.json, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), copy_bw=COPY_BW, rows=ROWS), f, indent=1)
    print(f"# wrote {args.json}")


LIM = ("H100", *H100)
if __name__ == "__main__":
    main()
