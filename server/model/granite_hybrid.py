"""``GraniteMoeHybridForCausalLM`` (IBM Granite 4.0-H, dense and MoE): each layer is Mamba or attention,
then a SwiGLU shared MLP plus, in MoE variants, softmax-routed experts; every sublayer's output is
scaled by ``residual_multiplier`` before its residual add, embeddings by ``embedding_multiplier``,
logits divided by ``logits_scaling``; attention scores use ``attention_multiplier`` as their scale and
RoPE only where ``position_embedding_type`` is ``rope`` (Granite 4.0-H ships without: "nope").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mambaserve import kernels
from mambaserve.server.model.attention import PagedAttention
from mambaserve.server.model.feed_forward import FusedSwiGLU, GraniteMoE
from mambaserve.server.model.hybrid import HybridForCausalLM, Step, norm, run_mamba
from mambaserve.server.model.hybrid_config import HybridDims
from mambaserve.server.model.inputs import ForwardMode
from mambaserve.server.model.mamba2 import Mamba2Mixer, RMSNorm
from mambaserve.server.model.parallel import TP


class GraniteHybridLayer(nn.Module):
    def __init__(self, d: HybridDims, kind: str, mamba_index: int | None, attn_index: int | None, tp: TP):
        super().__init__()
        self.kind, self.eps, self.mult = kind, d.eps, d.residual_multiplier
        self.mamba_index, self.attn_index = mamba_index, attn_index
        self.input_layernorm = RMSNorm(d.hidden_size, d.eps, residual_in_fp32=False)
        self.post_attention_layernorm = RMSNorm(d.hidden_size, d.eps, residual_in_fp32=False)
        if kind == "mamba":
            self.mamba = Mamba2Mixer(d.mamba, tp)
        else:
            self.self_attn = PagedAttention(d.hidden_size, d.attention, tp)
        self.shared_mlp = FusedSwiGLU(d.hidden_size, d.mlp, tp)
        if d.moe is not None:
            self.block_sparse_moe = GraniteMoE(d.hidden_size, d.moe, tp)

    def forward(self, x: torch.Tensor, residual: None, step: Step) -> tuple[torch.Tensor, None]:
        """``(hidden, None)``: the layer ends in its residual add (the MoE op's epilogue), so it takes none."""
        return self._forward(x, step), None

    def _forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        if self.kind == "mamba":
            h, _ = run_mamba(self.input_layernorm, self.mamba, x, step, self.mamba_index)
        else:
            h = self.self_attn(norm(x, self.input_layernorm.weight, self.eps), step.bt, step.k[self.attn_index],
                               step.v[self.attn_index], step.rope)
        # x + h * mult and its norm in one launch, the MoE's weighted sum with the shared MLP's output and the
        # scaled residual in another: granite-4.0-h-tiny's decode step was ~12 launches a layer (480 a step on an H200)
        # before the shared MLP was folded into the MoE op at decode (three fewer), and the norm, the router and its
        # top-k run as one launch there (two fewer)
        moe = getattr(self, "block_sparse_moe", None)
        if moe is not None and step.bt.mode is ForwardMode.DECODE and moe.folds(h):  # (not prefill: the same path
            return moe.forward_folded(h, x, self.post_attention_layernorm.weight, self.eps, self.mult)  # cold and hit)
        h, x = kernels.rmsnorm(h, x, self.post_attention_layernorm.weight, self.eps, scale=self.mult)
        if moe is not None:  # one sum over the ranks for both (tensor parallel)
            E = moe.m.num_experts
            both = F.linear(h, self.router_and_shared)
            return moe(h, add=self.shared_mlp.finish(both[:, E:], partial=True), residual=x, scale=self.mult,
                       logits=both[:, :E])
        return x + self.shared_mlp(h) * self.mult

    def refresh_derived(self) -> None:
        """MoE layers: the router and the shared MLP's gate/up projection read the same normed rows, so their
        weights live in one tensor (the two parameters are views of it) and run as one GEMM: a launch fewer a
        layer (at batch 1 the router's own GEMM took 4.4 us on an H200 for its 0.2 MB)."""
        if not hasattr(self, "block_sparse_moe"):
            return
        router, shared = self.block_sparse_moe.router.layer.weight, self.shared_mlp.input_linear.weight
        fused = torch.cat([router.detach(), shared.detach()])
        router.data, shared.data = fused[:router.shape[0]], fused[router.shape[0]:]
        self.register_buffer("router_and_shared", fused, persistent=False)
        self.block_sparse_moe.fold(self.shared_mlp)


class GraniteMoeHybridForCausalLM(HybridForCausalLM):
    PARTS = ("model.embed_tokens", "model.layers", "model.norm")

    def __init__(self, d: HybridDims, kernel_config: kernels.KernelConfig | None = None, tp: TP = TP()):
        super().__init__(d, kernel_config, tp)
        self.build(GraniteHybridLayer)

