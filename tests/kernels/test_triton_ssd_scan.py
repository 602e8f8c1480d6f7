"""Triton SSD scan against its reference (and the fp64 recurrence), tiny shapes (interpreter on CPU)."""

import pytest
import torch

from mambaserve.kernels.ssd_scan import ssd_scan_varlen, ssd_scan_varlen_ref
from mambaserve.kernels.selective_state_update import selective_state_update
from tests.kernels.helpers import TOL, assert_close, gen, randn
from tests.kernels.oracle import ssm_recurrence

Q = 16  # smallest chunk the Triton tiles take (tl.dot needs 16)
LENGTHS = [1, 3, Q - 1, Q, Q + 1, 3 * Q + 5]


def _inputs(T, H, P, G, N, seed, dev, dtype=torch.float32):
    g = gen(seed)
    x, dt = randn(g, T, H, P, dtype=dtype, dev=dev), randn(g, T, H, dev=dev)
    A = (-torch.rand(H, generator=g) * 2 - 0.1).to(dev)
    B, C = randn(g, T, G, N, dtype=dtype, dev=dev), randn(g, T, G, N, dtype=dtype, dev=dev)
    return x, dt, A, B, C, randn(g, H, dev=dev), randn(g, H, dev=dev)


def _run(fn, x, dt, A, B, C, lengths, pool, slots, has_init, starts, D, bias, **kw):
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=x.device)
    return fn(x, dt, A, B, C, chunk_size=Q, cu_seqlens=cu, ssm_state=pool, state_indices=slots,
              has_initial_state=has_init, seq_start_pos=starts, D=D, dt_bias=bias, **kw)


@pytest.mark.parametrize("groups,init", [(1, True), (2, False), (4, True), (8, True)])
def test_packed_lengths_match_reference_and_recurrence(dev, groups, init):
    H, P, N, S = 8, 4, 5, len(LENGTHS)
    T = sum(LENGTHS)
    x, dt, A, B, C, D, bias = _inputs(T, H, P, groups, N, groups, dev)
    pool = torch.randn(S + 2, H, P, N, generator=gen(9)).to(dev)
    before = pool.clone()
    slots = torch.tensor([3, 1, 6, 2, 7, 4], device=dev)
    has = torch.tensor([init and i % 2 == 0 for i in range(S)], device=dev)
    starts = torch.tensor([0, 5, 2 * Q + 3, Q, 1, 7], device=dev)  # mid-chunk and on boundaries
    y, bnd = _run(ssd_scan_varlen, x, dt, A, B, C, LENGTHS, pool, slots, has, starts, D, bias,
                  return_boundary_states=True, force_triton=True)
    ref_pool = before.clone()
    y_ref, bnd_ref = _run(ssd_scan_varlen_ref, x, dt, A, B, C, LENGTHS, ref_pool, slots, has, starts, D, bias,
                          return_boundary_states=True)
    assert_close(y, y_ref, 1e-5)
    assert_close(pool, ref_pool, 1e-5)
    assert torch.equal(pool[0], before[0]) and torch.equal(pool[5], before[5])  # untouched slots
    assert torch.equal(bnd.seq_idx, bnd_ref.seq_idx) and torch.equal(bnd.positions, bnd_ref.positions)
    assert_close(bnd.states, bnd_ref.states, 1e-5)
    # and against the fp64 recurrence, per sequence, at absolute positions k*Q
    cu = [0] + torch.tensor(LENGTHS).cumsum(0).tolist()
    for i in range(S):
        s, e = cu[i], cu[i + 1]
        init_state = before[slots[i]].cpu() if has[i] else None
        ry, rs = ssm_recurrence(x[s:e].cpu(), dt[s:e].cpu(), A.cpu(), B[s:e].cpu(), C[s:e].cpu(), D.cpu(),
                                init_state, bias.cpu())
        assert_close(y[s:e].cpu(), ry, 1e-5)
        assert_close(pool[slots[i]].cpu(), rs[-1], 1e-5)
        for k in (bnd.seq_idx == i).nonzero().flatten().tolist():
            assert_close(bnd.states[k].cpu(), rs[bnd.positions[k] - starts[i].item() - 1], 1e-5)


@pytest.mark.parametrize("cut", [1, Q - 1, Q, Q + 3, 2 * Q + 5])
def test_split_and_resume_equals_one_pass(dev, cut):
    L, H, P, G, N = 3 * Q + 5, 2, 4, 1, 4
    x, dt, A, B, C, D, bias = _inputs(L, H, P, G, N, 1, dev)
    one = torch.zeros(2, H, P, N, device=dev)
    slot, no, yes = torch.tensor([1], device=dev), torch.tensor([False], device=dev), torch.tensor([True], device=dev)
    y1, b1 = _run(ssd_scan_varlen, x, dt, A, B, C, [L], one, slot, no, None, D, bias,
                  return_boundary_states=True, force_triton=True)
    two = torch.zeros(2, H, P, N, device=dev)
    ya, ba = _run(ssd_scan_varlen, x[:cut], dt[:cut], A, B[:cut], C[:cut], [cut], two, slot, no,
                  torch.tensor([0], device=dev), D, bias, return_boundary_states=True, force_triton=True)
    yb, bb = _run(ssd_scan_varlen, x[cut:], dt[cut:], A, B[cut:], C[cut:], [L - cut], two, slot, yes,
                  torch.tensor([cut], device=dev), D, bias, return_boundary_states=True, force_triton=True)
    assert_close(torch.cat([ya, yb]), y1, 1e-5)
    assert_close(two, one, 1e-5)
    # boundary states at absolute k*Q, also when the prefix is not a multiple of Q
    assert torch.cat([ba.positions, bb.positions]).tolist() == b1.positions.tolist() == [Q, 2 * Q, 3 * Q]
    assert_close(torch.cat([ba.states, bb.states]), b1.states, 1e-5)


def test_prefill_then_decode_equals_long_prefill(dev):
    L, H, P, G, N = Q + 3, 4, 4, 2, 4
    x, dt, A, B, C, D, bias = _inputs(L + 1, H, P, G, N, 2, dev)
    z = randn(gen(3), L + 1, H, P, dev=dev)
    slot, no = torch.tensor([1], device=dev), torch.tensor([False], device=dev)
    long_pool = torch.zeros(2, H, P, N, device=dev)
    y_long, _ = _run(ssd_scan_varlen, x, dt, A, B, C, [L + 1], long_pool, slot, no, None, D, bias,
                     force_triton=True)
    pool = torch.zeros(2, H, P, N, device=dev)
    _run(ssd_scan_varlen, x[:L], dt[:L], A, B[:L], C[:L], [L], pool, slot, no, None, D, bias, force_triton=True)
    y_dec = selective_state_update(pool, x[L:], dt[L:], A, B[L:], C[L:], D, None, bias, state_indices=slot,
                                   force_triton=True)
    assert_close(y_dec, y_long[L:], 1e-5)
    assert_close(pool, long_pool, 1e-5)
    del z


@pytest.mark.parametrize("chunk,tiles", [(Q, None), (4 * Q, dict(block_m=16, block_k=16)),
                                         (4 * Q, dict(block_m=32, block_k=16)),
                                         (4 * Q, dict(chunk=2 * Q, block_m=16, block_k=16))])
def test_extreme_decay_and_dt_range_are_finite(dev, chunk, tiles):
    """Decays down to exp(-480) per token, also across the row blocks of a chunk (second case: the
    output kernel's factored weights for tokens before a row block)."""
    L, H, P, G, N = 2 * Q + 3, 2, 4, 1, 4
    x, _, _, B, C, D, _ = _inputs(L, H, P, G, N, 4, dev)
    dt = torch.full((L, H), 10.0, device=dev)
    dt[::3] = -30.0
    dt[1::5] = 30.0
    A = torch.tensor([-16.0, -0.01], device=dev)
    pool = torch.full((3, H, P, N), float("nan"), device=dev)  # poison: slot 2 must stay untouched
    pool[1] = 0
    y, bnd = ssd_scan_varlen(x, dt, A, B, C, chunk_size=chunk, cu_seqlens=torch.tensor([0, L], device=dev),
                             ssm_state=pool, state_indices=torch.tensor([1], device=dev),
                             has_initial_state=torch.tensor([False], device=dev), D=D,
                             return_boundary_states=True, force_triton=True, tiles=tiles)
    assert torch.isfinite(y).all() and torch.isfinite(pool[1]).all() and torch.isfinite(bnd.states).all()
    assert pool[2].isnan().all()
    ry, rs = ssm_recurrence(x.cpu(), dt.cpu(), A.cpu(), B.cpu(), C.cpu(), D.cpu())
    assert_close(y.cpu(), ry, 1e-5)
    assert_close(pool[1].cpu(), rs[-1], 1e-5)


def test_bf16_inputs_and_state(dev):
    lengths = [Q + 1, 5]
    H, P, G, N = 4, 16, 1, 16
    x, dt, A, B, C, D, bias = _inputs(sum(lengths), H, P, G, N, 5, dev, dtype=torch.bfloat16)
    pool = torch.randn(3, H, P, N, generator=gen(6)).to(torch.bfloat16).to(dev)
    ref_pool = pool.clone()
    args = (x, dt, A, B, C, lengths)
    rest = (torch.tensor([2, 0], device=dev), torch.tensor([True, False], device=dev), None, D, bias)
    y, _ = _run(ssd_scan_varlen, *args, pool, *rest, force_triton=True)
    y_ref, _ = _run(ssd_scan_varlen_ref, *args, ref_pool, *rest)
    assert y.dtype == torch.bfloat16 and pool.dtype == torch.bfloat16
    assert_close(y, y_ref, TOL[torch.bfloat16])
    assert_close(pool, ref_pool, TOL[torch.bfloat16])


@pytest.mark.parametrize("tiles", [
    # several output row blocks per chunk, C.B^T tiles as small as them, P split over two output programs,
    # N over two slices there, the state split over 2 x 2 programs (the last ones partial)
    dict(block_m=16, block_k=16, block_p=16, block_n=16, cb_tile=16, state_block_p=16, state_block_n=16,
         state_block_k=16),
    # several k blocks in the diagonal; the state kernel's token blocks unrolled, its chunk loop pipelined
    dict(block_m=32, block_k=16, num_stages=3, state_block_k=16, state_unroll=True, state_stages=2),
    # the kernels' chunks half the model's: boundary states after every other chunk (and the prep kernel's
    # heads in two blocks)
    dict(chunk=Q, block_m=16, block_k=16, state_block_k=16, state_unroll=False, prep_heads=2),
    dict(chunk=Q, block_m=16, block_k=16, state_block_k=16),
])
def test_tile_configs_match_reference(dev, tiles):
    Q2 = 2 * Q
    lengths = [1, Q2 - 1, Q2 + 1, 3 * Q2 + 5, 7]
    H, P, G, N, S = 4, 20, 2, 24, len(lengths)
    T = sum(lengths)
    x, dt, A, B, C, D, bias = _inputs(T, H, P, G, N, 11, dev)
    pool = torch.randn(S + 2, H, P, N, generator=gen(12)).to(dev)
    ref_pool = pool.clone()
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    kw = dict(chunk_size=Q2, cu_seqlens=cu, state_indices=torch.tensor([2, 0, 5, 1, 6], device=dev),
              has_initial_state=torch.tensor([True, False, True, True, False], device=dev),
              seq_start_pos=torch.tensor([3, 0, Q2 + 7, 5, Q2 - 1], device=dev), D=D, dt_bias=bias,
              return_boundary_states=True)
    y, bnd = ssd_scan_varlen(x, dt, A, B, C, ssm_state=pool, force_triton=True, tiles=tiles, **kw)
    y_ref, bnd_ref = ssd_scan_varlen_ref(x, dt, A, B, C, ssm_state=ref_pool, **kw)
    assert_close(y, y_ref, 1e-5)
    assert_close(pool, ref_pool, 1e-5)
    assert torch.equal(bnd.positions, bnd_ref.positions) and torch.equal(bnd.seq_idx, bnd_ref.seq_idx)
    assert_close(bnd.states, bnd_ref.states, 1e-5)


def test_kernel_chunk_must_be_a_power_of_two(dev):
    x, dt, A, B, C, D, bias = _inputs(5, 2, 4, 1, 4, 1, dev)
    pool = torch.zeros(2, 2, 4, 4, device=dev)
    with pytest.raises(ValueError, match="power of two"):
        _run(ssd_scan_varlen, x, dt, A, B, C, [5], pool, torch.tensor([1], device=dev),
             torch.tensor([False], device=dev), None, D, bias, force_triton=True, tiles=dict(chunk=12))


@pytest.mark.parametrize("tiles", [
    # tiles through TMA tensor descriptors (the interpreter emulates them), two row blocks per chunk and the
    # diagonal's x tile reused for the D term; then the same through pointers; then k blocks smaller than
    # the row blocks and a C.B^T tile larger than them
    dict(block_m=16, block_k=16, block_p=16, block_n=16, state_block_p=16, state_block_n=16, state_block_k=16,
         tma_min_tokens=0),
    dict(block_m=16, block_k=16, block_p=16, block_n=16, state_block_p=16, state_block_n=16, state_block_k=16),
    dict(block_m=32, block_k=16, block_p=16, block_n=32, cb_tile=32, state_block_p=16, state_block_n=16,
         state_block_k=16, tma_min_tokens=0),
])
def test_output_weights_factored_or_exact_per_block(dev, tiles):
    """Heads from slow to fast decay, so row blocks take both output paths: weights factored through the
    block's middle row (cs spans < 60 on each side of it) and exact pairwise weights (it does not), with
    blocks where only the span across the middle row or only one side decides."""
    Q2, H, P, G, N = 2 * Q, 4, 16, 2, 32
    lengths = [2 * Q2 + 5, Q2 - 3, 9]
    T = sum(lengths)
    x, dt, A, B, C, D, bias = _inputs(T, H, P, G, N, 21, dev)
    A = torch.tensor([-0.05, -1.0, -3.5, -8.0], device=dev)
    dt = dt.abs() * torch.tensor([1.0, 1.5, 1.0, 1.2], device=dev)  # with bias 0 below: dt = softplus(|n|) > 0.69
    pool = torch.randn(len(lengths) + 1, H, P, N, generator=gen(22)).to(dev)
    before = pool.clone()
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    kw = dict(chunk_size=Q2, cu_seqlens=cu, state_indices=torch.tensor([2, 0, 3], device=dev),
              has_initial_state=torch.tensor([True, False, True], device=dev),
              seq_start_pos=torch.tensor([0, 7, Q2 + 1], device=dev), D=D, dt_bias=torch.zeros(H, device=dev))
    y, _ = ssd_scan_varlen(x, dt, A, B, C, ssm_state=pool, force_triton=True, tiles=tiles, **kw)
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        slot = kw["state_indices"][i].item()
        init = before[slot].cpu() if kw["has_initial_state"][i] else None
        ry, rs = ssm_recurrence(x[s:e].cpu(), dt[s:e].cpu(), A.cpu(), B[s:e].cpu(), C[s:e].cpu(), D.cpu(), init,
                                kw["dt_bias"].cpu())
        assert_close(y[s:e].cpu(), ry, 1e-5)
        assert_close(pool[slot].cpu(), rs[-1], 1e-5)


@pytest.mark.parametrize("impl", ["triton", "ref"])
def test_tracked_boundary_states_only(dev, impl):
    """``track`` returns (and writes) only the asked boundary states, in the asked order, equal to the full
    set's; a position that is not a boundary of the call is refused."""
    lengths = [3 * Q + 5, 2 * Q, 7]
    H, P, G, N = 2, 4, 1, 4
    x, dt, A, B, C, D, bias = _inputs(sum(lengths), H, P, G, N, 31, dev)
    fn = (lambda *a, **k: ssd_scan_varlen(*a, force_triton=True, **k)) if impl == "triton" else ssd_scan_varlen_ref
    slots, has = torch.tensor([1, 2, 3], device=dev), torch.tensor([True, False, True], device=dev)
    starts = torch.tensor([Q - 2, 0, 3 * Q - 1], device=dev)
    pool = torch.randn(4, H, P, N, generator=gen(32)).to(dev)
    y_all, all_ = _run(fn, x, dt, A, B, C, lengths, pool.clone(), slots, has, starts, D, bias,
                       return_boundary_states=True)
    pairs = list(zip(all_.seq_idx.tolist(), all_.positions.tolist()))
    track = [pairs[3], pairs[0], pairs[-1]]  # 3 of the call's boundaries, out of order, in two sequences
    y, some = _run(fn, x, dt, A, B, C, lengths, pool.clone(), slots, has, starts, D, bias, track=track)
    assert len(pairs) > len(track)
    assert list(zip(some.seq_idx.tolist(), some.positions.tolist())) == track
    assert torch.equal(some.states, all_.states[[3, 0, len(pairs) - 1]]) and torch.equal(y, y_all)
    with pytest.raises(ValueError, match="not a chunk boundary"):
        _run(fn, x, dt, A, B, C, lengths, pool.clone(), slots, has, starts, D, bias, track=[(0, Q + 1)])


@pytest.mark.parametrize("impl", ["triton", "ref"])
def test_padding_sequences_leave_every_slot_alone(dev, impl):
    """The prefill CUDA graphs pad a batch with slot -1 sequences (one holding the padding tokens, the
    rest empty): the real sequences' outputs and states are as without them, and no slot changes."""
    H, P, N, lengths = 4, 4, 16, [5, Q + 3]
    x, dt, A, B, C, D, bias = _inputs(sum(lengths) + 7, H, P, 1, N, 11, dev)
    pool = torch.randn(4, H, P, N, generator=gen(3)).to(dev)
    kw = {"force_triton": True} if impl == "triton" else {}
    fn = ssd_scan_varlen if impl == "triton" else ssd_scan_varlen_ref
    alone = pool.clone()
    y_alone, _ = _run(fn, x[:sum(lengths)], dt[:sum(lengths)], A, B[:sum(lengths)], C[:sum(lengths)], lengths,
                      alone, torch.tensor([2, 0], device=dev), torch.tensor([True, False], device=dev),
                      torch.tensor([4, 0], device=dev), D, bias, **kw)
    padded = pool.clone()
    y, _ = _run(fn, x, dt, A, B, C, lengths + [7, 0, 0], padded, torch.tensor([2, 0, -1, -1, -1], device=dev),
                torch.tensor([True, False, False, False, False], device=dev), torch.tensor([4, 0, 0, 0, 0], device=dev),
                D, bias, **kw)
    assert torch.equal(padded, alone)  # slots 1 and 3 (and the last, -1 from the end) untouched
    assert torch.equal(padded[[1, 3]], pool[[1, 3]])
    assert_close(y[:sum(lengths)], y_alone, 1e-6)


@pytest.mark.parametrize("impl", ["triton", "ref"])
def test_snapshot_before_the_last_token_equals_a_pass_without_it(dev, impl):
    """snap_slots: each sequence's state before its last token lands in its snapshot slot, as a pass over
    all its tokens but the last would leave it; the rest of the call is unchanged. Lengths cover one
    token (the snapshot is the initial state), a last token that opens a chunk, and several chunks;
    starts cover mid-chunk resumes."""
    fn = ssd_scan_varlen if impl == "triton" else ssd_scan_varlen_ref
    kw = {"force_triton": True} if impl == "triton" else {}
    lengths = [1, Q + 1, 3, 2 * Q + 5, 2 * Q + 7]
    starts = torch.tensor([4, 0, Q - 2, Q - 5, 0], device=dev)  # the fourth ends on a boundary (3Q)
    has = torch.tensor([True, False, True, True, False], device=dev)
    H, P, G, N, S = 4, 4, 2, 5, len(lengths)
    x, dt, A, B, C, D, bias = _inputs(sum(lengths), H, P, G, N, 3, dev)
    pool = torch.randn(2 * S + 2, H, P, N, generator=gen(4)).to(dev)
    before = pool.clone()
    slots = torch.tensor([1, 3, 5, 7, 9], device=dev)
    snaps = torch.tensor([2, 4, -1, 8, 10], device=dev)
    y, bnd = _run(fn, x, dt, A, B, C, lengths, pool, slots, has, starts, D, bias, snap_slots=snaps,
                  return_boundary_states=True, **kw)
    plain = before.clone()
    y_plain, bnd_plain = _run(fn, x, dt, A, B, C, lengths, plain, slots, has, starts, D, bias,
                              return_boundary_states=True, **kw)
    assert torch.equal(y, y_plain)
    assert (3, 3 * Q) in zip(bnd.seq_idx.tolist(), bnd.positions.tolist())
    assert_close(bnd.states, bnd_plain.states, 1e-5)
    # final states: as without snapshots (a snapshotted sequence's last token is folded in apart: rounding)
    assert torch.equal(pool[slots[snaps < 0]], plain[slots[snaps < 0]])
    assert_close(pool[slots], plain[slots], 1e-5)
    cu = [0] + torch.tensor(lengths).cumsum(0).tolist()
    for i in range(S):
        if snaps[i] < 0:
            assert torch.equal(pool[6], before[6])  # no snapshot asked for: its neighbour slot untouched
            continue
        keep = [k for k in range(cu[-1]) if k != cu[i + 1] - 1]  # every token but sequence i's last
        short = list(lengths)
        short[i] -= 1
        ref = before.clone()
        _run(ssd_scan_varlen_ref, x[keep], dt[keep], A, B[keep], C[keep], short, ref, slots, has, starts, D, bias)
        assert_close(pool[snaps[i]], ref[slots[i]], 1e-5)


@pytest.mark.parametrize("impl", ["triton", "ref"])
def test_snapshot_inside_the_last_chunk_equals_a_pass_over_its_tokens(dev, impl):
    """snap_len: the state after each sequence's first j tokens of the call (a hybrid's page boundary before its
    last token), in the last chunk: at its first token, in its middle, before its last token; the final states
    and outputs are those of a pass without snapshots."""
    fn = ssd_scan_varlen if impl == "triton" else ssd_scan_varlen_ref
    kw = {"force_triton": True} if impl == "triton" else {}
    lengths = [9, Q + 12, 2 * Q + 5, 6]
    starts = torch.tensor([3, 0, Q - 5, Q + 2], device=dev)
    has = torch.tensor([True, False, True, True], device=dev)
    # sequence 0: j = 4 (mid-chunk, resumed at 3); 1: j = Q, the last chunk's first token; 2: one before the last;
    # 3: j = 0, the snapshot is the initial state
    snap_len = torch.tensor([4, Q, 2 * Q + 4, 0], device=dev)
    H, P, G, N, S = 4, 4, 2, 5, len(lengths)
    x, dt, A, B, C, D, bias = _inputs(sum(lengths), H, P, G, N, 5, dev)
    pool = torch.randn(2 * S, H, P, N, generator=gen(6)).to(dev)
    before = pool.clone()
    slots = torch.tensor([0, 2, 4, 6], device=dev)
    snaps = torch.tensor([1, 3, 5, 7], device=dev)
    y, _ = _run(fn, x, dt, A, B, C, lengths, pool, slots, has, starts, D, bias, snap_slots=snaps, snap_len=snap_len,
                **kw)
    plain = before.clone()
    y_plain, _ = _run(fn, x, dt, A, B, C, lengths, plain, slots, has, starts, D, bias, **kw)
    assert torch.equal(y, y_plain)
    assert_close(pool[slots], plain[slots], 1e-5)
    cu = [0] + torch.tensor(lengths).cumsum(0).tolist()
    for i in range(S):
        j = int(snap_len[i])
        ref = before.clone()
        if j:
            one = slice(cu[i], cu[i] + j)
            _run(ssd_scan_varlen_ref, x[one], dt[one], A, B[one], C[one], [j], ref, slots[i:i + 1], has[i:i + 1],
                 starts[i:i + 1], D, bias)
        elif not has[i]:
            ref[slots[i]] = 0
        assert_close(pool[snaps[i]], ref[slots[i]], 1e-5)
