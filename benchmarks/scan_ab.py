"""A/B of chunked-scan variants in one process (CUDA): per-kernel device time, differences, mamba_ssm.

    python benchmarks/scan_ab.py --configs '{"default": {}, "pointers": {"tma": false}}' \
        [--baseline old_ssd_scan.py] [--shapes '[[8, 2048], [1, 16384]]'] [--boundary] [--third-party third_party]
    python benchmarks/scan_ab.py --configs '{"default": {}, "snapshots": {"snap": true}}'  # the cost of snap_slots

Each named config (tile overrides over kernels/ssd_scan.py's SCAN_CONFIG, passed as `tiles=`) runs on
`kernels.py`'s 2.7b inputs with initial states; names starting with "baseline" run the file given by
--baseline instead (a previous version of ssd_scan.py, e.g. from `git show REV:kernels/ssd_scan.py`; where
that version imports its jitted kernels from ssd_scan_kernels.py, that file's version goes beside it as
`<baseline stem>_kernels.py`, e.g. old_ssd_scan.py and old_ssd_scan_kernels.py). A config with "snap": true
also writes every sequence's state before its last token into a spare slot (``snap_slots``, as the
engine's prefills do). Printed per config and
shape: the summed device time of each kernel over 10 calls (torch profiler), the relative difference of y
and the final state to the first config's, the relative error of both against the fp32 torch reference,
and the ratio of `mamba_chunk_scan_combined`'s summed device time (same inputs, same process) to ours.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kernels as kb  # noqa: E402  (this folder's kernels.py: inputs, helpers, the third-party loader)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default='{"default": {}}')
    ap.add_argument("--shapes", default="[[8, 2048], [1, 16384]]")
    ap.add_argument("--baseline", help="a previous ssd_scan.py, run for configs named baseline*")
    ap.add_argument("--boundary", action="store_true", help="also return the boundary states")
    ap.add_argument("--third-party", default="third_party")
    a = ap.parse_args()
    configs = json.loads(a.configs)
    baseline = kb.scan_launcher(kb.load_file(a.baseline)) if a.baseline else None
    ext = kb.load_third_party(a.third_party)
    H, P, N, G, _ = kb.MODELS["mamba2-2.7b"]
    for nseq, L in json.loads(a.shapes):
        x, dt, A, B, C, D, bias, pool, kw = kb.scan_inputs(nseq, L, spare_slots=nseq)
        kw.update(has_initial_state=torch.ones(nseq, dtype=torch.bool, device="cuda"),
                  return_boundary_states=a.boundary)
        init = pool.normal_().clone()
        ref_pool = init.clone()
        y_ref, _ = kb.ssd_scan.ssd_scan_varlen_ref(x, dt, A, B, C, **dict(kw, ssm_state=ref_pool))
        first, totals = None, {}
        for name, cfg in configs.items():
            launch = baseline if name.startswith("baseline") else kb.ssd_scan.ssd_scan_varlen
            tiles = {k: v for k, v in cfg.items() if k != "snap"}
            extra = {"snap_slots": kw["state_indices"] + nseq} if cfg.get("snap") else {}
            run = lambda: launch(x, dt, A, B, C, tiles=tiles, **kw, **extra)  # noqa: E731
            pool.copy_(init)
            y, _ = run()
            out = (y.clone(), pool[:nseq + 1].clone())  # the spare slots hold snapshots, if any
            first = first or out
            diff = [kb.rel(o, f) for o, f in zip(out, first)]
            err = [kb.rel(y, y_ref), kb.rel(out[1], ref_pool[:nseq + 1])]
            totals[name], per = kb.device_time(run, key_len=28)
            print(f"{nseq}x{L} {name}: {totals[name]:.1f} us, diff to first (y, state) {diff[0]:.1e} {diff[1]:.1e}, "
                  f"error to reference {err[0]:.1e} {err[1]:.1e}, finite {bool(torch.isfinite(y).all())}: "
                  f"{json.dumps(per)}", flush=True)
        if "scan" in ext:
            xb, dtb = x.view(nseq, L, H, P), dt.view(nseq, L, H)
            Bb, Cb = B.view(nseq, L, G, N), C.view(nseq, L, G, N)
            ini = init[kw["state_indices"]]
            theirs = lambda: ext["scan"](xb, dtb, A, Bb, Cb, 256, D=D, dt_bias=bias, dt_softplus=True,  # noqa: E731
                                         initial_states=ini, return_final_states=True)
            t_ext, per = kb.device_time(theirs, key_len=28)
            print(f"{nseq}x{L} mamba_ssm: {t_ext:.1f} us: {json.dumps(per)}", flush=True)
            print(f"{nseq}x{L} x mamba_ssm (device time):", {k: round(t_ext / v, 3) for k, v in totals.items()},
                  flush=True)
        del pool


if __name__ == "__main__":
    main()
