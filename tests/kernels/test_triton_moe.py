"""Fused MoE experts (``kernels/moe.py``) against the torch expert loop, tiny shapes (interpreter on CPU): the align
step position by position, then the whole op for SwiGLU (Granite) and relu2 (Nemotron-H) experts over routings that
spread, that crowd onto one or two experts, and that leave experts without a token."""

import pytest
import torch

from mambaserve.kernels import moe
from mambaserve.kernels.moe import (MOE_TILES, MoeAlignment, align_launch, launch_variant, moe_align, moe_align_ref,
                                    moe_experts, moe_experts_ref, moe_tiles, moe_warm_up, padded_capacity)
from tests.kernels.helpers import TOL, assert_close, gen, randn


def _routing(kind: str, T: int, k: int, E: int, g: torch.Generator) -> torch.Tensor:
    """``[T, k]`` distinct experts per token: ``spread`` random; ``crowded`` experts 0..k-1 for every token but the
    last (a long run for few experts, the rest empty); ``sparse`` only the upper half of the experts."""
    if kind == "crowded":
        ids = torch.arange(k).repeat(T, 1)
        ids[-1] = torch.arange(E - k, E)
        return ids
    lo = E // 2 if kind == "sparse" else 0
    return torch.stack([lo + torch.randperm(E - lo, generator=g)[:k] for _ in range(T)])


def _check_layout(al: MoeAlignment, ids: torch.Tensor, E: int) -> None:
    """Every pair exactly once, in its expert's block, in pair order within the expert; padding elsewhere."""
    N = ids.numel()
    pairs, bexp = al.sorted_pairs.cpu().long(), al.block_expert.cpu().long()
    assert pairs.numel() == padded_capacity(N, E, al.block_m) and bexp.numel() == pairs.numel() // al.block_m
    real = pairs < N
    assert sorted(pairs[real].tolist()) == list(range(N))
    flat = ids.reshape(-1).cpu().long()
    owner = bexp.repeat_interleave(al.block_m)
    assert (owner[real] == flat[pairs[real]]).all()
    for e in range(E):
        mine = pairs[real & (owner == e)]
        assert mine.tolist() == sorted(mine.tolist())
    used = bexp >= 0
    assert not used[used.long().sum():].any(), "unused blocks come last"
    assert (bexp[used][1:] > bexp[used][:-1]).sum() + 1 == len(set(flat.tolist())), "one run per expert with pairs"


# each routing through both align steps: a program per expert, and three launches ("split"; over 5 and 66 programs
# at (300, 2, 130) and (700, 6, 64))
@pytest.mark.parametrize("T,k,E,block_m", [(1, 1, 1, 16), (1, 6, 64, 16), (7, 2, 5, 16), (37, 3, 9, 16),
                                           (100, 2, 4, 32), (300, 2, 130, 16), (700, 6, 64, 16)])
@pytest.mark.parametrize("kind", ["spread", "crowded", "sparse"])
@pytest.mark.parametrize("split", [False, True])
def test_align_matches_reference_and_groups_by_expert(dev, T, k, E, block_m, kind, split, monkeypatch):
    if kind != "spread" and E < 2 * k:
        pytest.skip("needs experts to spare")
    monkeypatch.setattr(moe, "ALIGN_PER_EXPERT_MAX_PAIRS", 0 if split else 10 ** 9)
    assert align_launch(T * k, E)["kernel"] == ("split" if split else "per_expert")
    ids = _routing(kind, T, k, E, gen(T * E + k)).to(dev)
    ref = moe_align_ref(ids, E, block_m)
    _check_layout(ref, ids, E)
    tri = moe_align(ids, E, block_m, force_triton=True)
    assert torch.equal(tri.sorted_pairs.cpu(), ref.sorted_pairs.cpu())
    assert torch.equal(tri.block_expert.cpu(), ref.block_expert.cpu())


def _case(T, k, E, H, I, gated, kind, dtype, dev, seed):
    g = gen(seed)
    x = randn(g, T, H, dtype=dtype, dev=dev)
    w1 = randn(g, E, 2 * I if gated else I, H, dtype=dtype, dev=dev, scale=H ** -0.5)
    w2 = randn(g, E, H, I, dtype=dtype, dev=dev, scale=I ** -0.5)
    ids = _routing(kind, T, k, E, g).to(dev)
    wts = torch.softmax(randn(g, T, k), -1).to(dev)
    return x, ids, wts, w1, w2


# Granite (SwiGLU, softmax weights) and Nemotron-H (relu2, non-gated) experts; dims below, across and at multiples
# of the 16-wide tiles (the EVEN_K path); one expert; top-1; tokens crowding onto few experts, experts left empty
@pytest.mark.parametrize("act,gated", [("silu", True), ("relu2", False)])
@pytest.mark.parametrize("T,k,E,H,I,kind", [
    (1, 2, 4, 24, 12, "spread"), (5, 1, 1, 32, 16, "spread"), (9, 3, 7, 40, 20, "spread"),
    (37, 2, 6, 32, 48, "crowded"), (20, 2, 8, 24, 12, "sparse"), (3, 4, 16, 16, 8, "spread")])
def test_experts_match_reference(dev, act, gated, T, k, E, H, I, kind):
    x, ids, wts, w1, w2 = _case(T, k, E, H, I, gated, kind, torch.float32, dev, seed=T + E + H)
    out = moe_experts(x, ids, wts, w1, w2, act=act, gated=gated, force_triton=True)
    assert out.shape == (T, H) and out.dtype == torch.float32
    assert_close(out, moe_experts_ref(x, ids, wts, w1, w2, act=act, gated=gated), TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("act,gated", [("silu", True), ("relu2", False)])
def test_experts_half_precision(dev, dtype, act, gated):
    x, ids, wts, w1, w2 = _case(11, 2, 5, 40, 24, gated, "spread", dtype, dev, seed=3)
    out = moe_experts(x, ids, wts.to(dtype), w1, w2, act=act, gated=gated, force_triton=True)
    assert out.dtype == dtype
    # the oracle: the loop in fp32 on the same (rounded) inputs
    ref = moe_experts_ref(x.float(), ids, wts.to(dtype).float(), w1.float(), w2.float(), act=act, gated=gated)
    assert_close(out, ref, TOL[dtype])


def test_experts_across_several_row_blocks_and_tile_overrides(dev):
    """40 tokens on 2 experts: several 16-row blocks per expert; a 32-row BLOCK_M takes the same pairs."""
    x, ids, wts, w1, w2 = _case(40, 2, 3, 24, 12, True, "crowded", torch.float32, dev, seed=5)
    ref = moe_experts_ref(x, ids, wts, w1, w2)
    for tiles in (None, {"block_m": 32, "up_block_k": 32, "down_block_n": 32}):
        assert_close(moe_experts(x, ids, wts, w1, w2, force_triton=True, tiles=tiles), ref, TOL[torch.float32])


@pytest.mark.parametrize("act,gated", [("silu", True), ("relu2", False)])
def test_direct_blocks_without_align(dev, act, gated):
    """One token runs without the align step (a block per pair); forced on, several tokens sharing experts give
    the same sums, and one token forced through the align step too."""
    for T, kind, direct in ((1, "spread", None), (1, "spread", False), (9, "crowded", True), (5, "spread", True)):
        x, ids, wts, w1, w2 = _case(T, 3, 6, 40, 20, gated, kind, torch.float32, dev, seed=T + 20)
        tiles = None if direct is None else {"direct": direct}
        out = moe_experts(x, ids, wts, w1, w2, act=act, gated=gated, force_triton=True, tiles=tiles)
        assert_close(out, moe_experts_ref(x, ids, wts, w1, w2, act=act, gated=gated), TOL[torch.float32])


def test_experts_strided_inputs_and_int32_ids(dev):
    """Non-contiguous x (a column slice) and routing tensors (transposed views) are read through their strides;
    int32 expert ids (what fused top-k kernels produce) route like int64 ones."""
    x, ids, wts, w1, w2 = _case(6, 2, 4, 24, 12, True, "spread", torch.float32, dev, seed=8)
    ref = moe_experts_ref(x, ids, wts, w1, w2)
    wide = torch.cat([x, x], 1)[:, 24:]
    ids_t, wts_t = ids.t().contiguous().t(), wts.t().contiguous().t()
    assert_close(moe_experts(wide, ids_t, wts_t, w1, w2, force_triton=True), ref, TOL[torch.float32])
    assert_close(moe_experts(x, ids.int(), wts, w1, w2, force_triton=True), ref, TOL[torch.float32])
    assert_close(moe_experts_ref(x, ids.int(), wts, w1, w2), ref, TOL[torch.float32])


@pytest.mark.parametrize("T", [1, 7])
def test_epilogue_adds_a_shared_output_and_a_scaled_residual(dev, T):
    """``residual + scale * (sum + add)`` (Granite's layer tail) in the sum kernel, one token (direct) or several."""
    x, ids, wts, w1, w2 = _case(T, 2, 4, 24, 12, True, "spread", torch.float32, dev, seed=T + 40)
    g = gen(T)
    add, res = randn(g, T, 24, dev=dev), randn(g, T, 24, dev=dev)
    plain = moe_experts_ref(x, ids, wts, w1, w2)
    ref = moe_experts_ref(x, ids, wts, w1, w2, add=add, residual=res, scale=0.22)
    assert_close(ref, res + 0.22 * (plain + add), TOL[torch.float32])
    assert_close(moe_experts(x, ids, wts, w1, w2, add=add, residual=res, scale=0.22, force_triton=True), ref,
                 TOL[torch.float32])
    assert_close(moe_experts(x, ids, wts, w1, w2, add=add, force_triton=True), plain + add, TOL[torch.float32])
    with pytest.raises(ValueError):
        moe_experts(x, ids, wts, w1, w2, residual=res[:, :8], force_triton=True)


@pytest.mark.parametrize("T", [1, 5])
def test_a_gated_mlp_folded_in_as_more_experts_adds_its_output(dev, T):
    """``fold_gated_mlp``: a dense SwiGLU MLP twice the experts' width stacked after them as two more, every token
    routed to those too with weight 1 (``topk_softmax(always=2)``): the op's output is the experts' sum plus the
    MLP's (Granite's decode); a width that is no multiple of the experts' does not fold."""
    x, ids, wts, w1, w2 = _case(T, 2, 4, 24, 12, True, "spread", torch.float32, dev, seed=T + 50)
    g = gen(T + 60)
    mlp_w1, mlp_w2 = randn(g, 48, 24, dev=dev, scale=24 ** -0.5), randn(g, 24, 24, dev=dev, scale=24 ** -0.5)
    f1, f2 = moe.fold_gated_mlp(w1, w2, mlp_w1, mlp_w2)
    assert f1.shape == (6, 24, 24) and f2.shape == (6, 24, 12)
    assert torch.equal(f1[:4], w1) and torch.equal(f2[:4], w2)
    gate, up = mlp_w1.split(24)
    mlp = (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ mlp_w2.T
    ids_f = torch.cat([ids, torch.tensor([4, 5], device=dev).expand(T, 2)], 1)
    wts_f = torch.cat([wts, torch.ones(T, 2, device=dev)], 1)
    want = moe_experts_ref(x, ids, wts, w1, w2, add=mlp)
    assert_close(moe_experts(x, ids_f, wts_f, f1, f2, force_triton=True), want, TOL[torch.float32])
    assert moe.fold_gated_mlp(w1, w2, mlp_w1[:40], mlp_w2[:, :20]) is None


def test_experts_zero_tokens_and_bad_arguments(dev):
    x, ids, wts, w1, w2 = _case(3, 2, 4, 16, 8, True, "spread", torch.float32, dev, seed=1)
    empty = moe_experts(x[:0], ids[:0], wts[:0], w1, w2, force_triton=True)
    assert empty.shape == (0, 16)
    for kw in (dict(act="gelu"), dict(gated=False)):  # unknown activation; non-gated w1 must be [E, I, H]
        with pytest.raises(ValueError):
            moe_experts(x, ids, wts, w1, w2, force_triton=True, **kw)
        with pytest.raises(ValueError):
            moe_experts_ref(x, ids, wts, w1, w2, **kw)
    with pytest.raises(ValueError):
        moe_experts(x, ids[:, :1], wts, w1, w2, force_triton=True)


def test_warm_up_runs_one_batch_per_launch_variant_up_to_its_token_count(dev):
    """Start-up compiles: one token (no align step), then a token count per variant the launcher can pick (tile rows,
    align programs) up to the most tokens a step takes; where the torch loop runs there is nothing to compile."""
    from mambaserve.kernels._dispatch import H100

    _, _, _, w1, w2 = _case(1, 2, 4, 16, 8, True, "spread", torch.float32, dev, seed=2)
    variants = {launch_variant(T, 2, 4, H100 if dev == "cuda" else _interpreter()) for T in range(1, 41)}
    assert moe_warm_up(w1, w2, 2, 40, force_triton=True) == len(variants) >= 2  # one token, then the rest
    assert moe_warm_up(w1, w2, 2, 40, force_triton=False) == 0
    # granite-4.0-h-tiny (64 experts, top-6) on an H100 up to 2048 tokens: every MOE_TILES row, one token alone
    # (direct), and both align steps
    granite = {launch_variant(T, 6, 64, H100) for T in range(1, 2049)}
    assert {dict(v[0])["block_m"] for v in granite} == {t["block_m"] for _, t in MOE_TILES}
    assert sum(v[1] for v in granite) == 1
    assert {dict(v[2])["kernel"] for v in granite if v[2]} == {"per_expert", "split"}
    assert len(granite) <= 8  # a few seconds of compiles at start


def _interpreter():
    from mambaserve.kernels._dispatch import Target

    return Target(compiled=False)


def test_tiles_fit_shared_memory_for_fp32_weights():
    """The GPU tiles are sized for bf16; fp32 weights (a model served in float32) take twice the room, so their
    stages or K steps shrink until a program's staged tiles fit (an sm_90 block would refuse them otherwise)."""
    from mambaserve.kernels.moe import STAGED_BYTES

    for bound, row in MOE_TILES:
        pairs = 64 * int(bound or 200)
        assert moe_tiles(pairs, 64) == row  # bf16: as swept
        t = moe_tiles(pairs, 64, elsize=4)
        for part, b in (("up", 2), ("down", 1)):
            staged = (t["block_m"] + b * t[f"{part}_block_n"]) * t[f"{part}_block_k"] * 4 * t[f"{part}_stages"]
            assert staged <= STAGED_BYTES and t[f"{part}_stages"] >= 2


@pytest.mark.parametrize("act,gated", [("silu", True), ("relu2", False)])
@pytest.mark.parametrize("T,k,E,H,I,kind", [(37, 2, 6, 32, 48, "crowded"), (9, 3, 7, 40, 20, "spread")])
def test_tma_weight_tiles_match_reference(dev, act, gated, T, k, E, H, I, kind):
    """Prefill's tiles read the weights (and the down projection its rows) through TMA descriptors: a tile past an
    expert's rows reads the next expert's (masked on store), past K zeros; widths here cross both."""
    from mambaserve.kernels.moe import _descriptors

    x, ids, wts, w1, w2 = _case(T, k, E, H, I, gated, kind, torch.float32, dev, seed=T + H)
    tiles = {**moe_tiles(T * k, E, dev == "cuda", elsize=4), "tma": True}
    assert _descriptors(tiles, w1, w2, torch.empty(64, I, device=dev)) is not None
    out = moe_experts(x, ids, wts, w1, w2, act=act, gated=gated, force_triton=True, tiles=tiles)
    assert_close(out, moe_experts_ref(x, ids, wts, w1, w2, act=act, gated=gated), TOL[torch.float32])
