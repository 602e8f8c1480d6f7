"""Feed-forward blocks of hybrid models: dense MLPs and mixtures of experts, over packed ``[T, hidden]``.

Parameter names are each family's checkpoint names. MoE runs a **torch fallback**, not a grouped GEMM:
the step's (token, expert) pairs are sorted by expert, each expert with tokens runs its two (or three)
matmuls on its rows, and the weighted rows are summed back per token. Counting the rows per expert is
one device-to-host copy per MoE layer per step, so MoE layers cannot be captured in a CUDA graph, and
an expert's weights are read once per step whatever its row count (decode at small batch reads
``top_k x batch`` experts' weights, up to all of them). Its speed is measured in benchmarks, not assumed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mambaserve.server.model.hybrid_config import MlpDims, MoEDims


def activation(name: str):
    if name == "silu":
        return F.silu
    if name == "relu2":  # Nemotron-H: squared ReLU
        return lambda x: torch.square(F.relu(x))
    raise ValueError(f"activation {name!r} is not implemented")


class Relu2MLP(nn.Module):
    """``down(act(up(x)))`` (Nemotron-H's MLP and shared expert)."""

    def __init__(self, hidden: int, inter: int, act: str, bias: bool):
        super().__init__()
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class SwiGLU(nn.Module):
    """``down(act(gate(x)) * up(x))`` with separate projections (Bamba's ``feed_forward``)."""

    def __init__(self, hidden: int, m: MlpDims):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, m.intermediate_size, bias=m.bias)
        self.up_proj = nn.Linear(hidden, m.intermediate_size, bias=m.bias)
        self.down_proj = nn.Linear(m.intermediate_size, hidden, bias=m.bias)
        self.act = activation(m.act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class FusedSwiGLU(nn.Module):
    """SwiGLU with gate and up in one projection, gate first (Granite's ``shared_mlp``)."""

    def __init__(self, hidden: int, m: MlpDims):
        super().__init__()
        self.input_linear = nn.Linear(hidden, 2 * m.intermediate_size, bias=False)
        self.output_linear = nn.Linear(m.intermediate_size, hidden, bias=False)
        self.act = activation(m.act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.input_linear(x).chunk(2, dim=-1)
        return self.output_linear(self.act(gate) * up)


def run_experts(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, num_experts: int, expert,
                out_dim: int, acc_dtype: torch.dtype) -> torch.Tensor:
    """``sum_k weights[t, k] * expert(idx[t, k], x[t])`` for each token t, as ``acc_dtype``. ``expert(e, rows)``
    runs expert e on its rows. The sort groups rows by expert; the counts come to the host once."""
    T, k = idx.shape
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    tokens = order // k
    rows = x[tokens]
    ys = torch.empty(len(order), out_dim, dtype=x.dtype, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n:
            ys[start:start + n] = expert(e, rows[start:start + n])
            start += n
    ys = ys.to(acc_dtype) * weights.reshape(-1)[order].to(acc_dtype)[:, None]
    return torch.zeros(T, out_dim, dtype=acc_dtype, device=x.device).index_add_(0, tokens, ys)


class NemotronExperts(nn.Module):
    """Routed experts as stacked weights ``up_proj [E, I, in]``, ``down_proj [E, in, I]`` (the checkpoint's
    ``experts.{e}.up_proj.weight`` are stacked at load)."""

    def __init__(self, m: MoEDims, in_dim: int):
        super().__init__()
        self.up_proj = nn.Parameter(torch.empty(m.num_experts, m.intermediate_size, in_dim))
        self.down_proj = nn.Parameter(torch.empty(m.num_experts, in_dim, m.intermediate_size))


class NemotronRouter(nn.Module):
    def __init__(self, m: MoEDims, hidden: int):
        super().__init__()
        self.m = m
        self.weight = nn.Parameter(torch.empty(m.num_experts, hidden))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(m.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(top-k expert ids, their fp32 weights)``: sigmoid scores; the choice adds the correction bias and
        keeps the ``topk_group`` best groups (a group scored by its two best experts); weights are the
        plain scores, normalised over the k and scaled."""
        m = self.m
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        if m.n_group > 1:
            groups = choice.view(-1, m.n_group, m.num_experts // m.n_group).topk(2, dim=-1)[0].sum(-1)
            keep = torch.zeros_like(groups).scatter_(1, groups.topk(m.topk_group, dim=-1, sorted=False)[1], 1)
            keep = keep.unsqueeze(-1).expand(-1, -1, m.num_experts // m.n_group).reshape(-1, m.num_experts)
            choice = choice.masked_fill(keep == 0, float("-inf"))
        idx = choice.topk(m.top_k, dim=-1, sorted=False)[1]
        w = scores.gather(1, idx)
        if m.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return idx, w * m.routed_scaling_factor


class NemotronMoE(nn.Module):
    """Nemotron-H's MoE mixer: sigmoid-routed non-gated experts (optionally in a latent width) + a shared
    expert on the block input."""

    def __init__(self, hidden: int, m: MoEDims, bias: bool):
        super().__init__()
        self.m = m
        latent = m.latent_size or hidden
        self.gate = NemotronRouter(m, hidden)
        self.experts = NemotronExperts(m, latent)
        self.shared_experts = Relu2MLP(hidden, m.shared_intermediate_size, m.act, bias)
        if m.latent_size:
            self.fc1_latent_proj = nn.Linear(hidden, latent, bias=bias)
            self.fc2_latent_proj = nn.Linear(latent, hidden, bias=bias)
        self.act = activation(m.act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx, w = self.gate(x)
        h = self.fc1_latent_proj(x) if self.m.latent_size else x
        up, down = self.experts.up_proj, self.experts.down_proj
        y = run_experts(h, idx, w, self.m.num_experts, lambda e, r: F.linear(self.act(F.linear(r, up[e])), down[e]),
                        h.shape[-1], torch.float32).to(x.dtype)
        if self.m.latent_size:
            y = self.fc2_latent_proj(y)
        return y + self.shared_experts(x)


class GraniteRouter(nn.Module):
    def __init__(self, m: MoEDims, hidden: int):
        super().__init__()
        self.layer = nn.Linear(hidden, m.num_experts, bias=False)
        self.top_k = m.top_k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits, idx = self.layer(x).float().topk(self.top_k, dim=-1)
        return idx, torch.softmax(logits, dim=-1).to(x.dtype)


class Stacked(nn.Module):
    """One weight per expert, stacked: ``weight [E, out, in]``."""

    def __init__(self, experts: int, out_dim: int, in_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, out_dim, in_dim))


class GraniteMoE(nn.Module):
    """Granite's ``block_sparse_moe``: softmax over the top-k router logits, SwiGLU experts stored as
    ``input_linear [E, 2I, H]`` (gate rows first) and ``output_linear [E, H, I]``."""

    def __init__(self, hidden: int, m: MoEDims):
        super().__init__()
        self.m = m
        self.router = GraniteRouter(m, hidden)
        self.input_linear = Stacked(m.num_experts, 2 * m.intermediate_size, hidden)
        self.output_linear = Stacked(m.num_experts, hidden, m.intermediate_size)
        self.act = activation(m.act)

    def _expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(rows, self.input_linear.weight[e]).chunk(2, dim=-1)
        return F.linear(self.act(gate) * up, self.output_linear.weight[e])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx, w = self.router(x)
        return run_experts(x, idx, w, self.m.num_experts, self._expert, x.shape[-1], x.dtype)
