"""Triton causal conv1d (varlen prefill, decode update) against the references, tiny shapes."""

import pytest
import torch

from mambaserve.kernels.conv1d import (causal_conv1d_update, causal_conv1d_update_ref, causal_conv1d_varlen,
                                       causal_conv1d_varlen_ref)
from mambaserve.kernels import KernelConfig
from tests.kernels.helpers import TOL, assert_close, gen, randn


@pytest.mark.parametrize("width", [2, 3, 4])
@pytest.mark.parametrize("tiles", [None, {"BLOCK_T": 8, "BLOCK_D": 8, "num_warps": 1, "STAGES": 2}])
def test_varlen_matches_reference_incl_sequences_shorter_than_width(dev, width, tiles):
    """Small tiles: several token blocks per sequence (each starts its window from x) and several
    channel blocks, the last partial."""
    config = KernelConfig(conv_varlen_tiles=tiles) if tiles else None
    lengths, Dm = [1, 2, 5, 40, 3], 12
    g = gen(width)
    x = randn(g, sum(lengths), Dm, dev=dev)
    w, b = randn(g, Dm, width, dev=dev), randn(g, Dm, dev=dev)
    pool = randn(g, 8, Dm, width - 1, dev=dev)
    ref_pool, before = pool.clone(), pool.clone()
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    slots = torch.tensor([6, 1, 3, 2, 7], device=dev)
    has = torch.tensor([True, True, False, True, False], device=dev)
    out = causal_conv1d_varlen(x, w, b, pool, cu, slots, has, force_triton=True, config=config)
    ref = causal_conv1d_varlen_ref(x, w, b, ref_pool, cu, slots, has)
    assert_close(out, ref, 1e-6)
    assert_close(pool, ref_pool, 1e-6)
    assert torch.equal(pool[0], before[0]) and torch.equal(pool[4], before[4])


@pytest.mark.parametrize("width", [2, 4])
def test_prefill_then_decode_equals_long_prefill_and_padding_rows(dev, width):
    Dm, L = 10, 6
    g = gen(10 + width)
    x = randn(g, L + 1, Dm, dtype=torch.bfloat16, dev=dev)
    w, b = randn(g, Dm, width, dev=dev), None
    long_pool = torch.zeros(3, Dm, width - 1, device=dev)
    one = torch.tensor([1], device=dev)
    no = torch.tensor([False], device=dev)
    long = causal_conv1d_varlen(x, w, b, long_pool, torch.tensor([0, L + 1], device=dev), one, no,
                                force_triton=True)
    pool = torch.zeros(3, Dm, width - 1, device=dev)
    pool[2] = 7.0
    causal_conv1d_varlen(x[:L], w, b, pool, torch.tensor([0, L], device=dev), one, no, force_triton=True)
    rows = torch.cat([x[L:], x[:1]])  # second row is padding
    step = causal_conv1d_update(rows, pool, w, b, torch.tensor([1, -1], device=dev), force_triton=True)
    assert step.dtype == torch.bfloat16
    assert_close(step[:1], long[L:], TOL[torch.bfloat16])
    assert not step[1].any()
    assert torch.equal(pool[1], long_pool[1]) and (pool[2] == 7.0).all() and not pool[0].any()


@pytest.mark.parametrize("width", [2, 3, 4])
def test_update_matches_reference(dev, width):
    Dm, rows = 300, 4  # more than one channel block
    g = gen(20 + width)
    x = randn(g, rows, Dm, dev=dev)
    w, b = randn(g, Dm, width, dev=dev), randn(g, Dm, dev=dev)
    pool = randn(g, 6, Dm, width - 1, dev=dev)
    ref_pool = pool.clone()
    idx = torch.tensor([5, -1, 0, 2], device=dev)
    out = causal_conv1d_update(x, pool, w, b, idx, activation=None, force_triton=True)
    ref = causal_conv1d_update_ref(x, ref_pool, w, b, idx, activation=None)
    assert_close(out, ref, 1e-6)
    assert torch.equal(pool, ref_pool)


def test_update_in_place(dev):
    """out=x writes the step over its input (the model's in_proj columns), as a separate output would."""
    Dm, K = 40, 4
    g = gen(30)
    proj = randn(g, 2, 3 + Dm, dev=dev)
    w, b = randn(g, Dm, K, dev=dev), randn(g, Dm, dev=dev)
    pool = randn(g, 3, Dm, K - 1, dev=dev)
    ref_pool = pool.clone()
    idx = torch.tensor([2, 0], device=dev)
    ref = causal_conv1d_update_ref(proj[:, 3:], ref_pool, w, b, idx)
    cols = proj[:, 3:]
    assert causal_conv1d_update(cols, pool, w, b, idx, out=cols, force_triton=True) is cols
    assert_close(proj[:, 3:], ref, 1e-6)
    assert torch.equal(pool, ref_pool)


def test_update_refuses_widths_past_the_register_window(dev):
    g = gen(31)
    x, b, idx = randn(g, 2, 8, dev=dev), randn(g, 8, dev=dev), torch.tensor([0, 1], device=dev)
    pool = randn(g, 2, 8, 5, dev=dev)
    before = pool.clone()
    with pytest.raises(ValueError, match="2 to 4"):
        causal_conv1d_update(x, pool, randn(g, 8, 6, dev=dev), b, idx, force_triton=True)
    assert torch.equal(pool, before)


@pytest.mark.parametrize("force_triton", [True, False])
def test_strided_input_equals_contiguous(dev, force_triton):
    """x as a column slice of a wider projection (the model's xBC): same outputs and states as a copy."""
    Dm, K, lengths = 20, 4, [3, 1, 9]
    g = gen(40)
    proj = randn(g, sum(lengths), 7 + Dm + 5, dtype=torch.bfloat16, dev=dev)
    x = proj[:, 7:7 + Dm]
    w, b = randn(g, Dm, K, dev=dev), randn(g, Dm, dev=dev)
    pool = randn(g, 5, Dm, K - 1, dtype=torch.bfloat16, dev=dev)
    pool_c = pool.clone()
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    slots, has = torch.tensor([4, 1, 2], device=dev), torch.tensor([True, False, True], device=dev)
    out = causal_conv1d_varlen(x, w, b, pool, cu, slots, has, force_triton=force_triton)
    out_c = causal_conv1d_varlen(x.contiguous(), w, b, pool_c, cu, slots, has, force_triton=force_triton)
    assert out.is_contiguous() and torch.equal(out, out_c) and torch.equal(pool, pool_c)
    step = proj[:4, 7:7 + Dm]  # decode rows, same layout
    idx = torch.tensor([2, -1, 4, 1], device=dev)
    y = causal_conv1d_update(step, pool, w, b, idx, force_triton=force_triton)
    y_c = causal_conv1d_update(step.contiguous(), pool_c, w, b, idx, force_triton=force_triton)
    assert y.is_contiguous() and torch.equal(y, y_c) and torch.equal(pool, pool_c)
    if force_triton:  # and the kernels on the strided view agree with the reference on it
        ref_pool = pool.clone()
        assert_close(causal_conv1d_update(step, pool, w, b, idx, force_triton=True),
                     causal_conv1d_update_ref(step, ref_pool, w, b, idx), TOL[torch.bfloat16])
        assert torch.equal(pool, ref_pool)


@pytest.mark.parametrize("force_triton", [True, False])
def test_padding_sequences_leave_every_slot_alone(dev, force_triton):
    """Prefill padding (prefill CUDA graphs): slot -1 sequences, one with tokens and empty ones, change no
    slot and nothing of the real sequences."""
    lengths, Dm, width = [3, 6], 8, 4
    g = gen(5)
    x = randn(g, sum(lengths) + 5, Dm, dev=dev)
    w, b = randn(g, Dm, width, dev=dev), randn(g, Dm, dev=dev)
    pool = randn(g, 3, Dm, width - 1, dev=dev)

    def run(lens, slots, has):
        p = pool.clone()
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
        fn = causal_conv1d_varlen if force_triton else causal_conv1d_varlen_ref
        kw = {"force_triton": True} if force_triton else {}
        out = fn(x[:sum(lens)], w, b, p, cu, torch.tensor(slots, device=dev), torch.tensor(has, device=dev), **kw)
        return out, p

    out_alone, alone = run(lengths, [0, 1], [True, False])
    out, padded = run(lengths + [5, 0], [0, 1, -1, -1], [True, False, False, False])
    assert torch.equal(padded, alone) and torch.equal(padded[2], pool[2])
    assert_close(out[:sum(lengths)], out_alone, 1e-6)


@pytest.mark.parametrize("width", [2, 3, 4])
@pytest.mark.parametrize("force_triton", [True, False])
def test_snapshot_before_the_last_token(dev, width, force_triton):
    """snap_slots: the conv state before each sequence's last token (older inputs from the initial state
    when the sequence is shorter than the window), written beside the usual final state."""
    lengths, D = [1, 2, 3, 7], 12
    cu = torch.tensor([0, 1, 3, 6, 13], dtype=torch.int32, device=dev)
    g = torch.Generator().manual_seed(width)
    x = torch.randn(13, D, generator=g).to(dev)
    w, b = torch.randn(D, width, generator=g).to(dev), torch.randn(D, generator=g).to(dev)
    pool = torch.randn(10, D, width - 1, generator=g).to(dev)
    before = pool.clone()
    slots, snaps = torch.tensor([0, 2, 4, 6], device=dev), torch.tensor([1, 3, -1, 7], device=dev)
    has = torch.tensor([True, True, False, True], device=dev)
    y = causal_conv1d_varlen(x, w, b, pool, cu, slots, has, snap_slots=snaps, force_triton=force_triton)
    plain = before.clone()
    assert torch.equal(y, causal_conv1d_varlen(x, w, b, plain, cu, slots, has, force_triton=force_triton))
    assert torch.equal(pool[slots], plain[slots])
    assert torch.equal(pool[5], before[5])
    for i, (s, n) in enumerate(zip(cu.tolist(), lengths)):
        if snaps[i] < 0:
            continue
        init = before[slots[i]] if has[i] else torch.zeros(D, width - 1, device=dev)
        full = torch.cat([init, x[s:s + n].t()], dim=1)  # inputs oldest first
        assert torch.equal(pool[snaps[i]], full[:, n - 1:n - 1 + width - 1])


@pytest.mark.parametrize("force_triton", [True, False])
def test_snapshot_before_token_j(dev, force_triton):
    """snap_len: the conv state before token j of each sequence (0: the initial state itself; older inputs from
    it when j is inside the window), the final states as without it."""
    lengths, D, width = [5, 9, 3], 8, 4
    cu = torch.tensor([0, 5, 14, 17], dtype=torch.int32, device=dev)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(17, D, generator=g).to(dev)
    w, b = torch.randn(D, width, generator=g).to(dev), torch.randn(D, generator=g).to(dev)
    pool = torch.randn(6, D, width - 1, generator=g).to(dev)
    before = pool.clone()
    slots, snaps, js = (torch.tensor(v, device=dev) for v in ([0, 2, 4], [1, 3, 5], [2, 7, 0]))
    has = torch.tensor([True, False, True], device=dev)
    y = causal_conv1d_varlen(x, w, b, pool, cu, slots, has, snap_slots=snaps, snap_len=js, force_triton=force_triton)
    plain = before.clone()
    assert torch.equal(y, causal_conv1d_varlen(x, w, b, plain, cu, slots, has, force_triton=force_triton))
    assert torch.equal(pool[slots], plain[slots])
    for i, (s, n) in enumerate(zip(cu.tolist(), lengths)):
        init = before[slots[i]] if has[i] else torch.zeros(D, width - 1, device=dev)
        full = torch.cat([init, x[s:s + n].t()], dim=1)
        j = int(js[i])
        assert torch.equal(pool[snaps[i]], full[:, j:j + width - 1])
