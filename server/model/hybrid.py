"""What every hybrid family shares: the forward over a packed batch, the step's context, weight loading.

A family module (``nemotron_h.py``, ``granite_hybrid.py``, ``bamba.py``) builds its layers with Hugging
Face's parameter names and says where its embedding, final norm and layers are; this base runs them.
Mamba layers reuse ``mamba2.Mamba2Mixer`` (the same kernels as pure Mamba2: varlen chunked scan for
prefill, the fused decode path) on the state pool's tensors, indexed by Mamba layer (0..Lm-1), not by
layer; attention layers read and write the paged KV cache, indexed by attention layer (0..La-1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mambaserve import kernels
from mambaserve.server.model.attention import local_attention, rope_cos_sin
from mambaserve.server.model.hybrid_config import AttentionDims, HybridDims
from mambaserve.server.model.inputs import BatchTensors, ForwardMode
from mambaserve.server.model.mamba2 import REFERENCE_DECODE, Mamba2Mixer, RMSNorm
from mambaserve.server.model.parallel import SINGLE, TP, Slices, embed, mamba_shard, vocab_part
from mambaserve.server.model.weights import copy_into_parameters


@dataclass
class Step:
    """One forward's context for the layers: the batch, the state pool's tensors, the KV cache's and
    this step's RoPE table; layers append tracked states (one entry per Mamba layer)."""

    bt: BatchTensors
    conv: torch.Tensor  # [Lm, slots, conv_dim, K-1]
    ssm: torch.Tensor  # [Lm, slots, H, P, N]
    k: torch.Tensor | None  # [La, pages, page_size, Hkv, D]
    v: torch.Tensor | None
    rope: tuple[torch.Tensor, torch.Tensor] | None
    tracked: list


def norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return kernels.rmsnorm(x, None, weight, eps)[0]


def run_mamba(pre_norm: RMSNorm, mixer: Mamba2Mixer, x: torch.Tensor, step: Step, index: int,
              residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mixer(pre_norm(residual + x)), residual + x)`` on Mamba layer ``index``'s states: the residual add and the
    pre-norm run fused with in_proj (and, at decode, the conv step), as in pure Mamba2."""
    bt, conv, ssm = step.bt, step.conv[index], step.ssm[index]
    if bt.mode is ForwardMode.DECODE:
        out, residual = mixer.decode(pre_norm, x, residual, bt, conv, ssm)
        step.tracked.append(None)
        return out, residual
    zxbcdt, residual = pre_norm.then_linear(x, residual, mixer.in_proj.weight, mixer.in_proj.bias)
    out, tracked = mixer(zxbcdt, bt, conv, ssm)
    step.tracked.append(tracked)
    return out, residual


def layer_indices(mixers: tuple[str, ...], kind: str) -> list[int | None]:
    """Per layer: its index among the layers of ``kind`` (its row in that kind's pool), else None."""
    out, n = [], 0
    for m in mixers:
        out.append(n if m == kind else None)
        n += m == kind
    return out


class HybridForCausalLM(nn.Module):
    """Subclasses build their modules under Hugging Face's names, set ``lm_head`` and ``PARTS`` (where the
    embedding, the layer list and the final norm are) and, where checkpoints differ from the modules,
    ``checkpoint_state``."""

    PARTS: tuple[str, str, str]

    def __init__(self, d: HybridDims, kernel_config: kernels.KernelConfig | None = None, tp: TP = SINGLE):
        super().__init__()
        self.dims, self.tp = d, tp
        # the state pool's shape (num_layers: Mamba layers only), this rank's heads
        self.state_dims = mamba_shard(d.mamba, tp).local if d.mamba else None
        self.vocab_rows = vocab_part(d.vocab_size, tp)  # the embedding's and LM head's rows on this rank
        self.kernel_config = kernel_config or kernels.KernelConfig()

    @property
    def embed(self) -> nn.Embedding:
        return self.get_submodule(self.PARTS[0])

    @property
    def layers(self) -> nn.ModuleList:
        return self.get_submodule(self.PARTS[1])

    @property
    def final_norm(self) -> nn.Module:
        return self.get_submodule(self.PARTS[2])

    def checkpoint_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors under this model's parameter names."""
        return state

    def mixers(self) -> list[Mamba2Mixer]:
        return [m for m in self.modules() if isinstance(m, Mamba2Mixer)]

    def use_kernel_config(self, config: kernels.KernelConfig) -> None:
        self.kernel_config = config
        for m in self.modules():
            if hasattr(m, "kernel_config"):
                m.kernel_config = config

    @property
    def attention_dims(self) -> AttentionDims | None:
        """The attention layers' dims on this rank (its query and KV heads): the KV pool's shape."""
        return local_attention(self.dims.attention, self.tp) if self.dims.attention else None

    def build(self, layer) -> None:
        """The embedding, ``layer(dims, kind, mamba_index, attention_index, tp)`` for each layer and the final
        norm under the names ``PARTS`` gives, then the LM head (tied if the config says so)."""
        d = self.dims
        setattr(self, self.PARTS[0].split(".")[0], nn.Module())
        mi, ai = layer_indices(d.mixers, "mamba"), layer_indices(d.mixers, "attention")
        final_norm = nn.Module()
        final_norm.weight = nn.Parameter(torch.ones(d.hidden_size))
        parts = (nn.Embedding(len(self.vocab_rows), d.hidden_size),
                 nn.ModuleList(layer(d, k, mi[i], ai[i], self.tp) for i, k in enumerate(d.mixers)), final_norm)
        for path, module in zip(self.PARTS, parts):
            parent, name = path.rsplit(".", 1)
            setattr(self.get_submodule(parent), name, module)
        self.lm_head = nn.Linear(d.hidden_size, len(self.vocab_rows), bias=False)
        if self.tp.size > 1:
            self.embed.tp_slices = self.lm_head.tp_slices = {"weight": Slices.of(0, self.vocab_rows)}
        self.tie_weights()
        self.use_kernel_config(self.kernel_config)

    def tie_weights(self) -> None:
        if self.dims.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight

    def capture_blocker(self, mode: ForwardMode) -> str | None:
        """Why a forward of ``mode`` cannot be captured in a CUDA graph, or None. Decode and prefill can, given their
        KV view in static buffers (``engine/decode_buffers.py``, ``cuda_graphs.PrefillGraphs``), where their kernels
        run Triton (not their references, which synchronise with the host), MoE layers included where their experts
        run the Triton kernel; not where they run the torch expert loop (``MAMBASERVE_KERNELS=ref``, no Triton),
        which copies each expert's row count to the host."""
        w, s = self.embed.weight, self.state_dims
        if mode is ForwardMode.EXTEND and not (kernels.scan_runs_triton(s.chunk_size, w)
                                               and kernels.conv_varlen_runs_triton(s.conv_kernel, w)):
            return (f"this model's prefill runs reference kernels (chunk size {s.chunk_size}, conv width "
                    f"{s.conv_kernel}), which synchronise with the host")
        if mode is ForwardMode.DECODE and not kernels.decode_runs_triton(w):
            return REFERENCE_DECODE
        if self.dims.moe is not None and not kernels.moe_runs_triton(self.embed.weight):
            return ("the model's MoE layers run the torch expert loop (no Triton, or MAMBASERVE_KERNELS=ref), which "
                    "copies each expert's row count to the host every step (kernels.moe.moe_experts_ref)")
        return None

    def warm_up_kernels(self, max_tokens: int) -> int:
        """Compile the MoE experts' kernel variants for steps of up to ``max_tokens`` tokens
        (``kernels.moe.moe_warm_up``) on the first MoE layer: every MoE layer of a model has the same shapes.
        Returns the runs (0: no MoE, or the torch loop runs)."""
        layer = next((m for m in self.modules() if hasattr(m, "warm_up_experts")), None)
        return layer.warm_up_experts(max_tokens) if layer is not None else 0

    def refresh_derived(self) -> None:
        """What the forward computes from the weights once they are in place (after a load)."""
        for m in self.mixers():
            m.refresh_A()
        for layer in self.layers:
            if hasattr(layer, "refresh_derived"):
                layer.refresh_derived()

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        state = self.checkpoint_state(dict(state))
        tied = self.dims.tie_word_embeddings
        if tied:
            state.pop("lm_head.weight", None)
        copy_into_parameters(self, state, rank=self.tp.rank)  # a tied lm_head is listed once, under the embedding's
        self.refresh_derived()

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, bt: BatchTensors, conv: torch.Tensor, ssm: torch.Tensor,
                logit_rows: torch.Tensor | None, kv: tuple[torch.Tensor, torch.Tensor] | None = None):
        """As ``Mamba2ForCausalLM.forward``, plus ``kv``: the KV pool's ``(k, v)`` ``[La, pages, page_size, Hkv,
        D]``, written at ``bt.slot_mapping``. Returns the logits (in the model's dtype; the sampler upcasts
        where it needs fp32) and the tracked states per Mamba layer. Each layer takes and returns a ``(hidden,
        residual)`` pair whose sum is the stream (residual None: the hidden is it), so that the add can run in the
        next norm."""
        d = self.dims
        x = embed(input_ids, self.embed.weight, self.vocab_rows, self.tp)
        if d.embedding_multiplier != 1.0:
            x = x * d.embedding_multiplier
        a = d.attention
        rope = None
        if a is not None and a.rope_theta is not None:
            rope = rope_cos_sin(bt.positions, a.rotary_dim, a.rope_theta, x.dtype)
        step = Step(bt, conv, ssm, kv[0] if kv else None, kv[1] if kv else None, rope, [])
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, step)
        if logit_rows is not None:
            x, residual = x[logit_rows], (residual[logit_rows] if residual is not None else None)
        x = kernels.rmsnorm(x, residual, self.final_norm.weight, d.eps)[0]
        logits = self.tp.gather_vocab(self.lm_head(x))[:, :d.vocab_size]
        if d.logits_scaling != 1.0:
            logits = logits / d.logits_scaling
        return logits, step.tracked
