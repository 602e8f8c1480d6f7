"""Mamba2 language model over a packed batch, with its recurrent state in a slot pool.

Parameter names follow Hugging Face's ``Mamba2ForCausalLM`` so checkpoints load as they are. All
math goes through ``mambaserve.kernels`` (Triton on CUDA, pure-torch references on CPU).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from mambaserve import kernels
from mambaserve.server.model.config import Mamba2Dims
from mambaserve.server.model.inputs import BatchTensors, ForwardMode
from mambaserve.server.model.parallel import SINGLE, TP, Slices, embed, mamba_shard, mamba_slices, vocab_part
from mambaserve.server.model.weights import copy_into_parameters


class RMSNorm(nn.Module):
    """Residual add + RMSNorm (Hugging Face's rounding); it runs fused with the projection after it
    (``kernels.rmsnorm_linear``)."""

    def __init__(self, dim: int, eps: float, residual_in_fp32: bool):
        super().__init__()
        self.kernel_config = kernels.KernelConfig()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.residual_in_fp32 = eps, residual_in_fp32

    def then_linear(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                    bias: torch.Tensor | None, conv: kernels.ConvStep | None = None):
        """``(linear(norm(residual + x)), residual + x)``; ``residual`` is None before the first block.
        ``conv``: a conv decode step over some of the output columns, in the same launch at batch 1."""
        return kernels.rmsnorm_linear(x, residual, self.weight, self.eps, self.residual_in_fp32, weight, bias, conv,
                                      config=self.kernel_config)


class GatedNorm(nn.Module):
    def __init__(self, dim: int, group_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.group_size, self.eps = group_size, eps


class Mamba2Mixer(nn.Module):
    """A Mamba2 mixer, or a tensor-parallel rank's heads of one (``parallel.mamba_shard``): ``self.d`` are the
    dims its modules and states have (this rank's heads and groups), the kernels run on them unchanged."""

    def __init__(self, d: Mamba2Dims, tp: TP = SINGLE):
        super().__init__()
        self.tp, self.shard = tp, mamba_shard(d, tp)
        d = self.d = self.shard.local
        self.kernel_config = kernels.KernelConfig()
        self.in_proj = nn.Linear(d.hidden_size, d.d_inner + d.conv_dim + d.num_heads, bias=d.use_bias)
        self.conv1d = nn.Conv1d(d.conv_dim, d.conv_dim, d.conv_kernel, groups=d.conv_dim, bias=d.use_conv_bias)
        self.dt_bias = nn.Parameter(torch.zeros(d.num_heads))
        self.A_log = nn.Parameter(torch.zeros(d.num_heads))
        self.D = nn.Parameter(torch.ones(d.num_heads))
        # A = -exp(A_log), derived once (refresh_A) rather than by two kernels per layer per step.
        self.register_buffer("A", -torch.exp(self.A_log.detach().float()), persistent=False)
        # Normalised per group of d_inner / n_groups channels (of the full mixer), as the original Mamba2 does.
        self.norm = GatedNorm(d.d_inner, self.shard.norm_group_size, d.eps)
        self.out_proj = nn.Linear(d.d_inner, d.hidden_size, bias=d.use_bias)
        if tp.size > 1:
            self.tp_slices = mamba_slices(self.shard, d.use_bias, d.use_conv_bias)

    def forward(self, zxbcdt: torch.Tensor, bt: BatchTensors, conv_state: torch.Tensor, ssm_state: torch.Tensor):
        """Prefill (``ForwardMode.EXTEND``); ``zxbcdt``: in_proj's output (the block runs the pre-norm and
        in_proj fused). Returns the block output and the tracked states asked for in ``bt.track``."""
        d = self.d
        T = zxbcdt.shape[0]
        z, xBC, dt = zxbcdt.split([d.d_inner, d.conv_dim, d.num_heads], dim=-1)
        # xBC is a column slice of in_proj's output: the conv kernel reads it through its row stride.
        conv_windows = self._conv_windows(xBC, conv_state, bt) if bt.track else None
        xBC = kernels.causal_conv1d_varlen(xBC, self.conv1d.weight.squeeze(1), self.conv1d.bias, conv_state,
                                           bt.cu_seqlens, bt.slots, bt.has_initial_state, snap_slots=bt.snap_slots,
                                           snap_len=bt.snap_len, config=self.kernel_config)
        x, B, C = xBC.split([d.d_inner, d.n_groups * d.state_size, d.n_groups * d.state_size], dim=-1)
        y, boundary = kernels.ssd_scan_varlen(
            x.reshape(T, d.num_heads, d.head_dim), dt, self.A,
            B.reshape(T, d.n_groups, d.state_size), C.reshape(T, d.n_groups, d.state_size),
            chunk_size=d.chunk_size, cu_seqlens=bt.cu_seqlens, ssm_state=ssm_state, state_indices=bt.slots,
            has_initial_state=bt.has_initial_state, seq_start_pos=bt.start_pos, D=self.D,
            dt_bias=self.dt_bias, dt_softplus=True, dt_limit=d.dt_limit, track=bt.track or None,
            snap_slots=bt.snap_slots, snap_len=bt.snap_len, config=self.kernel_config)
        tracked = (conv_windows, boundary.states) if bt.track else None
        return self._out(y, z), tracked

    def decode(self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None, bt: BatchTensors,
               conv_state: torch.Tensor, ssm_state: torch.Tensor):
        """One token per row, the block's pre-norm included: ``(block output, new residual)``. The conv
        step runs in in_proj's launch (over its xBC columns) where norm and projection are one kernel."""
        d = self.d
        T = x.shape[0]
        conv = kernels.ConvStep(self.conv1d.weight.squeeze(1), self.conv1d.bias, conv_state, bt.slots, d.d_inner)
        zxbcdt, new_residual = norm.then_linear(x, residual, self.in_proj.weight, self.in_proj.bias, conv)
        z, xBC, dt = zxbcdt.split([d.d_inner, d.conv_dim, d.num_heads], dim=-1)
        xs, B, C = xBC.split([d.d_inner, d.n_groups * d.state_size, d.n_groups * d.state_size], dim=-1)
        y = kernels.selective_state_update(
            ssm_state, xs.reshape(T, d.num_heads, d.head_dim), dt, self.A,
            B.reshape(T, d.n_groups, d.state_size), C.reshape(T, d.n_groups, d.state_size),
            D=self.D, dt_bias=self.dt_bias, dt_softplus=True, dt_limit=d.dt_limit, state_indices=bt.slots,
            config=self.kernel_config)
        return self._out(y, z), new_residual

    def _out(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """out_proj(gated_norm(y, z)), summed over the ranks (row-parallel: each holds its channels' columns)."""
        y = y.reshape(y.shape[0], self.d.d_inner)
        if self.shard.norm_spans:
            return self._out_spanning(y, z)
        return self.tp.all_reduce(kernels.gated_rmsnorm_linear(
            y, z, self.norm.weight, self.norm.eps, self.norm.group_size, self.out_proj.weight, self.out_proj.bias,
            config=self.kernel_config))

    def _out_spanning(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The gated norm's one group spans the ranks: each projects its gated, weighted channels unscaled and
        sends its share of the mean square in the same all-reduce; the scale applies after the sum
        (``kernels.split_gated_norm``: one collective per layer, as without the norm)."""
        T, hidden = y.shape[0], self.out_proj.weight.shape[0]
        buf = torch.empty(T * hidden + 2 * T, dtype=y.dtype, device=y.device)
        projection, sums = buf[:T * hidden].view(T, hidden), buf[T * hidden:].view(T, 2)
        hw = kernels.split_gated_norm(y, z, self.norm.weight, self.norm.eps, self.norm.group_size, self.tp.size, sums)
        torch.mm(hw, self.out_proj.weight.t(), out=projection)
        self.tp.all_reduce(buf)
        return kernels.split_gated_norm_finish(projection, sums, self.out_proj.bias)

    @torch.no_grad()
    def refresh_A(self) -> None:
        A = -torch.exp(self.A_log.float())
        if self.A.dtype == A.dtype and self.A.device == A.device:
            self.A.copy_(A)  # in place: captured CUDA graphs read this buffer's memory
        else:  # Module.to(dtype) converted the buffer
            self.A = A

    def _conv_windows(self, xBC: torch.Tensor, conv_state: torch.Tensor, bt: BatchTensors) -> torch.Tensor:
        """Conv state (last K-1 inputs) at each tracked position, from this batch's inputs and, near a
        sequence start, the sequence's initial conv state (read before the conv kernel updates it)."""
        K1 = self.d.conv_kernel - 1
        out = []
        for i, pos in bt.track:
            s = bt.host_start[i]
            seq = xBC[bt.host_cu[i]:bt.host_cu[i + 1]].t()
            init = conv_state[bt.slots[i]] if s > 0 else seq.new_zeros(seq.shape[0], K1)
            full = torch.cat([init.to(seq.dtype), seq], dim=1)  # absolute positions s-K1 .. s+n-1
            out.append(full[:, pos - s:pos - s + K1])
        return torch.stack(out)


class Mamba2Block(nn.Module):
    def __init__(self, d: Mamba2Dims, tp: TP = SINGLE):
        super().__init__()
        self.norm = RMSNorm(d.hidden_size, d.eps, d.residual_in_fp32)
        self.mixer = Mamba2Mixer(d, tp)

    def forward(self, x, residual, bt: BatchTensors, conv_state: torch.Tensor, ssm_state: torch.Tensor):
        """(block output, new residual, tracked states); ``x`` is the previous block's output."""
        if bt.mode is ForwardMode.DECODE:
            return *self.mixer.decode(self.norm, x, residual, bt, conv_state, ssm_state), None
        zxbcdt, residual = self.norm.then_linear(x, residual, self.mixer.in_proj.weight, self.mixer.in_proj.bias)
        out, tracked = self.mixer(zxbcdt, bt, conv_state, ssm_state)
        return out, residual, tracked


class Backbone(nn.Module):
    def __init__(self, d: Mamba2Dims, tp: TP = SINGLE):
        super().__init__()
        self.vocab_rows = vocab_part(d.vocab_size, tp)  # the embedding's and LM head's rows on this rank
        self.embeddings = nn.Embedding(len(self.vocab_rows), d.hidden_size)
        if tp.size > 1:
            self.embeddings.tp_slices = {"weight": Slices.of(0, self.vocab_rows)}
        self.layers = nn.ModuleList(Mamba2Block(d, tp) for _ in range(d.num_layers))
        self.norm_f = RMSNorm(d.hidden_size, d.eps, d.residual_in_fp32)


REFERENCE_DECODE = ("decode runs the kernels' torch references (no Triton, or MAMBASERVE_KERNELS=ref), which "
                    "index rows with boolean masks: a host synchronisation every layer")


class Mamba2ForCausalLM(nn.Module):
    def __init__(self, d: Mamba2Dims, kernel_config: kernels.KernelConfig | None = None, tp: TP = SINGLE):
        super().__init__()
        self.dims, self.tp = d, tp
        self.backbone = Backbone(d, tp)
        # the state pool's shape (every layer is a Mamba2 layer): this rank's heads
        self.state_dims = dataclasses.replace(self.backbone.layers[0].mixer.d, num_layers=d.num_layers)
        self.lm_head = nn.Linear(d.hidden_size, len(self.backbone.vocab_rows), bias=False)
        if tp.size > 1:
            self.lm_head.tp_slices = {"weight": Slices.of(0, self.backbone.vocab_rows)}
        if d.tie_word_embeddings:
            self.lm_head.weight = self.backbone.embeddings.weight
        self.use_kernel_config(kernel_config or kernels.KernelConfig())

    def tie_weights(self) -> None:
        if self.dims.tie_word_embeddings:
            self.lm_head.weight = self.backbone.embeddings.weight

    def mixers(self) -> list[Mamba2Mixer]:
        return [layer.mixer for layer in self.backbone.layers]

    def use_kernel_config(self, config: kernels.KernelConfig) -> None:
        """Every kernel call of the model takes ``config`` from now on (capture CUDA graphs again after)."""
        self.kernel_config = config
        for m in self.modules():
            if hasattr(m, "kernel_config"):
                m.kernel_config = config

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        # Original state-spaces checkpoints call the embedding "embedding".
        state = {k.replace("backbone.embedding.", "backbone.embeddings."): v for k, v in state.items()}
        if self.dims.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        elif "lm_head.weight" not in state:
            state["lm_head.weight"] = state["backbone.embeddings.weight"]
        copy_into_parameters(self, state, frozenset({"lm_head.weight"}) if self.dims.tie_word_embeddings
                             else frozenset(), rank=self.tp.rank)
        self.refresh_derived()

    def capture_blocker(self, mode: ForwardMode) -> str | None:
        """Why a forward of ``mode`` cannot be captured in a CUDA graph (it would synchronise with the host),
        or None: where the Triton kernels run (decode and prefill), not their references."""
        w = self.lm_head.weight
        if mode is ForwardMode.DECODE and not kernels.decode_runs_triton(w):
            return REFERENCE_DECODE
        if mode is ForwardMode.EXTEND and not (kernels.scan_runs_triton(self.dims.chunk_size, w)
                                               and kernels.conv_varlen_runs_triton(self.dims.conv_kernel, w)):
            return (f"this model's prefill runs reference kernels (chunk size {self.dims.chunk_size}, conv width "
                    f"{self.dims.conv_kernel}), which synchronise with the host")
        return None

    def refresh_derived(self) -> None:
        """Recompute what is derived from parameters (each mixer's ``A``). ``load_weights`` calls it;
        call it after changing parameters directly."""
        for layer in self.backbone.layers:
            layer.mixer.refresh_A()

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, bt: BatchTensors, conv: torch.Tensor, ssm: torch.Tensor,
                logit_rows: torch.Tensor | None):
        """Run all layers; return logits (the model's dtype) at ``logit_rows`` (all rows if None) and, per layer, the
        tracked (conv, ssm) states asked for in ``bt.track`` (None when nothing is tracked).

        conv ``[L, slots, conv_dim, K-1]`` and ssm ``[L, slots, H, P, N]`` are updated in place.
        """
        x, residual = embed(input_ids, self.backbone.embeddings.weight, self.backbone.vocab_rows, self.tp), None
        tracked = []
        for i, layer in enumerate(self.backbone.layers):
            x, residual, states = layer(x, residual, bt, conv[i], ssm[i])
            tracked.append(states)
        if logit_rows is not None:
            x, residual = x[logit_rows], residual[logit_rows]
        logits, _ = self.backbone.norm_f.then_linear(x, residual, self.lm_head.weight, self.lm_head.bias)
        logits = self.tp.gather_vocab(logits)
        # padding rows of the embedding (mamba_ssm's, or up to a multiple of the ranks): never sampled
        logits = logits[:, :self.dims.real_vocab_size or self.dims.vocab_size]
        return logits, tracked
