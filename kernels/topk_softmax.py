"""Top-k routing with a softmax over the chosen logits (Granite 4.0-H's router): one launch for what torch runs as a
cast, a top-k (two kernels) and a softmax with its cast, five launches per MoE layer of a decode step.

Shapes: ``logits`` ``[T, E]`` (any float dtype, rows contiguous), ``k <= E``. Returns ``(ids [T, k + always],
weights [T, k + always])``: each row's k largest logits in descending order (ties: the lower expert first), and the
softmax of those k logits computed in fp32 and rounded to ``dtype`` (default the logits'); then ``always`` (default 0)
more columns, experts ``E, E + 1, ...`` with weight 1: experts every token takes (a shared MLP folded into the MoE op
as more experts, Granite's decode). The reference is those torch ops (its ids int64, the kernel's int32:
``kernels.moe`` takes either). A row with NaN logits still gets ids in ``[0, E)``.

``rmsnorm_topk_softmax(x, residual, norm_weight, eps, scale, router_weight, k, dtype, always=)`` is the MoE block's
start at a decode step in one launch: the residual-add RMSNorm before it (``kernels.rmsnorm``, its ``scale``),
the router's projection of the normed rows (``router_weight [E, D]``, logits rounded to ``x``'s dtype as
``F.linear`` rounds them) and this top-k softmax. Returns ``(normed, new residual, ids, weights)``. At one token
the three launches took 1.7 + 4.4 + 1.8 us of device time a layer (granite-4.0-h-tiny, H200), most of it ramping
up and draining around 0.2 MB of router weights. Here a row's experts are split over programs (``ROUTE_TILES``),
each normalising the row and reading its experts' rows (asked of L2 before its PDL wait: they do not depend on the
kernel before); the row's last program to finish, by an atomic count, takes the top k. Graph-replayed on an H200
at granite's shape: 5.1 against 7.3 us at one token, 5.3 against 8.4 at 8, 6.8 against 8.6 at 16; one program a
row, reading the whole router, took 7.2-7.8 us at one token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mambaserve.kernels._dispatch import (HAS_TRITON, next_pow2, pdl_args, pdl_start, pdl_trigger, pdl_wait,
                                         prefetch_lines, prefetch_rows, tl, triton, use_triton)
from mambaserve.kernels.rmsnorm import rmsnorm_ref

if HAS_TRITON:
    from mambaserve.kernels.rmsnorm import add_residual  # a jitted helper: it exists with Triton only

    @triton.jit
    def _topk_softmax_kernel(x_ptr, ids_ptr, w_ptr, E, x_t, K: tl.constexpr, KP: tl.constexpr, EP: tl.constexpr,
                             ALWAYS: tl.constexpr = 0, USE_PDL: tl.constexpr = False):
        """Grid (T,): one row (``_topk_store``)."""
        pdl_start(USE_PDL)
        t = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, EP)
        v = tl.load(x_ptr + t * x_t + e, mask=e < E, other=float("-inf")).to(tl.float32)
        _topk_store(v, e, ids_ptr, w_ptr, t, E, K, KP, EP, ALWAYS)

    @triton.jit
    def _topk_store(v, e, ids_ptr, w_ptr, t, E, K: tl.constexpr, KP: tl.constexpr, EP: tl.constexpr,
                    ALWAYS: tl.constexpr):
        """Row t's ids and weights from its logits ``v`` [EP] (fp32, -inf past E): k rounds of (max, its lowest
        index, masked out); then the ``ALWAYS`` fixed columns."""
        j = tl.arange(0, KP)
        top_v = tl.full([KP], float("-inf"), dtype=tl.float32)
        top_i = tl.zeros([KP], dtype=tl.int32)
        for r in tl.static_range(K):
            m = tl.max(v, 0)
            i = tl.minimum(tl.min(tl.where(v == m, e, EP), 0), E - 1)  # (E - 1: a NaN row picks a real expert)
            top_v = tl.where(j == r, m, top_v)
            top_i = tl.where(j == r, i, top_i)
            v = tl.where(e == i, float("-inf"), v)
        p = tl.where(j < K, tl.exp(top_v - tl.max(top_v, 0)), 0.0)
        row = t * (K + ALWAYS)
        tl.store(ids_ptr + row + j, top_i, mask=j < K)
        tl.store(w_ptr + row + j, (p / tl.sum(p, 0)).to(w_ptr.dtype.element_ty), mask=j < K)
        if ALWAYS > 0:
            a = tl.arange(0, triton.next_power_of_2(ALWAYS))
            tl.store(ids_ptr + row + K + a, E + a, mask=a < ALWAYS)
            tl.store(w_ptr + row + K + a, tl.full(a.shape, 1.0, w_ptr.dtype.element_ty), mask=a < ALWAYS)

    @triton.jit
    def _rmsnorm_topk_kernel(x_ptr, r_ptr, nw_ptr, rw_ptr, out_ptr, res_out_ptr, logit_ptr, count_ptr, ids_ptr, w_ptr,
                             D, E, eps, scale, x_t, r_t, o_t, ro_t, rw_e, K: tl.constexpr, KP: tl.constexpr,
                             EP: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                             ALWAYS: tl.constexpr = 0, HAS_RES: tl.constexpr = True,
                             PREFETCH_LINES: tl.constexpr = 0, USE_PDL: tl.constexpr = False):
        """Grid (T, cdiv(E, BLOCK_E)): program (t, p) normalises row t (the whole row at once for its mean square;
        program 0 stores the new residual and the normed row) and computes the logits of experts [p * BLOCK_E, ...)
        BLOCK_K columns a step (the normed values recomputed from the row, in L1), into ``logit_ptr``; the row's
        last program to finish (``count_ptr[t]``, a counter it leaves at 0 again) takes its top k
        (``_topk_store``)."""
        pdl_trigger(USE_PDL)
        t, pe = tl.program_id(0).to(tl.int64), tl.program_id(1)
        e = pe * BLOCK_E + tl.arange(0, BLOCK_E)
        me = e < E
        if PREFETCH_LINES > 0:
            prefetch_rows(rw_ptr, e, E, rw_e, D, PREFETCH_LINES)
        pdl_wait(USE_PDL)
        x_ptr += t * x_t
        r_ptr += t * r_t
        c = tl.arange(0, BLOCK_D)
        r, h = add_residual(x_ptr + c, r_ptr + c, c < D, scale, HAS_RES, res_out_ptr.dtype.element_ty)
        mine = tl.where(pe == 0, D, 0)  # program 0 stores the row's residual and normed values (a flag as a bound)
        tl.store(res_out_ptr + t * ro_t + c, r, mask=c < mine)
        inv = tl.rsqrt(tl.sum(h * h, axis=0) / D + eps)
        acc = tl.zeros([BLOCK_E, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, D, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            mk = k < D
            _, hk = add_residual(x_ptr + k, r_ptr + k, mk, scale, HAS_RES, res_out_ptr.dtype.element_ty)
            y = (hk * inv).to(x_ptr.dtype.element_ty).to(tl.float32)  # (out is in x's dtype)
            # the fp32 product of two bf16 / fp16 values is exact: one rounding, as torch's elementwise mul
            y = (y * tl.load(nw_ptr + k, mask=mk, other=0.0).to(tl.float32)).to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + t * o_t + k, y, mask=k < mine)
            wv = tl.load(rw_ptr + e[:, None] * rw_e + k[None, :], mask=me[:, None] & mk[None, :], other=0.0)
            acc += wv.to(tl.float32) * y.to(tl.float32)[None, :]
        logits = tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty).to(tl.float32)  # F.linear's, in x's dtype
        tl.store(logit_ptr + t * EP + e, logits, mask=me)
        tl.debug_barrier()  # every thread's logits stored before the counter says so
        if tl.atomic_add(count_ptr + t, 1, sem="acq_rel") == tl.num_programs(1) - 1:
            ea = tl.arange(0, EP)
            v = tl.load(logit_ptr + t * EP + ea, mask=ea < E, other=float("-inf"), cache_modifier=".cg")  # (from L2)
            _topk_store(v, ea, ids_ptr, w_ptr, t, E, K, KP, EP, ALWAYS)
            tl.store(count_ptr + t, 0)


def topk_softmax_ref(logits: torch.Tensor, k: int, dtype: torch.dtype | None = None, always: int = 0):
    vals, ids = logits.float().topk(k, dim=-1)
    w = torch.softmax(vals, dim=-1).to(dtype or logits.dtype)
    if always:
        T, E = logits.shape
        ids = torch.cat([ids, torch.arange(E, E + always, device=ids.device).expand(T, always)], 1)
        w = torch.cat([w, w.new_ones(T, always)], 1)
    return ids, w


def topk_softmax(logits: torch.Tensor, k: int, dtype: torch.dtype | None = None, *, always: int = 0,
                 force_triton: bool | None = None):
    """``(ids, weights)`` of each row's top ``k`` logits, then ``always`` fixed experts (module docstring). One
    launch, no host synchronisation."""
    if logits.dim() != 2 or not 0 < k <= logits.shape[1] or always < 0:
        raise ValueError(f"topk_softmax: logits {tuple(logits.shape)} must be [T, E] with 0 < k={k} <= E "
                         f"(always={always} >= 0)")
    if not use_triton(logits, force_triton) or logits.stride(-1) != 1:
        return topk_softmax_ref(logits, k, dtype, always)
    T, E = logits.shape
    ids = torch.empty(T, k + always, dtype=torch.int32, device=logits.device)
    w = torch.empty(T, k + always, dtype=dtype or logits.dtype, device=logits.device)
    if T:
        _topk_softmax_kernel[(T,)](logits, ids, w, E, logits.stride(0), K=k, KP=next_pow2(k), EP=max(16, next_pow2(E)),
                                   ALWAYS=always, num_warps=1, **pdl_args(logits))
    return ids, w


def rmsnorm_topk_softmax_ref(x, residual, norm_weight, eps: float, scale: float, router_weight, k: int,
                             dtype: torch.dtype | None = None, always: int = 0):
    normed, residual = rmsnorm_ref(x, residual, norm_weight, eps, scale=scale)
    return (normed, residual, *topk_softmax_ref(F.linear(normed, router_weight), k, dtype, always))


# Experts a program, router columns a step, warps: the best of 9 tiles at 1 and 8 tokens (at 16, 8 experts a program
# took 0.7 us less); from 17 rows 8 experts a program (granite's shape on an H200, moe.py --router-tiles: 7.08 against
# 7.52 us at 32 rows, 7.70 against 9.02 at 64)
ROUTE_TILES = {"BLOCK_E": 4, "BLOCK_K": 512, "num_warps": 4}
ROUTE_TILES_WIDE = {"BLOCK_E": 8, "BLOCK_K": 512, "num_warps": 4}


def route_tiles(rows: int) -> dict:
    """The fused router's tiles for ``rows`` rows (each set a compile: ``engine/warm_up.py`` runs both)."""
    return ROUTE_TILES if rows <= 16 else ROUTE_TILES_WIDE


def rmsnorm_topk_softmax(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                         scale: float, router_weight: torch.Tensor, k: int, dtype: torch.dtype | None = None, *,
                         always: int = 0, counters: torch.Tensor | None = None, force_triton: bool | None = None,
                         tiles: dict | None = None):
    """``(normed, new residual, ids, weights)``: ``kernels.rmsnorm(x, residual, norm_weight, eps, scale=scale)``, then
    ``topk_softmax(F.linear(normed, router_weight), k, dtype, always=always)``, in one launch (module docstring).
    ``counters``: int32 zeros, at least one per row, that the kernel leaves at zero (a caller that launches it
    often keeps one buffer; default a new one, a memset more). The residual is in x's dtype; other layouts and
    dtypes run the reference. ``tiles``: overrides of ``ROUTE_TILES`` / ``ROUTE_TILES_WIDE`` (benchmark sweeps)."""
    E, D = router_weight.shape
    fits = (x.dim() == 2 and x.shape[1] == D and x.is_contiguous() and router_weight.is_contiguous()
            and norm_weight.is_contiguous() and norm_weight.dtype == x.dtype == router_weight.dtype and 0 < k <= E
            and always >= 0
            and (residual is None or (residual.shape == x.shape and residual.is_contiguous()
                                      and residual.dtype == x.dtype)))
    if not (fits and use_triton(x, force_triton)):
        return rmsnorm_topk_softmax_ref(x, residual, norm_weight, eps, scale, router_weight, k, dtype, always)
    T = x.shape[0]
    normed, res_out = torch.empty_like(x), torch.empty_like(x)
    ids = torch.empty(T, k + always, dtype=torch.int32, device=x.device)
    w = torch.empty(T, k + always, dtype=dtype or x.dtype, device=x.device)
    if T == 0:
        return normed, res_out, ids, w
    if counters is None:
        counters = torch.zeros(T, dtype=torch.int32, device=x.device)
    elif counters.dtype != torch.int32 or counters.numel() < T:
        raise ValueError(f"rmsnorm_topk_softmax: counters {counters.dtype} [{counters.numel()}] must be int32, >= {T}")
    EP = max(16, next_pow2(E))
    logits = torch.empty(T, EP, dtype=torch.float32, device=x.device)
    pdl = pdl_args(x)
    if pdl:
        pdl["PREFETCH_LINES"] = prefetch_lines(D, router_weight.element_size())
    tiles = dict(route_tiles(T), **(tiles or {}))
    tiles["BLOCK_K"] = min(tiles["BLOCK_K"], next_pow2(D))
    r = residual if residual is not None else x
    _rmsnorm_topk_kernel[(T, triton.cdiv(E, tiles["BLOCK_E"]))](
        x, r, norm_weight, router_weight, normed, res_out, logits, counters, ids, w, D, E, float(eps), float(scale),
        x.stride(0), r.stride(0), normed.stride(0), res_out.stride(0), router_weight.stride(0), K=k, KP=next_pow2(k),
        EP=EP, BLOCK_D=next_pow2(D), ALWAYS=always, HAS_RES=residual is not None, **tiles, **pdl)
    return normed, res_out, ids, w
