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
    # Tiles of the varlen causal conv (prefill): the best of 10 on an H100 at mamba2-2.7b dims.
    conv_varlen_tiles: Mapping[str, int] = field(
        default_factory=lambda: {"BLOCK_T": 64, "BLOCK_D": 512, "num_warps": 4, "STAGES": 3})


DEFAULT = KernelConfig()  # what a launcher called with config=None runs
