"""Mixture-of-experts feed-forward: the routed experts of hybrid models (Nemotron-H's ``E`` blocks, Granite 4.0-H's
``block_sparse_moe``) as one fused op, after the family's router has picked each token's experts.

Shapes: ``x`` ``[T, H]`` tokens; ``topk_ids`` ``[T, k]`` (any integer dtype, values in ``[0, E)``) and
``topk_weights`` ``[T, k]`` (any float dtype) the router's choice; ``w1`` ``[E, F, H]`` each expert's first
projection with ``F = 2 * I`` when ``gated`` (gate rows ``[0, I)`` first, then up rows ``[I, 2I)``: Granite's
``input_linear``) or ``F = I`` (Nemotron-H's ``up_proj``); ``w2`` ``[E, H, I]`` the second projection
(``output_linear`` / ``down_proj``). Weights stay in the layout the loaders produce (rows = output features).

- ``moe_experts(x, topk_ids, topk_weights, w1, w2, act=, gated=)`` -> ``[T, H]`` in ``x``'s dtype:
  ``sum_j topk_weights[t, j] * expert(topk_ids[t, j], x[t])`` with ``expert(e, r) = w2[e] @ f(w1[e] @ r)``,
  ``f(g, u) = act(g) * u`` gated, ``act(h)`` otherwise; ``act`` is ``"silu"`` or ``"relu2"`` (squared ReLU).
  Products accumulate in fp32; the intermediate activations are rounded to ``x``'s dtype (as the
  per-expert ``F.linear`` calls of the reference and of ``transformers`` do); the weighted top-k sum is fp32.
- ``moe_align(topk_ids, num_experts, block_m)`` -> ``MoeAlignment``: the routing-align step (pairs
  sorted by expert, each expert's run padded to ``block_m``), exposed for tests and benchmarks.
- ``fold_gated_mlp(w1, w2, mlp_w1, mlp_w2)``: a dense gated MLP stacked after the experts as more of them (every
  token takes them with weight 1: one op for both).
- ``moe_runs_triton(t)``: whether tensors where ``t`` lives get the Triton path (then the op can be captured in
  a CUDA graph); ``moe_warm_up(w1, w2, k, max_tokens, ...)``: every launch variant up to ``max_tokens`` tokens
  run once (``launch_variant``), so requests wait for no compile.

The references (``<op>_ref``, same signatures) are the torch expert loop: the pairs sorted by expert, each expert
with rows runs its matmuls on them (the row counts come to the host: one synchronisation per call); the
launchers run them on CPU and under ``MAMBASERVE_KERNELS=ref``. The Triton path (``moe_kernels``: how it
works) is an align step and two grouped GEMMs and a sum, with no host synchronisation and launches fixed by
the shapes, so a decode step's MoE layers can be captured in a CUDA graph. ``force_triton`` and ``tiles``
(over ``moe_tiles``' choice) are for tests and benchmark sweeps.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from mambaserve.kernels._dispatch import (HAS_TRITON, Target, next_pow2, pdl_args, target, tl, tma_descriptor, triton,
                                          use_triton)

if HAS_TRITON:
    from mambaserve.kernels.moe_kernels import (_moe_align_expert_kernel, _moe_count_kernel, _moe_down_kernel,
                                                _moe_runs_kernel, _moe_scatter_kernel, _moe_sum_kernel, _moe_up_kernel)

    _TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

ACTIVATIONS = ("silu", "relu2")


class MoeAlignment(NamedTuple):
    """The pairs (``pair = token * k + j``) grouped by expert. ``sorted_pairs`` int32 ``[P]``: the pair at
    each position, ``N = T * k`` at padding; expert e's pairs, in pair order, fill a run starting at a
    multiple of ``block_m``. ``block_expert`` int32 ``[P // block_m]``: each block's expert, -1 past the
    last used block. ``P = padded_capacity(N, E, block_m)``, fixed by the shapes."""

    sorted_pairs: torch.Tensor
    block_expert: torch.Tensor
    block_m: int


def padded_capacity(pairs: int, num_experts: int, block_m: int) -> int:
    """Positions enough for any routing: each expert that has pairs (at most ``min(E, N)``) pads fewer than
    ``block_m`` of them, rounded up to whole blocks."""
    n = pairs + min(num_experts, pairs) * (block_m - 1)
    return -(-n // block_m) * block_m


def _check(x, topk_ids, topk_weights, w1, w2, act: str, gated: bool) -> None:
    if act not in ACTIVATIONS:
        raise ValueError(f"moe_experts: activation {act!r} is not one of {ACTIVATIONS}")
    if x.dim() != 2 or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"moe_experts: x {tuple(x.shape)}, topk_ids {tuple(topk_ids.shape)}, topk_weights "
                         f"{tuple(topk_weights.shape)} must be [T, H], [T, k], [T, k]")
    E, Fdim, H = w1.shape
    I = w2.shape[2]
    if w2.shape[:2] != (E, H) or H != x.shape[1] or Fdim != (2 * I if gated else I):
        raise ValueError(f"moe_experts: w1 {tuple(w1.shape)} and w2 {tuple(w2.shape)} do not fit x {tuple(x.shape)} "
                         f"(w1 [E, {'2I' if gated else 'I'}, H], w2 [E, H, I])")


# ---------------------------------------------------------------------------------------------- references


def moe_align_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoeAlignment:
    """Stable sort by expert, then each pair moved to its expert's padded run. Torch only and without a host
    synchronisation: the oracle of the Triton align."""
    flat = topk_ids.reshape(-1).long()
    N, dev = flat.numel(), flat.device
    P = padded_capacity(N, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    rank = torch.arange(N, device=dev) - (counts.cumsum(0) - counts)[expert]
    sorted_pairs = torch.full((P,), N, dtype=torch.int32, device=dev)
    sorted_pairs.scatter_(0, (pad_end - padded)[expert] + rank, order.to(torch.int32))
    first = torch.arange(0, P, block_m, device=dev)
    block_expert = torch.searchsorted(pad_end, first, right=True)  # first expert whose run ends past the block
    used = first < pad_end[-1] if num_experts else torch.zeros_like(first, dtype=torch.bool)
    return MoeAlignment(sorted_pairs, torch.where(used, block_expert, -1).to(torch.int32), block_m)


def _act(h: torch.Tensor, act: str) -> torch.Tensor:
    return F.silu(h) if act == "silu" else torch.square(F.relu(h))


def _epilogue(y: torch.Tensor, add: torch.Tensor | None, residual: torch.Tensor | None, scale: float,
              dtype: torch.dtype) -> torch.Tensor:
    """``residual + scale * (y + add)`` in fp32 (``y`` the fp32 sum), rounded once to ``dtype``."""
    if add is not None:
        y = y + add.float()
    if scale != 1.0:
        y = y * scale
    if residual is not None:
        y = y + residual.float()
    return y.to(dtype)


def moe_experts_ref(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w1: torch.Tensor,
                    w2: torch.Tensor, *, act: str = "silu", gated: bool = True, add: torch.Tensor | None = None,
                    residual: torch.Tensor | None = None, scale: float = 1.0) -> torch.Tensor:
    """The expert loop: pairs sorted by expert; each expert with rows runs its projections on them (in ``x``'s
    dtype, as ``transformers`` does); the weighted rows are summed per token in fp32, then the epilogue."""
    _check(x, topk_ids, topk_weights, w1, w2, act, gated)
    T, k = topk_ids.shape
    H, I = x.shape[1], w2.shape[2]
    flat = topk_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w1.shape[0]).tolist()  # the host sync of the loop
    tokens = order // k
    rows = x[tokens]
    ys = torch.empty(len(order), H, dtype=x.dtype, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n:
            h = F.linear(rows[start:start + n], w1[e])
            h = _act(h[:, :I], act) * h[:, I:] if gated else _act(h, act)
            ys[start:start + n] = F.linear(h, w2[e])
            start += n
    ys = ys.float() * topk_weights.reshape(-1)[order].float()[:, None]
    y = torch.zeros(T, H, dtype=torch.float32, device=x.device).index_add_(0, tokens, ys)
    return _epilogue(y, add, residual, scale, x.dtype)


def fold_gated_mlp(w1: torch.Tensor, w2: torch.Tensor, mlp_w1: torch.Tensor,
                   mlp_w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The routed experts ``w1 [E, 2I, H]``, ``w2 [E, H, I]`` stacked with a dense gated MLP (``mlp_w1 [2S, H]`` gate
    rows first, ``mlp_w2 [H, S]``) as ``V = S / I`` more experts: ``[E + V, 2I, H]``, ``[E + V, H, I]``, expert
    ``E + v`` holding gate rows ``[vI, (v+1)I)`` and up rows ``[S + vI, ...)``, down columns ``[vI, ...)``. Every token
    taking those V experts with weight 1 (``topk_softmax(..., always=V)``) adds the MLP's output to the experts' sum.
    None where S is not a multiple of I."""
    (E, F2, H), I, S = w1.shape, w2.shape[2], mlp_w2.shape[1]
    if S % I or mlp_w1.shape != (2 * S, H):
        return None
    V = S // I
    f1, f2 = w1.new_empty(E + V, F2, H), w2.new_empty(E + V, H, I)
    f1[:E], f2[:E] = w1, w2
    f1[E:, :I] = mlp_w1[:S].reshape(V, I, H)
    f1[E:, I:] = mlp_w1[S:].reshape(V, I, H)
    f2[E:] = mlp_w2.reshape(H, V, I).transpose(0, 1)
    return f1, f2


# ---------------------------------------------------------------------------------------------- launchers

# Up to this many pairs (64 tokens at top-6: decode batches) the align step is a program per expert, one launch: each
# program histograms every pair (CHUNK a step) and lays out its own run. Above, three launches split the pairs over
# programs. On an H200 (granite-4.0-h-tiny's MoE, graph-replayed, in one process) the whole op took 67.8 / 84.1 us at
# 16 / 64 tokens against 71.2 / 87.1 in three launches (the one program that walked the pairs with one-hots before was
# slower still), but 98.5 / 102.6 / 135.2 against 95.2 / 99.8 / 119.5 at 256 / 512 / 1,024, though the align alone
# was faster there too (9.3 against 16.1 us at 256 tokens): inside the op its longer programs cost the GEMMs after
# them more than they save. The sort-based torch align (moe_align_ref) took 141 us at 12,288 pairs.
ALIGN_PER_EXPERT_MAX_PAIRS = 384

# Tiles by the mean rows per expert (T * k / E), first match. One BLOCK_M for both GEMMs (they walk the same
# blocks). Decode (a few rows an expert) is bound by reading the experts' weights: 16-row blocks (the smallest
# tl.dot tile) and narrow column tiles, so that the few experts of a small batch still spread over every SM.
# Each row is the best of ``benchmarks/moe.py --sweep`` at granite-4.0-h-tiny's shape on an H200 (2026-11-28;
# benchmarks/README.md has the times) at 1, 64, 256, 512, 640, 768, 2,048 and 8,192 tokens. An
# override's ``"direct"`` (default: one token) skips the align step, a block per pair: right for any routing,
# cheapest where no two pairs share an expert.
MOE_TILES = (
    # a few tokens: long K steps in two warps, so that each program keeps a deep stream of its experts' rows
    (1, {"block_m": 16, "up_block_n": 32, "up_block_k": 256, "up_warps": 2, "up_stages": 4,
         "down_block_n": 32, "down_block_k": 256, "down_warps": 2, "down_stages": 4}),
    (12, {"block_m": 16, "up_block_n": 32, "up_block_k": 128, "up_warps": 4, "up_stages": 4,
          "down_block_n": 64, "down_block_k": 128, "down_warps": 4, "down_stages": 4}),
    (48, {"block_m": 64, "up_block_n": 32, "up_block_k": 64, "up_warps": 4, "up_stages": 3,
          "down_block_n": 64, "down_block_k": 64, "down_warps": 4, "down_stages": 3}),
    # a cache hit's extend step (granite's 8 x 80 new tokens: 60 rows an expert): 64-row blocks, the weight tiles
    # and the down projection's rows through TMA descriptors (640 tokens: 103.8 against 110.8 us with the prefill
    # tiles below, 111.2 with the ones above)
    (64, {"block_m": 64, "up_block_n": 64, "up_block_k": 64, "up_warps": 4, "up_stages": 3,
          "down_block_n": 128, "down_block_k": 64, "down_warps": 4, "down_stages": 3, "tma": True}),
    # prefill, from 65 rows an expert on (granite's 768 tokens: 114 us against 128-139 with 64-row blocks): 128 x 128
    # tiles over two warpgroups for the up projection, 128 x 256 for the down one (its K is only I: wider tiles read
    # each row block fewer times; 577 against 617 us at 8,192 tokens, even at 2,048), the weight tiles (and the down
    # projection's rows) through TMA descriptors on Hopper (5-8% faster at 2,048-8,192 tokens on an H200)
    (None, {"block_m": 128, "up_block_n": 128, "up_block_k": 64, "up_warps": 8, "up_stages": 3,
            "down_block_n": 256, "down_block_k": 64, "down_warps": 8, "down_stages": 4, "tma": True}),
)
# Under the interpreter: the smallest tiles tl.dot takes, so tiny test shapes still cross several tiles.
_INTERPRET_TILES = {"block_m": 16, "up_block_n": 16, "up_block_k": 16, "up_warps": 1, "up_stages": 1,
                    "down_block_n": 16, "down_block_k": 16, "down_warps": 1, "down_stages": 1}


# Shared memory the staged tiles of one program may take (an H100 block has 227 KB; the rest is left to the
# compiler's layout conversions).
STAGED_BYTES = 200 * 1024


def _fit_shared_memory(tiles: dict, elsize: int) -> dict:
    """Fewer pipeline stages, then shorter K steps, until each GEMM's staged tiles (A and, gated, two B tiles a
    stage) fit ``STAGED_BYTES``: the tiles are sized for bf16, and fp32 weights take twice the room."""
    for part, b_tiles in (("up", 2), ("down", 1)):
        n, k, st = f"{part}_block_n", f"{part}_block_k", f"{part}_stages"
        while (tiles["block_m"] + b_tiles * tiles[n]) * tiles[k] * elsize * tiles[st] > STAGED_BYTES:
            if tiles[st] > 2:
                tiles[st] -= 1
            else:
                tiles[k] //= 2
    return tiles


def moe_tiles(pairs: int, num_experts: int, on_gpu: bool = True, overrides: dict | None = None,
              elsize: int = 2) -> dict:
    """The launch tiles for ``pairs`` (token, expert) pairs over ``num_experts`` experts with weights of ``elsize``
    bytes."""
    if on_gpu:
        per_expert = pairs / max(1, num_experts)
        tiles = _fit_shared_memory(dict(next(t for bound, t in MOE_TILES if bound is None or per_expert <= bound)),
                                   elsize)
    else:
        tiles = dict(_INTERPRET_TILES)
    tiles.update(overrides or {})
    return tiles


def _dot_types(x: torch.Tensor, w: torch.Tensor):
    """(matrix-unit operand type, input precision): fp32 keeps fp32 products (tf32 would cost ~1e-3
    relative); the Triton 3.9 interpreter multiplies bf16 operands wrongly, so under it they go in as fp32."""
    if not target(x).compiled or torch.float32 in (x.dtype, w.dtype):
        return tl.float32, "ieee"
    return _TL_DTYPES[w.dtype], "tf32"


def moe_runs_triton(t: torch.Tensor, force_triton: bool | None = None) -> bool:
    """The Triton path (no host synchronisation: CUDA-graph capturable) for tensors where ``t`` lives; else the
    expert loop, which copies each expert's row count to the host."""
    return use_triton(t, force_triton)


def align_launch(pairs: int, num_experts: int) -> dict | None:
    """The align step's Triton launch for ``pairs`` pairs (None without experts): its ``kernel`` (``"per_expert"`` up
    to ``ALIGN_PER_EXPERT_MAX_PAIRS``, one compile for every batch; ``"split"`` above, three launches over ``CHUNK``
    pairs a program) and constexprs."""
    if num_experts == 0:
        return None
    EP = max(16, next_pow2(num_experts))
    if pairs > ALIGN_PER_EXPERT_MAX_PAIRS:
        return {"kernel": "split", "EP": EP, "CHUNK": max(16, min(256, 4096 // EP))}
    return {"kernel": "per_expert", "EP": EP, "CHUNK": 1024, "FILL": 128, "num_warps": 4}


def launch_variant(tokens: int, top_k: int, num_experts: int, tg: Target, tiles: dict | None = None,
                   elsize: int = 2) -> tuple:
    """What ``moe_experts`` launches for ``tokens`` tokens (tiles, the direct path, the align step's program): a
    pure function of the shapes, each value one set of compiles (``moe_warm_up`` runs one batch per value)."""
    cfg = moe_tiles(tokens * top_k, num_experts, tg.compiled, tiles, elsize)
    direct = cfg.get("direct", tokens == 1)
    align = None if direct else align_launch(tokens * top_k, num_experts)
    return tuple(sorted(cfg.items())), direct, tuple(sorted((align or {}).items()))


def moe_warm_up(w1: torch.Tensor, w2: torch.Tensor, top_k: int, max_tokens: int, *, act: str = "silu",
                gated: bool = True, ids_dtype: torch.dtype = torch.int64, weights_dtype: torch.dtype | None = None,
                force_triton: bool | None = None) -> int:
    """Run the op once per launch variant it can pick for these weights and 1 to ``max_tokens`` tokens
    (``launch_variant``: one token, the tile rows of ``MOE_TILES``, the align step's programs; each a Triton
    compile) on throwaway inputs in the weights' dtype, expert ids in ``ids_dtype`` and routing weights in
    ``weights_dtype`` (the router's: a dtype is part of a compile; default the weights'), so that no request waits
    seconds for a compile. Returns the runs (0 where the expert loop runs)."""
    if not moe_runs_triton(w1, force_triton):
        return 0
    E, H = w1.shape[0], w1.shape[2]
    tg = target(w1)
    first: dict[tuple, int] = {}
    for T in range(1, max_tokens + 1):
        first.setdefault(launch_variant(T, top_k, E, tg, elsize=w1.element_size()), T)
    for T in first.values():
        ids = torch.arange(T * top_k, device=w1.device).remainder(E).view(T, top_k).to(ids_dtype)
        wts = torch.full((T, top_k), 1.0 / top_k, device=w1.device, dtype=weights_dtype or w1.dtype)
        moe_experts(w1.new_zeros(T, H), ids, wts, w1, w2, act=act, gated=gated, force_triton=force_triton)
    return len(first)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int, *,
              force_triton: bool | None = None) -> MoeAlignment:
    """The routing-align step (``MoeAlignment``). Triton: a program per expert up to ``ALIGN_PER_EXPERT_MAX_PAIRS``
    pairs, three launches above (counts per program, the runs, the scatter); no host synchronisation."""
    N = topk_ids.numel()
    launch = align_launch(N, num_experts)
    if not use_triton(topk_ids, force_triton) or launch is None:
        return moe_align_ref(topk_ids, num_experts, block_m)
    P = padded_capacity(N, num_experts, block_m)
    NB = P // block_m
    ids = topk_ids.reshape(-1).contiguous()
    sorted_pairs = torch.empty(P, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(NB, dtype=torch.int32, device=ids.device)
    pdl = pdl_args(ids)
    if launch.pop("kernel") == "per_expert":
        _moe_align_expert_kernel[(num_experts,)](ids, sorted_pairs, block_expert, N, P, NB, num_experts,
                                                 BLOCK_M=block_m, **launch, **pdl)
        return MoeAlignment(sorted_pairs, block_expert, block_m)
    EP, chunk = launch["EP"], launch["CHUNK"]
    Q = triton.cdiv(N, chunk)
    local = torch.empty(Q, EP, dtype=torch.int32, device=ids.device)
    start = torch.empty(EP, dtype=torch.int32, device=ids.device)
    _moe_count_kernel[(Q,)](ids, local, sorted_pairs, N, P, triton.cdiv(P, Q), EP=EP, CHUNK=chunk, FILL=128,
                            num_warps=4, **pdl)
    _moe_runs_kernel[(1,)](local, start, block_expert, NB, Q, BLOCK_M=block_m, EP=EP,
                           CHUNK=chunk, QB=max(1, 4096 // EP), num_warps=4, **pdl)
    _moe_scatter_kernel[(Q,)](ids, local, start, sorted_pairs, N, EP=EP, CHUNK=chunk, num_warps=4, **pdl)
    return MoeAlignment(sorted_pairs, block_expert, block_m)


def moe_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w1: torch.Tensor,
                w2: torch.Tensor, *, act: str = "silu", gated: bool = True, add: torch.Tensor | None = None,
                residual: torch.Tensor | None = None, scale: float = 1.0, force_triton: bool | None = None,
                tiles: dict | None = None) -> torch.Tensor:
    """The routed experts' weighted sum per token (module docstring), and the block's epilogue where asked:
    ``residual + scale * (sum + add)`` (``add``, ``residual`` ``[T, H]``, e.g. a shared expert's output and the
    layer's input), in fp32, rounded once. Triton path: align (not for one token), the up projection with the
    activation, the down projection with the routing weight, the top-k sum with the epilogue; no host sync."""
    kw = dict(add=add, residual=residual, scale=scale)
    if not moe_runs_triton(x, force_triton):
        return moe_experts_ref(x, topk_ids, topk_weights, w1, w2, act=act, gated=gated, **kw)
    _check(x, topk_ids, topk_weights, w1, w2, act, gated)
    T, k = topk_ids.shape
    E, H, I = w1.shape[0], x.shape[1], w2.shape[2]
    for name, t in kw.items():
        if name != "scale" and t is not None and (t.shape != (T, H) or t.stride(-1) != 1):
            raise ValueError(f"moe_experts: {name} {tuple(t.shape)} must be [T, H] = [{T}, {H}], rows contiguous")
    if T == 0 or k == 0:
        return _epilogue(torch.zeros(T, H, dtype=torch.float32, device=x.device), add, residual, scale, x.dtype)
    N = T * k
    cfg = moe_tiles(N, E, target(x).compiled, tiles, w1.element_size())
    BM = cfg["block_m"]
    direct = cfg.get("direct", T == 1)  # one block per pair, no align step (moe_kernels' docstring)
    if direct:
        pairs = bexp = topk_ids.reshape(-1).contiguous()
        blocks = N
    else:
        al = moe_align(topk_ids, E, BM, force_triton=True)
        pairs, bexp = al.sorted_pairs, al.block_expert
        blocks = pairs.numel() // BM
    dot_t, prec = _dot_types(x, w1)
    pdl = pdl_args(x)
    h = torch.empty(blocks * BM, I, dtype=x.dtype, device=x.device)
    descs = _descriptors(cfg, w1, w2, h) if cfg.get("tma") and not direct else None
    w1_desc, h_desc, w2_desc = descs or (w1, h, w2)
    _moe_up_kernel[(blocks, triton.cdiv(I, cfg["up_block_n"]))](
        x, w1, w1_desc, h, pairs, bexp, N, H, I, *x.stride(), *w1.stride(), *h.stride(),
        TOP_K=k, GATED=gated, ACT=ACTIVATIONS.index(act), EVEN_K=H % cfg["up_block_k"] == 0, BLOCK_M=BM,
        BLOCK_N=cfg["up_block_n"], BLOCK_K=cfg["up_block_k"], DOT_T=dot_t, PREC=prec, DIRECT=direct,
        TMA=descs is not None, num_warps=cfg["up_warps"], num_stages=cfg["up_stages"], **pdl)
    out = torch.empty(N, H, dtype=x.dtype, device=x.device)
    _moe_down_kernel[(blocks, triton.cdiv(H, cfg["down_block_n"]))](
        h, w2, h_desc, w2_desc, out, pairs, bexp, N, I, H, *h.stride(), *w2.stride(), *out.stride(),
        EVEN_K=I % cfg["down_block_k"] == 0, BLOCK_M=BM, BLOCK_N=cfg["down_block_n"], BLOCK_K=cfg["down_block_k"],
        DOT_T=dot_t, PREC=prec, DIRECT=direct, TMA=descs is not None, num_warps=cfg["down_warps"],
        num_stages=cfg["down_stages"], **pdl)
    return _weighted_sum(out, topk_weights, add, residual, scale, x.dtype)


def _descriptors(cfg: dict, w1: torch.Tensor, w2: torch.Tensor, h: torch.Tensor) -> tuple | None:
    """TMA descriptors of the up projection's weights (``w1`` as [E * F, H]), the intermediate rows and the down
    projection's weights (``w2`` as [E * H, I]) in the tiles' blocks; None where one cannot be made (not Hopper,
    a layout TMA cannot read)."""
    if not (w1.is_contiguous() and w2.is_contiguous()):
        return None
    (E, F_, H), I = w1.shape, w2.shape[2]
    descs = (tma_descriptor(w1, E * F_, H, H, [cfg["up_block_n"], cfg["up_block_k"]]),
             tma_descriptor(h, h.shape[0], I, I, [cfg["block_m"], cfg["down_block_k"]]),
             tma_descriptor(w2, E * H, I, I, [cfg["down_block_n"], cfg["down_block_k"]]))
    return None if any(d is None for d in descs) else descs


def _weighted_sum(src: torch.Tensor, topk_weights: torch.Tensor, add, residual, scale: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """``_moe_sum_kernel``: each token's k rows of ``src`` (pair i's at row i) times their routing weights, summed
    with the epilogue."""
    T, k = topk_weights.shape
    wts = topk_weights.reshape(-1).contiguous()
    H = src.shape[1]
    y = torch.empty(T, H, dtype=dtype, device=src.device)
    BLOCK = min(1024, next_pow2(H))
    a, r = (add if add is not None else y), (residual if residual is not None else y)  # (placeholders when absent)
    _moe_sum_kernel[(T, triton.cdiv(H, BLOCK))](
        src, y, a, r, wts, float(scale), H, src.stride(0), y.stride(0), a.stride(0), r.stride(0), TOP_K=k,
        HAS_ADD=add is not None, HAS_RES=residual is not None, BLOCK=BLOCK, num_warps=4, **pdl_args(src))
    return y
