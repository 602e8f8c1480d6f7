"""``NemotronHForCausalLM`` (NVIDIA Nemotron-H): one mixer per layer, Mamba ``M``, attention ``*`` (no
position embedding), relu2 MLP ``-`` or MoE ``E``, each behind its own RMSNorm with a residual add.

Parameter names are the checkpoint's (``backbone.layers.{i}.norm``, ``.mixer``); routed experts are
stored per expert in checkpoints (``mixer.experts.{e}.up_proj.weight``) and stacked at load.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from mambaserve import kernels
from mambaserve.server.model.attention import PagedAttention
from mambaserve.server.model.config import ModelLoadError
from mambaserve.server.model.feed_forward import NemotronMoE, Relu2MLP
from mambaserve.server.model.hybrid import HybridForCausalLM, Step, run_mamba
from mambaserve.server.model.hybrid_config import HybridDims
from mambaserve.server.model.mamba2 import Mamba2Mixer, RMSNorm
from mambaserve.server.model.parallel import TP
from mambaserve.server.model.weights import Stacked


class NemotronHBlock(nn.Module):
    def __init__(self, d: HybridDims, kind: str, mamba_index: int | None, attn_index: int | None, tp: TP):
        super().__init__()
        self.kind, self.eps = kind, d.eps
        self.mamba_index, self.attn_index = mamba_index, attn_index
        self.norm = RMSNorm(d.hidden_size, d.eps, residual_in_fp32=False)
        if kind == "mamba":
            self.mixer = Mamba2Mixer(d.mamba, tp)
        elif kind == "attention":
            self.mixer = PagedAttention(d.hidden_size, d.attention, tp)
        elif kind == "mlp":
            self.mixer = Relu2MLP(d.hidden_size, d.mlp.intermediate_size, d.mlp.act, d.mlp.bias, tp)
        else:
            self.mixer = NemotronMoE(d.hidden_size, d.moe, d.mlp.bias, tp)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, step: Step):
        """``(mixer output, residual)`` from the layer before's pair (``HybridForCausalLM.forward``): the residual
        add runs in this layer's norm, one launch fewer (a batch-256 step of nemotron-h-8b spent 135 us in 52 adds on
        an H200)."""
        if self.kind == "mamba":
            return run_mamba(self.norm, self.mixer, x, step, self.mamba_index, residual)
        h, residual = kernels.rmsnorm(x, residual, self.norm.weight, self.eps)
        if self.kind == "attention":
            return self.mixer(h, step.bt, step.k[self.attn_index], step.v[self.attn_index], step.rope), residual
        return self.mixer(h), residual


class NemotronHForCausalLM(HybridForCausalLM):
    PARTS = ("backbone.embeddings", "backbone.layers", "backbone.norm_f")

    def __init__(self, d: HybridDims, kernel_config: kernels.KernelConfig | None = None, tp: TP = TP()):
        super().__init__(d, kernel_config, tp)
        self.build(NemotronHBlock)

    def checkpoint_state(self, state: dict) -> dict:
        # transformers' in-memory names start with "model."; checkpoints (and save_pretrained) with "backbone."
        state = {("backbone." + k[6:] if k.startswith("model.") else k): v for k, v in state.items()}
        # multi-token prediction layers (speculative decoding) are not served
        state = {k: v for k, v in state.items() if not k.startswith(("mtp.", "backbone.mtp."))}
        experts: dict[tuple[str, str], dict] = {}
        for k in list(state):
            m = re.fullmatch(r"(.*\.experts)\.(\d+)\.(up_proj|down_proj)\.weight", k)
            if m:
                experts.setdefault((m[1], m[3]), {})[int(m[2])] = state.pop(k)
        n = self.dims.moe.num_experts if self.dims.moe else 0
        for (prefix, proj), per in experts.items():
            lacking = [e for e in range(n) if e not in per]
            if lacking or len(per) != n:
                raise ModelLoadError(f"{prefix}: the checkpoint has experts {sorted(per)} for {proj}, the config "
                                     f"{n} (missing {lacking[:5]})")
            state[f"{prefix}.{proj}"] = Stacked([per[e] for e in range(n)])  # read per rank, sliced per expert
        return state
