"""Feed-forward blocks of hybrid models: dense MLPs and mixtures of experts, over packed ``[T, hidden]``.

Parameter names are each family's checkpoint names. Routed experts run ``kernels.moe.moe_experts``: on CUDA a
fused Triton grouped GEMM (pairs grouped by expert, the up projection with the family's activation, the down
projection with the routing weight; no host synchronisation, so CUDA-graph capturable), on CPU the torch
expert loop it is checked against. Each family keeps its stacked expert weights as the loader produces them.

Tensor parallel (``parallel``): every block's intermediate width is split (up/gate column-parallel, down
row-parallel), the experts' within each expert; the router is replicated, so every rank routes alike and no
token moves between ranks. A block sums its partial output over the ranks once (``partial=True`` leaves the
sum to a caller that adds another partial first: a shared expert).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mambaserve.kernels import KernelConfig, moe
from mambaserve.kernels.moe import fold_gated_mlp  # (not through `moe`: tests swap it to count the op's calls)
from mambaserve.kernels.relu2 import relu2
from mambaserve.kernels.swiglu import silu_mul
from mambaserve.kernels.rmsnorm import rmsnorm
from mambaserve.kernels.topk_softmax import rmsnorm_topk_softmax, topk_softmax
from mambaserve.server.model.hybrid_config import MlpDims, MoEDims
from mambaserve.server.model.parallel import FIRST, SINGLE, TP, column, gated_column


def activation(name: str):
    if name == "silu":
        return F.silu
    if name == "relu2":  # Nemotron-H: squared ReLU
        return relu2
    raise ValueError(f"activation {name!r} is not implemented")


def _row_parallel(tp: TP, specs: dict, bias: bool, down: str) -> dict:
    """``specs`` and, with a bias, the down projection's on rank 0 only (``parallel.FIRST``); {} at one rank."""
    if tp.size == 1:
        return {}
    return specs | ({f"{down}.bias": FIRST} if bias else {})


class Relu2MLP(nn.Module):
    """``down(act(up(x)))`` (Nemotron-H's MLP and shared expert)."""

    def __init__(self, hidden: int, inter: int, act: str, bias: bool, tp: TP = SINGLE):
        super().__init__()
        self.tp = tp
        cols = tp.part(inter, "MLP intermediate features")
        self.up_proj = nn.Linear(hidden, len(cols), bias=bias)
        self.down_proj = nn.Linear(len(cols), hidden, bias=bias)
        self.act = activation(act)
        up = column(tp, inter, "MLP intermediate features")
        self.tp_slices = _row_parallel(tp, {"up_proj.weight": up, "down_proj.weight": column(tp, inter, "", dim=1)}
                                       | ({"up_proj.bias": up} if bias else {}), bias, "down_proj")

    def forward(self, x: torch.Tensor, partial: bool = False) -> torch.Tensor:
        y = self.down_proj(self.act(self.up_proj(x)))
        return y if partial else self.tp.all_reduce(y)


class SwiGLU(nn.Module):
    """``down(act(gate(x)) * up(x))`` with separate projections (Bamba's ``feed_forward``)."""

    def __init__(self, hidden: int, m: MlpDims, tp: TP = SINGLE):
        super().__init__()
        self.tp = tp
        n = len(tp.part(m.intermediate_size, "MLP intermediate features"))
        self.gate_proj = nn.Linear(hidden, n, bias=m.bias)
        self.up_proj = nn.Linear(hidden, n, bias=m.bias)
        self.down_proj = nn.Linear(n, hidden, bias=m.bias)
        self.act = activation(m.act)
        rows = column(tp, m.intermediate_size, "MLP intermediate features")
        specs = {"gate_proj.weight": rows, "up_proj.weight": rows,
                 "down_proj.weight": column(tp, m.intermediate_size, "", dim=1)}
        self.tp_slices = _row_parallel(tp, specs | ({"gate_proj.bias": rows, "up_proj.bias": rows} if m.bias else {}),
                                       m.bias, "down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x)))


class FusedSwiGLU(nn.Module):
    """SwiGLU with gate and up in one projection, gate first (Granite's ``shared_mlp``)."""

    def __init__(self, hidden: int, m: MlpDims, tp: TP = SINGLE):
        super().__init__()
        self.tp = tp
        n = len(tp.part(m.intermediate_size, "MLP intermediate features"))
        self.input_linear = nn.Linear(hidden, 2 * n, bias=False)
        self.output_linear = nn.Linear(n, hidden, bias=False)
        self.act = activation(m.act)
        self.tp_slices = _row_parallel(tp, {
            "input_linear.weight": gated_column(tp, m.intermediate_size, "MLP intermediate features"),
            "output_linear.weight": column(tp, m.intermediate_size, "", dim=1)}, False, "")

    def forward(self, x: torch.Tensor, partial: bool = False) -> torch.Tensor:
        return self.finish(self.input_linear(x), partial)

    def finish(self, gate_up: torch.Tensor, partial: bool = False) -> torch.Tensor:
        """The block after its input projection ``gate_up`` ``[T, 2n]`` (a caller may compute it in one GEMM with
        another projection of the same rows: Granite's router)."""
        if self.act is F.silu:
            h = silu_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            h = self.act(gate) * up
        y = self.output_linear(h)
        return y if partial else self.tp.all_reduce(y)


class NemotronExperts(nn.Module):
    """Routed experts as stacked weights ``up_proj [E, I, in]``, ``down_proj [E, in, I]`` (the checkpoint's
    ``experts.{e}.up_proj.weight`` are stacked at load); a rank holds every expert's share of ``I``."""

    def __init__(self, m: MoEDims, in_dim: int, tp: TP = SINGLE):
        super().__init__()
        n = len(tp.part(m.intermediate_size, "expert intermediate features"))
        self.up_proj = nn.Parameter(torch.empty(m.num_experts, n, in_dim))
        self.down_proj = nn.Parameter(torch.empty(m.num_experts, in_dim, n))
        if tp.size > 1:
            self.tp_slices = {"up_proj": column(tp, m.intermediate_size, "", dim=1),
                              "down_proj": column(tp, m.intermediate_size, "", dim=2)}


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
    expert on the block input. Tensor parallel: the latent projection in is replicated, the one out is
    linear, so it runs on a rank's partial sum (its bias on rank 0); one sum over ranks for the block."""

    def __init__(self, hidden: int, m: MoEDims, bias: bool, tp: TP = SINGLE):
        super().__init__()
        self.m, self.tp = m, tp
        latent = m.latent_size or hidden
        self.gate = NemotronRouter(m, hidden)
        self.experts = NemotronExperts(m, latent, tp)
        self.shared_experts = Relu2MLP(hidden, m.shared_intermediate_size, m.act, bias, tp)
        if m.latent_size:
            self.fc1_latent_proj = nn.Linear(hidden, latent, bias=bias)
            self.fc2_latent_proj = nn.Linear(latent, hidden, bias=bias)
            if tp.size > 1 and bias:
                self.tp_slices = {"fc2_latent_proj.bias": FIRST}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx, w = self.gate(x)
        h = self.fc1_latent_proj(x) if self.m.latent_size else x
        y = moe.moe_experts(h, idx, w, self.experts.up_proj, self.experts.down_proj, act=self.m.act, gated=False)
        if self.m.latent_size:
            y = self.fc2_latent_proj(y)
        return self.tp.all_reduce(y + self.shared_experts(x, partial=True))

    def warm_up_experts(self, max_tokens: int) -> int:
        """Compile the expert kernels' variants, routed in the dtypes the router gives."""
        idx, w = self.gate(self.experts.up_proj.new_zeros(1, self.gate.weight.shape[1]))
        return moe.moe_warm_up(self.experts.up_proj, self.experts.down_proj, self.m.top_k, max_tokens, act=self.m.act,
                               gated=False, ids_dtype=idx.dtype, weights_dtype=w.dtype)


class GraniteRouter(nn.Module):
    def __init__(self, m: MoEDims, hidden: int):
        super().__init__()
        self.layer = nn.Linear(hidden, m.num_experts, bias=False)
        self.top_k = m.top_k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(top-k expert ids, their weights in x's dtype)``: a softmax over the k best logits."""
        return self.route(self.layer(x), x.dtype)

    def route(self, logits: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` from logits computed elsewhere (Granite's layer: in one GEMM with the shared MLP's)."""
        return topk_softmax(logits, self.top_k, dtype)


class Stacked(nn.Module):
    """One weight per expert, stacked: ``weight [E, out, in]``."""

    def __init__(self, experts: int, out_dim: int, in_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, out_dim, in_dim))


class GraniteMoE(nn.Module):
    """Granite's ``block_sparse_moe``: softmax over the top-k router logits, SwiGLU experts stored as
    ``input_linear [E, 2I, H]`` (gate rows first) and ``output_linear [E, H, I]``; a rank holds every expert's
    share of ``I``."""

    def __init__(self, hidden: int, m: MoEDims, tp: TP = SINGLE):
        super().__init__()
        self.m, self.tp = m, tp
        n = len(tp.part(m.intermediate_size, "expert intermediate features"))
        self.router = GraniteRouter(m, hidden)
        self.kernel_config = KernelConfig()  # (the model's, once built: fold_shared_mlp)
        self.input_linear = Stacked(m.num_experts, 2 * n, hidden)
        self.output_linear = Stacked(m.num_experts, hidden, n)
        if tp.size > 1:
            self.tp_slices = {"input_linear.weight": gated_column(tp, m.intermediate_size, "", dim=1),
                              "output_linear.weight": column(tp, m.intermediate_size, "", dim=2)}
        activation(m.act)  # refuses an activation this module does not implement

    def forward(self, x: torch.Tensor, add: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                scale: float = 1.0, logits: torch.Tensor | None = None) -> torch.Tensor:
        """The experts' weighted sum, and the layer's epilogue in the same pass: ``residual + scale * (sum + add)``
        (``kernels.moe.moe_experts``), summed over the ranks: ``add`` is a rank's partial (a shared MLP's), and
        rank 0 alone adds ``residual``. ``logits``: the router's output where the caller computed it already."""
        idx, w = self.router(x) if logits is None else self.router.route(logits, x.dtype)
        return self._experts(x, idx, w, self.input_linear.weight, self.output_linear.weight, add, residual, scale)

    def _experts(self, x, idx, w, w1, w2, add, residual, scale: float) -> torch.Tensor:
        return self.tp.all_reduce(moe.moe_experts(x, idx, w, w1, w2, act=self.m.act, gated=True, add=add,
                                                  residual=None if self.tp.rank else residual, scale=scale))

    # Folded, the shared MLP runs as more experts inside the op for steps of up to this many tokens (decode): on an
    # H200 at granite-4.0-h-tiny's shape (benchmarks/moe.py --shared-fold, the router's GEMM included) a layer's MoE
    # and shared MLP took 21.3 against 27.0 us at 1 token, 81.3 against 84.6 at 8, 96.3 against 96.6 at 64, and
    # longer folded at 256 tokens and more (117 against 110 us): there the shared MLP's GEMMs run better in cuBLAS.
    # With the fused router (three launches fewer), a whole batch-64 step took 7.15-7.18 against 7.23 ms folded
    # (hybrid_step.py, one process), a batch-256 one 14.88-14.90 against 14.04.
    FOLD_MAX_TOKENS = 64

    def fold(self, shared: FusedSwiGLU) -> None:
        """Hold the shared SwiGLU MLP ``shared`` also as ``S / I`` more experts after the routed ones
        (``fold_gated_mlp``: ``folded_w1``, ``folded_w2``). The routed experts' parameters become views of the
        stacks' first E (no second copy); the shared weights are copied (9.4 MB a layer at granite-4.0-h-tiny's
        shape). Nothing where S is not a multiple of I or the activation is not SiLU (the op's gated one)."""
        w1, w2 = self.input_linear.weight, self.output_linear.weight
        if shared.act is not F.silu or self.m.act != "silu":
            return
        with torch.no_grad():
            folded = fold_gated_mlp(w1, w2, shared.input_linear.weight, shared.output_linear.weight)
        if folded is None:
            return
        f1, f2 = folded
        w1.data, w2.data = f1[:w1.shape[0]], f2[:w2.shape[0]]
        self.register_buffer("folded_w1", f1, persistent=False)
        self.register_buffer("folded_w2", f2, persistent=False)
        # the fused router's programs count themselves here, a counter a row (rmsnorm_topk_softmax leaves them at 0)
        self.register_buffer("route_counters", torch.zeros(self.FOLD_MAX_TOKENS, dtype=torch.int32, device=w2.device),
                             persistent=False)

    @property
    def always(self) -> int:
        """The folded experts every token takes (the shared MLP's ``S / I``)."""
        return self.folded_w1.shape[0] - self.m.num_experts

    def folds(self, x: torch.Tensor) -> bool:
        return (hasattr(self, "folded_w1") and self.kernel_config.fold_shared_mlp
                and x.shape[0] <= self.FOLD_MAX_TOKENS)

    def forward_folded(self, h: torch.Tensor, x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                       scale: float) -> torch.Tensor:
        """The layer's tail from the mixer's output ``h`` and the residual ``x``: their residual-add norm
        (``kernels.rmsnorm(h, x, norm_weight, eps, scale=scale)``), then ``forward`` of the normed rows with the
        shared MLP's output as ``add`` (its partial, tensor parallel), computed inside the op as the folded experts
        (``fold``) that every token takes with weight 1. The norm, the router's GEMM and its top-k are one launch
        (``rmsnorm_topk_softmax``; three with ``kernel_config.fuse_router`` off), the shared MLP none of its own."""
        if self.kernel_config.fuse_router:
            h, x, idx, w = rmsnorm_topk_softmax(h, x, norm_weight, eps, scale, self.router.layer.weight, self.m.top_k,
                                                h.dtype, always=self.always, counters=self.route_counters)
        else:
            h, x = rmsnorm(h, x, norm_weight, eps, scale=scale)
            idx, w = topk_softmax(self.router.layer(h), self.m.top_k, h.dtype, always=self.always)
        return self._experts(h, idx, w, self.folded_w1, self.folded_w2, None, x, scale)

    def warm_up_experts(self, max_tokens: int) -> int:
        """Compile the expert kernels' variants, routed in the dtypes the router gives (the folded op's too)."""
        w1 = self.input_linear.weight
        idx, w = self.router(w1.new_zeros(1, w1.shape[2]))
        kw = dict(act=self.m.act, ids_dtype=idx.dtype, weights_dtype=w.dtype)
        runs = moe.moe_warm_up(w1, self.output_linear.weight, self.m.top_k, max_tokens, **kw)
        if hasattr(self, "folded_w1"):
            runs += moe.moe_warm_up(self.folded_w1, self.folded_w2, self.m.top_k + self.always,
                                    min(max_tokens, self.FOLD_MAX_TOKENS), **kw)
        return runs
