"""Mamba2 and hybrid-model kernels. Each op module holds the Triton kernel, its launcher and a pure-torch reference
with the same signature (``<op>_ref``). Launchers pick Triton on CUDA and the reference on CPU.
"""

from mambaserve.kernels.config import KernelConfig
from mambaserve.kernels.conv1d import causal_conv1d_update, causal_conv1d_varlen, conv_varlen_runs_triton
from mambaserve.kernels.gated_rmsnorm import gated_rmsnorm
from mambaserve.kernels.moe import moe_align, moe_experts, moe_runs_triton
from mambaserve.kernels.norm_linear import ConvStep, gated_rmsnorm_linear, rmsnorm_linear
from mambaserve.kernels.paged_attention import paged_decode_attention, paged_prefill_attention, write_kv
from mambaserve.kernels.rmsnorm import rmsnorm
from mambaserve.kernels.selective_state_update import decode_runs_triton, selective_state_update
from mambaserve.kernels.split_gated_norm import split_gated_norm, split_gated_norm_finish
from mambaserve.kernels.ssd_scan import BoundaryStates, scan_runs_triton, ssd_scan_varlen
from mambaserve.kernels.state_ops import clear_slots, copy_slots, scatter_steps
from mambaserve.kernels.topk_softmax import topk_softmax

__all__ = [
    "BoundaryStates",
    "ConvStep",
    "KernelConfig",
    "causal_conv1d_update",
    "causal_conv1d_varlen",
    "clear_slots",
    "conv_varlen_runs_triton",
    "copy_slots",
    "decode_runs_triton",
    "gated_rmsnorm",
    "gated_rmsnorm_linear",
    "moe_align",
    "moe_experts",
    "moe_runs_triton",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rmsnorm",
    "rmsnorm_linear",
    "scan_runs_triton",
    "scatter_steps",
    "selective_state_update",
    "split_gated_norm",
    "split_gated_norm_finish",
    "ssd_scan_varlen",
    "topk_softmax",
    "write_kv",
]
