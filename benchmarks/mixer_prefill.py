"""The Mamba mixer's prefill kernels (the causal conv and the chunked scan) at the shapes of a cache hit's extend
step and of prompts, under tile variants: each kernel's device time (torch profiler) and the whole call's (CUDA
graph), beside the bytes the call must move at the measured copy bandwidth. Needs a CUDA device.

A hit's extend step is short sequences that start from cached states (8 x 64 new tokens after 1,088 cached:
granite's multi-turn round), where a kernel's serial walk over its tokens, not bandwidth, sets the time.

  python benchmarks/mixer_prefill.py                                  # granite-4.0-h-tiny's mixer
  python benchmarks/mixer_prefill.py --mixer mamba2-2.7b --shapes "prompts 8x2048"
  python benchmarks/mixer_prefill.py --conv '[{"BLOCK_T": 16}]' --scan '[{"state_small_per_sm": 64}]'
"""

from __future__ import annotations

import argparse
import collections
import json

import torch

from _cuda_bench import copy_bandwidth, graph_time, import_kernels_from_checkout  # noqa: E402 (on sys.path)

import_kernels_from_checkout()

from mambaserve.kernels.config import DEFAULT, KernelConfig  # noqa: E402
from mambaserve.kernels.conv1d import causal_conv1d_varlen  # noqa: E402
from mambaserve.kernels.ssd_scan import ssd_scan_varlen  # noqa: E402

# the published mixers' shapes (the conv runs over x, B and C)
MIXERS = {"granite-4.0-h-tiny": dict(heads=48, head_dim=64, groups=1, state=128, conv_width=4, chunk=256),
          "nemotron-h-8b": dict(heads=128, head_dim=64, groups=8, state=128, conv_width=4, chunk=128),
          "mamba2-2.7b": dict(heads=80, head_dim=64, groups=1, state=128, conv_width=4, chunk=256)}
MIXER = dict(MIXERS["granite-4.0-h-tiny"])
# (sequences, new tokens each, tokens cached before them)
SHAPES = {"hit 8x64 after 1088": (8, 64, 1088), "prompt 1x2048": (1, 2048, 0), "prompts 8x2048": (8, 2048, 0)}


def inputs(S: int, L: int, cached: int, device, dtype=torch.bfloat16):
    m = MIXER
    H, P, G, N = m["heads"], m["head_dim"], m["groups"], m["state"]
    T, D = S * L, H * P + 2 * G * N
    g = torch.Generator(device=device).manual_seed(0)
    r = lambda *s, dt=dtype: torch.randn(*s, generator=g, device=device, dtype=torch.float32).to(dt)  # noqa: E731
    slots = torch.arange(S, device=device)
    return dict(
        xbc=r(T, D), w=r(D, m["conv_width"]) * 0.3, bias=r(D), conv_state=r(2 * S, D, m["conv_width"] - 1),
        cu=torch.arange(0, T + 1, L, device=device, dtype=torch.int32), slots=slots,
        init=torch.full((S,), cached > 0, device=device), start=torch.full((S,), cached, device=device),
        # the snapshot a hybrid keeps: its last page boundary (pages of 16) before the prompt's last token
        snap=slots + S, snap_len=torch.full((S,), (L - 1) // 16 * 16, device=device, dtype=torch.int32),
        x=r(T, H, P), dt=r(T, H), A=-torch.rand(H, device=device), B=r(T, G, N), C=r(T, G, N),
        D=torch.ones(H, device=device), dt_bias=torch.zeros(H, device=device),
        ssm_state=r(2 * S, H, P, N, dt=torch.float32))


def conv_call(t, config):
    return lambda: causal_conv1d_varlen(t["xbc"], t["w"], t["bias"], t["conv_state"], t["cu"], t["slots"], t["init"],
                                        snap_slots=t["snap"], snap_len=t["snap_len"], config=config)


def scan_call(t, config):
    return lambda: ssd_scan_varlen(t["x"], t["dt"], t["A"], t["B"], t["C"], chunk_size=MIXER["chunk"],
                                   cu_seqlens=t["cu"], ssm_state=t["ssm_state"], state_indices=t["slots"],
                                   has_initial_state=t["init"], seq_start_pos=t["start"], D=t["D"],
                                   dt_bias=t["dt_bias"], snap_slots=t["snap"], snap_len=t["snap_len"], config=config)


def kernel_times(fn, reps: int = 20) -> dict[str, float]:
    """Microseconds per call of each kernel ``fn`` launches."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out = collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out[e.name] += e.device_time / reps
    return dict(out)


def moved_bytes(t, S: int, cached: int) -> dict[str, int]:
    """What each op must read and write once: its inputs and outputs, the states it starts from (read), ends in and
    snapshots (written)."""
    T, D = t["xbc"].shape
    conv_state = t["conv_state"][0].numel() * t["conv_state"].element_size()
    ssm = t["ssm_state"][0].numel() * 4
    x = t["x"].numel() * 2
    return {"conv": 2 * T * D * 2 + conv_state * S * (3 if cached else 2),
            "scan": 2 * x + (t["B"].numel() + t["C"].numel() + t["dt"].numel()) * 2 + ssm * S * (3 if cached else 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mixer", default="granite-4.0-h-tiny", choices=sorted(MIXERS))
    ap.add_argument("--shapes", default=",".join(SHAPES), help="any of: " + ", ".join(SHAPES))
    ap.add_argument("--conv", type=json.loads, default=[], help="JSON list of conv_varlen_tiles overrides to time")
    ap.add_argument("--scan", type=json.loads, default=[], help="JSON list of scan_tiles overrides to time")
    a = ap.parse_args()
    MIXER.update(MIXERS[a.mixer])
    device = torch.device("cuda")
    bw = copy_bandwidth()
    print(f"# {torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s; mixer {json.dumps(MIXER)}")
    results = []
    for name in a.shapes.split(","):
        S, L, cached = SHAPES[name]
        t = inputs(S, L, cached, device)
        bound = moved_bytes(t, S, cached)
        runs = [("conv", v, KernelConfig(conv_varlen_tiles={**DEFAULT.conv_varlen_tiles, **v}), conv_call)
                for v in [{}, *a.conv]]
        runs += [("scan", v, KernelConfig(scan_tiles={**DEFAULT.scan_tiles, **v}), scan_call) for v in [{}, *a.scan]]
        for op, v, config, call in runs:
            fn = call(t, config)
            us = graph_time(fn) * 1e6
            per_kernel = {k.split("(")[0]: round(us_k, 1) for k, us_k in kernel_times(fn).items()}
            row = {"shape": name, "op": op, "variant": v, "us": round(us, 1),
                   "x_bound": round(us / (bound[op] / bw * 1e6), 2), "kernels_us": per_kernel}
            results.append(row)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
