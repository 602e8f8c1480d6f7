"""The pure-torch references against fp64 sequential recurrences."""

import pytest
import torch

from mambaserve.kernels.conv1d import causal_conv1d_update_ref, causal_conv1d_varlen_ref
from mambaserve.kernels.gated_rmsnorm import gated_rmsnorm_ref
from mambaserve.kernels.selective_state_update import selective_state_update_ref
from mambaserve.kernels.ssd_scan import ssd_scan_varlen_ref
from mambaserve.kernels.state_ops import clear_slots_ref, copy_slots_ref, scatter_steps_ref
from tests.kernels.oracle import conv_recurrence, ssm_recurrence

Q = 8


def _inputs(T, H=6, P=4, G=2, N=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    A = -torch.rand(H, generator=g) * 2 - 0.1
    return r(T, H, P), r(T, H), A, r(T, G, N), r(T, G, N), r(H), r(H)


@pytest.mark.parametrize("groups", [1, 2, 3, 6])
def test_scan_packed_lengths_with_and_without_initial_states(groups):
    lengths = [1, 3, Q - 1, Q, Q + 1, 3 * Q + 5]
    T, H, P, N = sum(lengths), 6, 4, 5
    x, dt, A, B, C, D, dt_bias = _inputs(T, H, P, groups, N)
    pool = torch.randn(len(lengths) + 1, H, P, N, dtype=torch.float64).float()
    init = pool.clone()
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    has_init = torch.tensor([i % 2 == 0 for i in range(len(lengths))])
    slots = torch.arange(1, len(lengths) + 1)
    starts = torch.tensor([0, 5, 2 * Q + 3, Q, 1, 7])  # resume mid-chunk and on boundaries
    y, bnd = ssd_scan_varlen_ref(x, dt, A, B, C, chunk_size=Q, cu_seqlens=cu, ssm_state=pool,
                                 state_indices=slots, has_initial_state=has_init, seq_start_pos=starts,
                                 D=D, dt_bias=dt_bias, return_boundary_states=True)
    k = 0
    for i, L in enumerate(lengths):
        s, e = cu[i].item(), cu[i + 1].item()
        ref_y, ref_states = ssm_recurrence(x[s:e], dt[s:e], A, B[s:e], C[s:e], D,
                                           init[slots[i]] if has_init[i] else None, dt_bias)
        torch.testing.assert_close(y[s:e].double(), ref_y, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(pool[slots[i]].double(), ref_states[-1], atol=1e-4, rtol=1e-4)
        # boundary states: every absolute multiple of Q crossed in (start, start+L]
        for pos in range((starts[i].item() // Q + 1) * Q, starts[i].item() + L + 1, Q):
            assert bnd.seq_idx[k] == i and bnd.positions[k] == pos
            torch.testing.assert_close(bnd.states[k].double(), ref_states[pos - starts[i].item() - 1],
                                       atol=1e-4, rtol=1e-4)
            k += 1
    assert k == len(bnd.positions)
    assert torch.equal(pool[0], init[0])  # untouched slot


def test_scan_split_anywhere_equals_one_pass():
    L, H, P, G, N = 3 * Q + 5, 4, 3, 1, 4
    x, dt, A, B, C, D, dt_bias = _inputs(L, H, P, G, N, seed=1)
    one = torch.zeros(2, H, P, N)
    y_one, _ = ssd_scan_varlen_ref(x, dt, A, B, C, chunk_size=Q, cu_seqlens=torch.tensor([0, L]),
                                   ssm_state=one, state_indices=torch.tensor([1]),
                                   has_initial_state=torch.tensor([False]), D=D, dt_bias=dt_bias)
    for cut in [1, Q - 1, Q, Q + 3, L - 1]:
        two = torch.zeros(2, H, P, N)
        ys = []
        for i, (s, e) in enumerate([(0, cut), (cut, L)]):
            y, _ = ssd_scan_varlen_ref(x[s:e], dt[s:e], A, B[s:e], C[s:e], chunk_size=Q,
                                       cu_seqlens=torch.tensor([0, e - s]), ssm_state=two,
                                       state_indices=torch.tensor([1]), has_initial_state=torch.tensor([i > 0]),
                                       seq_start_pos=torch.tensor([s]), D=D, dt_bias=dt_bias)
            ys.append(y)
        torch.testing.assert_close(torch.cat(ys), y_one, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(two, one, atol=1e-5, rtol=1e-5)


def test_scan_extreme_decay_is_finite():
    L, H, P, G, N = 2 * Q + 3, 2, 2, 1, 3
    x, _, _, B, C, D, _ = _inputs(L, H, P, G, N, seed=2)
    dt = torch.full((L, H), 10.0)
    dt[::3] = -30.0
    A = torch.tensor([-16.0, -0.01])
    pool = torch.zeros(2, H, P, N)
    y, bnd = ssd_scan_varlen_ref(x, dt, A, B, C, chunk_size=Q, cu_seqlens=torch.tensor([0, L]), ssm_state=pool,
                                 state_indices=torch.tensor([1]), has_initial_state=torch.tensor([False]),
                                 D=D, return_boundary_states=True)
    ref_y, _ = ssm_recurrence(x, dt, A, B, C, D)
    assert torch.isfinite(y).all() and torch.isfinite(pool).all() and torch.isfinite(bnd.states).all()
    torch.testing.assert_close(y.double(), ref_y, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("groups", [1, 2, 4, 8])
def test_decode_update_matches_recurrence_and_leaves_padding_alone(groups):
    Bsz, H, P, N = 5, 8, 4, 6
    x, dt, A, Bm, Cm, D, dt_bias = _inputs(Bsz, H, P, groups, N, seed=3)
    x = x.view(Bsz, H, P)
    pool = torch.randn(8, H, P, N)
    before = pool.clone()
    idx = torch.tensor([3, -1, 1, 6, -1])
    dst = torch.tensor([4, -1, 2, 6, -1])
    y = selective_state_update_ref(pool, x, dt, A, Bm, Cm, D, None, dt_bias, state_indices=idx, dst_state_indices=dst)
    for r in range(Bsz):
        if idx[r] < 0:
            assert torch.equal(y[r], torch.zeros_like(y[r]))
            continue
        ref_y, ref_s = ssm_recurrence(x[r:r + 1], dt[r:r + 1], A, Bm[r:r + 1], Cm[r:r + 1], D, before[idx[r]], dt_bias)
        torch.testing.assert_close(y[r].double(), ref_y[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(pool[dst[r]].double(), ref_s[0], atol=1e-5, rtol=1e-5)
    for untouched in [0, 5, 7, 3, 1]:  # sources with a different destination are not written
        if untouched not in dst.tolist():
            assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.parametrize("width", [2, 3, 4])
def test_conv_varlen_then_update_matches_recurrence(width):
    Dm, lengths = 6, [1, 2, 5, 9]
    T = sum(lengths)
    g = torch.Generator().manual_seed(width)
    x = torch.randn(T, Dm, generator=g)
    w, b = torch.randn(Dm, width, generator=g), torch.randn(Dm, generator=g)
    pool = torch.randn(6, Dm, width - 1, generator=g)
    init = pool.clone()
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    slots, has_init = torch.tensor([1, 2, 3, 4]), torch.tensor([True, False, True, False])
    out = causal_conv1d_varlen_ref(x, w, b, pool, cu, slots, has_init)
    nxt = torch.randn(4, Dm, generator=g)
    step = causal_conv1d_update_ref(nxt, pool, w, b, torch.tensor([1, 2, 3, 4]))
    for i in range(len(lengths)):
        s, e = cu[i].item(), cu[i + 1].item()
        seq = torch.cat([x[s:e], nxt[i:i + 1]])
        ref, final = conv_recurrence(seq, w, b, init[slots[i]] if has_init[i] else None)
        torch.testing.assert_close(out[s:e].double(), ref[:-1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(step[i].double(), ref[-1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(pool[slots[i]].double(), final, atol=1e-6, rtol=1e-6)
    assert torch.equal(pool[0], init[0]) and torch.equal(pool[5], init[5])


def test_gated_rmsnorm_normalises_per_group():
    x, z, w = torch.randn(3, 12), torch.randn(3, 12), torch.randn(12)
    out = gated_rmsnorm_ref(x, z, w, 1e-6, group_size=4)
    h = (x * torch.nn.functional.silu(z)).double().view(3, 3, 4)
    ref = (h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).view(3, 12) * w.double()
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_state_slot_ops():
    pool = torch.randn(3, 7, 2, 2)
    before = pool.clone()
    copy_slots_ref(pool, torch.tensor([1, 2]), torch.tensor([5, 6]))
    assert torch.equal(pool[:, 5], before[:, 1]) and torch.equal(pool[:, 6], before[:, 2])
    clear_slots_ref(pool, torch.tensor([1]))
    assert not pool[:, 1].any() and torch.equal(pool[:, 2], before[:, 2])
    src = torch.randn(3, 3, 4, 2, 2)
    scatter_steps_ref(pool, src, torch.tensor([3, 4, 0]), torch.tensor([2, -1, 0]))
    assert torch.equal(pool[:, 3], src[:, 0, 2]) and torch.equal(pool[:, 0], src[:, 2, 0])
    assert torch.equal(pool[:, 4], before[:, 4])
