"""Launch variants of the kernels, chosen explicitly by the caller (``config=``).

Every field's default is what the engine runs; the other values exist for A/B measurements
(``benchmarks/decode_step.py --unfused`` and ``--variants``, ``benchmarks/prefill_ab.py``) and for tests.
The model holds one ``KernelConfig`` and passes it to every kernel call, so a variant is captured into the
decode CUDA graphs like the default; no launcher reads a setting from a module global. (A few launchers
also take ``tiles=``, one call's tile overrides over the config's, for tile sweeps.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping


@dataclass(frozen=True)
class KernelConfig:
    # Batch-1 decode: each norm fused with the projection after it (one launch); False runs the norm
    # kernel and cuBLAS (the unfused path every larger batch takes).
    fuse_norm_linear: bool = True
    # in_proj's launch also runs the conv decode step over its xBC columns; False: a separate conv kernel.
    fuse_conv: bool = True
    # Under programmatic dependent launch, in_proj's conv step reads its window, and the state update its
    # slot's state, before waiting for the previous kernel (safe: no kernel that can still be running
    # writes that layer's state pools; selective_state_update's docstring has the argument).
    early_conv: bool = True
    early_state: bool = True
    # The gated RMSNorm launches under PDL (at batch > 1 it follows the state update).
    gated_norm_pdl: bool = True
    # Tile overrides of the fused norm + projection, by row length K: {K: {"BLOCK_N": 8, ...}}
    # (norm_linear._tiles has the defaults).
    linear_tiles: Mapping[int, Mapping[str, object]] = field(default_factory=dict)
    # (BLOCK_P, num_warps) of the state update under 256 rows x heads (batch 1).
    state_update_small_tiles: tuple[int, int] = (4, 1)
    # Overrides of the chunked scan's tiles (keys of ssd_scan.SCAN_CONFIG, which has the defaults).
    scan_tiles: Mapping[str, object] = field(default_factory=dict)
    # Tiles of the varlen causal conv (prefill). A program walks its BLOCK_T tokens one after another: short blocks
    # (H200, benchmarks/mixer_prefill.py, granite's, nemotron-h-8b's and mamba2-2.7b's widths): 16 against 64 took
    # 0.46-0.60x the time for a hit's 8 x 64 new tokens, 0.63-0.85x for 1 x 2,048 and 0.91-0.99x for 8 x 2,048,
    # within 6% of the best of 8 / 16 / 32 but on the hit (8 took 6-17% less there).
    conv_varlen_tiles: Mapping[str, int] = field(
        default_factory=lambda: {"BLOCK_T": 16, "BLOCK_D": 512, "num_warps": 4, "STAGES": 3})
    # Granite's decode steps of up to 64 rows run the shared MLP inside the MoE op, as more experts
    # (feed_forward.GraniteMoE.fold); False: its own cuBLAS GEMMs, as prefill does.
    fold_shared_mlp: bool = True
    # There, the layer's residual-add norm, the router's projection and its top-k softmax run as one launch
    # (kernels.topk_softmax.rmsnorm_topk_softmax); False: three (rmsnorm, cuBLAS, topk_softmax).
    fuse_router: bool = True


DEFAULT = KernelConfig()  # what a launcher called with config=None runs
