"""``BambaForCausalLM`` (IBM Bamba): Mamba layers with attention at ``attn_layer_indices`` (RoPE on the
first half of each head), every mixer followed by a SwiGLU feed-forward; pre-norm residual blocks."""

from __future__ import annotations

import torch
from torch import nn

from mambaserve import kernels
from mambaserve.server.model.attention import PagedAttention
from mambaserve.server.model.feed_forward import SwiGLU
from mambaserve.server.model.hybrid import HybridForCausalLM, Step, run_mamba
from mambaserve.server.model.hybrid_config import HybridDims
from mambaserve.server.model.mamba2 import Mamba2Mixer, RMSNorm
from mambaserve.server.model.parallel import TP


class BambaLayer(nn.Module):
    def __init__(self, d: HybridDims, kind: str, mamba_index: int | None, attn_index: int | None, tp: TP):
        super().__init__()
        self.kind, self.eps = kind, d.eps
        self.mamba_index, self.attn_index = mamba_index, attn_index
        self.input_layernorm = RMSNorm(d.hidden_size, d.eps, residual_in_fp32=False)
        self.pre_ff_layernorm = RMSNorm(d.hidden_size, d.eps, residual_in_fp32=False)
        if kind == "mamba":
            self.mamba = Mamba2Mixer(d.mamba, tp)
        else:
            self.self_attn = PagedAttention(d.hidden_size, d.attention, tp)
        self.feed_forward = SwiGLU(d.hidden_size, d.mlp, tp)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, step: Step):
        """``(MLP output, residual)`` from the layer before's pair: both residual adds run in the norms after them
        (as Nemotron-H's, design §11)."""
        if self.kind == "mamba":
            h, residual = run_mamba(self.input_layernorm, self.mamba, x, step, self.mamba_index, residual)
        else:
            h, residual = kernels.rmsnorm(x, residual, self.input_layernorm.weight, self.eps)
            h = self.self_attn(h, step.bt, step.k[self.attn_index], step.v[self.attn_index], step.rope)
        h, residual = kernels.rmsnorm(h, residual, self.pre_ff_layernorm.weight, self.eps)
        return self.feed_forward(h), residual


class BambaForCausalLM(HybridForCausalLM):
    PARTS = ("model.embed_tokens", "model.layers", "model.final_layernorm")

    def __init__(self, d: HybridDims, kernel_config: kernels.KernelConfig | None = None, tp: TP = TP()):
        super().__init__(d, kernel_config, tp)
        self.build(BambaLayer)
