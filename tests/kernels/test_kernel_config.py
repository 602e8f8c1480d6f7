"""KernelConfig: the launch variants reach the kernels through ``config=`` (and one call's ``tiles=`` over it);
every variant computes what the default computes."""

import dataclasses
import importlib

import pytest
import torch

from mambaserve.kernels import KernelConfig
from mambaserve.kernels.config import DEFAULT
from mambaserve.kernels.gated_rmsnorm import gated_rmsnorm
from mambaserve.kernels.norm_linear import ConvStep, _tiles, rmsnorm_linear, rmsnorm_linear_ref
from mambaserve.kernels.selective_state_update import selective_state_update, selective_state_update_ref
from mambaserve.kernels.ssd_scan import ssd_scan_varlen, ssd_scan_varlen_ref
from tests.kernels.helpers import TOL, assert_close, gen, randn


def test_frozen_and_no_module_knobs_left():
    assert KernelConfig() == DEFAULT
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULT.early_state = False
    knobs = {"norm_linear": ("FUSED", "FUSE_CONV", "EARLY_CONV", "TILES"),
             "selective_state_update": ("EARLY_STATE", "SMALL_BATCH_TILES"), "gated_rmsnorm": ("PDL",),
             "conv1d": ("VARLEN_TILES",)}
    for module, names in knobs.items():  # the switches benchmarks once set from outside: config fields now
        mod = importlib.import_module(f"mambaserve.kernels.{module}")
        assert not [n for n in names if hasattr(mod, n)], module


def test_linear_tiles_default_then_config_then_call():
    """The defaults the engine runs at mamba2-2.7b's row lengths, and the order the overrides apply in."""
    assert _tiles(2560) == {"BLOCK_N": 8, "BLOCK_K": 512, "num_warps": 2, "STAGES": 4, "PREFETCH_COLS": 1024,
                            "ACC_2D": True}
    assert _tiles(5120) == {"BLOCK_N": 4, "BLOCK_K": 1024, "num_warps": 2, "STAGES": 4, "PREFETCH_COLS": 2048,
                            "ACC_2D": True}
    cfg = KernelConfig(linear_tiles={2560: {"BLOCK_N": 16, "STAGES": 1}})
    assert _tiles(2560, cfg) == {**_tiles(2560), "BLOCK_N": 16, "STAGES": 1}
    assert _tiles(2560, cfg, {"BLOCK_N": 4}) == {**_tiles(2560), "BLOCK_N": 4, "STAGES": 1}
    assert _tiles(5120, cfg) == _tiles(5120)  # other row lengths keep theirs


def test_conv_step_unfused_and_late_reads_match(dev):
    """``fuse_conv=False`` runs the conv step as its own kernel after the projection; ``early_conv`` only
    moves reads (and only under PDL): both give the reference's projection, conv output and state."""
    K, N, col0, D, width = 64, 29, 5, 17, 4
    g = gen(1)
    x, w, nw = randn(g, 1, K, dev=dev), randn(g, N, K, dev=dev, scale=K ** -0.5), randn(g, K, dev=dev)
    residual, cw, cb = randn(g, 1, K, dev=dev), randn(g, D, width, dev=dev), randn(g, D, dev=dev)
    state = randn(g, 3, D, width - 1, dev=dev)
    slots = torch.tensor([1], device=dev)
    ref_state = state.clone()
    y_ref, res_ref = rmsnorm_linear_ref(x, residual, nw, 1e-5, True, w, None, ConvStep(cw, cb, ref_state, slots, col0))
    for cfg in (KernelConfig(fuse_conv=False), KernelConfig(early_conv=False)):
        s = state.clone()
        y, res = rmsnorm_linear(x, residual, nw, 1e-5, True, w, None, ConvStep(cw, cb, s, slots, col0),
                                force_triton=True, config=cfg)
        assert_close(y, y_ref, TOL[torch.float32])
        assert_close(s, ref_state, TOL[torch.float32])
        assert torch.equal(res, res_ref)


def test_state_update_variants_compute_the_default(dev):
    """Other small-batch tiles and the state read after the PDL wait: the same numbers, bit for bit."""
    H, P, N, rows = 8, 16, 6, 3  # 24 rows x heads: the small-batch tiles
    g = gen(2)
    x, dt, A = randn(g, rows, H, P, dev=dev), randn(g, rows, H, dev=dev), (-torch.rand(H, generator=g) - 0.1).to(dev)
    B, C, D = randn(g, rows, 1, N, dev=dev), randn(g, rows, 1, N, dev=dev), randn(g, H, dev=dev)
    pool = randn(g, 5, H, P, N, dev=dev)
    idx = torch.tensor([4, -1, 0], device=dev)
    ref_pool = pool.clone()
    y_ref = selective_state_update_ref(ref_pool, x, dt, A, B, C, D, state_indices=idx)
    outs = []
    for cfg in (None, KernelConfig(state_update_small_tiles=(2, 1), early_state=False)):
        p = pool.clone()
        outs.append((selective_state_update(p, x, dt, A, B, C, D, state_indices=idx, force_triton=True, config=cfg), p))
    (y0, p0), (y1, p1) = outs
    assert torch.equal(y0, y1) and torch.equal(p0, p1)
    assert_close(y1, y_ref, TOL[torch.float32])
    assert_close(p1, ref_pool, TOL[torch.float32])


def test_gated_norm_without_pdl_computes_the_default(dev):
    g = gen(3)
    x, z, w = randn(g, 3, 32, dev=dev), randn(g, 3, 32, dev=dev), randn(g, 32, dev=dev)
    assert torch.equal(gated_rmsnorm(x, z, w, 1e-5, 16, force_triton=True),
                       gated_rmsnorm(x, z, w, 1e-5, 16, force_triton=True, config=KernelConfig(gated_norm_pdl=False)))


def test_scan_tiles_from_config_under_the_call_tiles(dev):
    """``config.scan_tiles`` reaches the launcher (an invalid chunk there fails), and one call's ``tiles`` go
    over it (a valid chunk there runs, and matches the reference)."""
    Q, H, P, G, N, L = 32, 2, 4, 1, 16, 40
    g = gen(4)
    x, dt, A = randn(g, L, H, P, dev=dev), randn(g, L, H, dev=dev), (-torch.rand(H, generator=g) - 0.1).to(dev)
    B, C = randn(g, L, G, N, dev=dev), randn(g, L, G, N, dev=dev)
    kw = dict(chunk_size=Q, cu_seqlens=torch.tensor([0, L], dtype=torch.int32, device=dev),
              state_indices=torch.tensor([1], device=dev), has_initial_state=torch.tensor([False], device=dev))
    bad = KernelConfig(scan_tiles={"chunk": 12})
    with pytest.raises(ValueError, match="power of two"):
        ssd_scan_varlen(x, dt, A, B, C, ssm_state=torch.zeros(2, H, P, N, device=dev), force_triton=True,
                        config=bad, **kw)
    pool, ref_pool = torch.zeros(2, H, P, N, device=dev), torch.zeros(2, H, P, N, device=dev)
    y, _ = ssd_scan_varlen(x, dt, A, B, C, ssm_state=pool, force_triton=True, config=bad,
                           tiles={"chunk": 16, "block_m": 16, "block_k": 16, "state_block_k": 16}, **kw)
    y_ref, _ = ssd_scan_varlen_ref(x, dt, A, B, C, ssm_state=ref_pool, **kw)
    assert_close(y, y_ref, 1e-5)
    assert_close(pool, ref_pool, 1e-5)
