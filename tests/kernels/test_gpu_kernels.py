"""The same checks at real shapes on a GPU (mamba2-2.7b dims: 80 heads x 64, N = 128, Q = 256).

Skipped without CUDA. Inputs are bf16 as the engine runs them; tolerances are relative norms.
"""

import pytest
import torch

from mambaserve.kernels import KernelConfig
from mambaserve.kernels.conv1d import (causal_conv1d_update, causal_conv1d_update_ref, causal_conv1d_varlen,
                                       causal_conv1d_varlen_ref)
from mambaserve.kernels.gated_rmsnorm import gated_rmsnorm, gated_rmsnorm_ref
from mambaserve.kernels.rmsnorm import rmsnorm, rmsnorm_ref
from mambaserve.kernels.selective_state_update import selective_state_update, selective_state_update_ref
from mambaserve.kernels.ssd_scan import ssd_scan_varlen, ssd_scan_varlen_ref
from mambaserve.kernels.state_ops import (clear_slots, clear_slots_ref, copy_slots, copy_slots_ref, scatter_steps,
                                          scatter_steps_ref)
from tests.kernels.helpers import assert_close

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

H, P, N, Q = 80, 64, 128, 256
BF = torch.bfloat16


def _scan_inputs(T, G, seed, dtype=BF):
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, device="cuda")  # noqa: E731
    x, B, C = r(T, H, P).to(dtype), (r(T, G, N) * 0.3).to(dtype), (r(T, G, N) * 0.3).to(dtype)
    dt = r(T, H) - 2.0
    A = -torch.rand(H, generator=g, device="cuda") * 4 - 0.05
    return x, dt, A, B, C, r(H), r(H) * 0.5


def _cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")


# the default tiles (pointer loads at these token counts; the work-per-SM rule gives six packed sequences
# 64-row state tiles and one sequence the 16-row one-warp tiles), and through TMA descriptors; 32-token k blocks and
# the start-state product over N in two slices (TMA); 2 warps without a register cap, the state tile over all
# of N; the kernels' chunks the model's and a quarter of it
SCAN_TILES = [None, dict(tma_min_tokens=0), dict(block_k=32, block_n=64, num_stages=2, tma_min_tokens=0),
              dict(num_warps=2, num_stages=1, maxnreg=None, state_block_n=128),
              dict(chunk=256, num_stages=3, state_stages=2, tma_min_tokens=0), dict(chunk=64)]


@pytest.mark.parametrize("tiles", SCAN_TILES)
@pytest.mark.parametrize("G", [1, 8])
def test_scan_packed_real_shapes(G, tiles):
    lengths = [1, 3, Q - 1, Q, Q + 1, 3 * Q + 5]
    S = len(lengths)
    x, dt, A, B, C, D, bias = _scan_inputs(sum(lengths), G, G)
    pool = torch.randn(S + 2, H, P, N, device="cuda")
    ref_pool, before = pool.clone(), pool.clone()
    kw = dict(chunk_size=Q, cu_seqlens=_cu(lengths), state_indices=torch.tensor([3, 1, 6, 2, 7, 4], device="cuda"),
              has_initial_state=torch.tensor([True, False] * 3, device="cuda"),
              seq_start_pos=torch.tensor([0, 5, 2 * Q + 3, Q, 1, 7], device="cuda"), D=D, dt_bias=bias,
              return_boundary_states=True)
    y, bnd = ssd_scan_varlen(x, dt, A, B, C, ssm_state=pool, tiles=tiles, **kw)
    y_ref, bnd_ref = ssd_scan_varlen_ref(x, dt, A, B, C, ssm_state=ref_pool, **kw)
    assert_close(y, y_ref, 1e-2)
    assert_close(pool, ref_pool, 5e-3)
    assert torch.equal(pool[0], before[0]) and torch.equal(pool[5], before[5])
    assert torch.equal(bnd.positions, bnd_ref.positions) and torch.equal(bnd.seq_idx, bnd_ref.seq_idx)
    assert_close(bnd.states, bnd_ref.states, 5e-3)


@pytest.mark.parametrize("tiles", SCAN_TILES)
def test_scan_page_snapshots_real_shapes(tiles):
    """A hybrid's cache hits: sequences resumed from their slots' states (or not), each snapshotting its state at a
    page boundary inside its last chunk, 1 to 16 tokens before its end (the tokens after it are added to the state
    as one block): the snapshots equal a pass over those tokens alone, the outputs and final states a pass without
    snapshots."""
    lengths, starts = [64, 80, 17, 300, 2 * Q + 9], [1088, 0, 512, 320, 128]
    snap_len = [48, 64, 16, 288, 512]  # in the last 64-token chunk of every sequence (the smallest tiles' chunk)
    has = torch.tensor([True, False, True, True, False], device="cuda")
    pos = torch.tensor(starts, device="cuda")
    S = len(lengths)
    x, dt, A, B, C, D, bias = _scan_inputs(sum(lengths), 1, 11)
    pool = torch.randn(2 * S, H, P, N, device="cuda") * 0.1
    before, ref = pool.clone(), pool.clone()
    slots = torch.arange(0, 2 * S, 2, device="cuda")
    kw = dict(chunk_size=Q, D=D, dt_bias=bias)
    y, _ = ssd_scan_varlen(x, dt, A, B, C, cu_seqlens=_cu(lengths), ssm_state=pool, state_indices=slots,
                           has_initial_state=has, seq_start_pos=pos, snap_slots=slots + 1,
                           snap_len=torch.tensor(snap_len, dtype=torch.int32, device="cuda"), tiles=tiles, **kw)
    y_ref, _ = ssd_scan_varlen_ref(x, dt, A, B, C, cu_seqlens=_cu(lengths), ssm_state=ref, state_indices=slots,
                                   has_initial_state=has, seq_start_pos=pos, **kw)
    assert_close(y, y_ref, 1e-2)
    assert_close(pool[slots], ref[slots], 5e-3)
    cu = _cu(lengths).tolist()
    for i, j in enumerate(snap_len):
        one, alone = slice(cu[i], cu[i] + j), before.clone()
        ssd_scan_varlen_ref(x[one], dt[one], A, B[one], C[one], cu_seqlens=_cu([j]), ssm_state=alone,
                            state_indices=slots[i:i + 1], has_initial_state=has[i:i + 1],
                            seq_start_pos=pos[i:i + 1], **kw)
        assert_close(pool[slots[i] + 1], alone[slots[i]], 5e-3)


@pytest.mark.parametrize("tiles", SCAN_TILES)
def test_scan_split_resume_and_extreme_decay_real_shapes(tiles):
    L, cut = 2000, 700
    x, dt, A, B, C, D, bias = _scan_inputs(L, 1, 3)
    dt[::7] = 30.0
    dt[3::11] = -30.0
    A[:4] = -16.0
    one, two = torch.zeros(2, H, P, N, device="cuda"), torch.zeros(2, H, P, N, device="cuda")
    slot = torch.tensor([1], device="cuda")
    base = dict(chunk_size=Q, state_indices=slot, D=D, dt_bias=bias, return_boundary_states=True)
    run = lambda *a, **k: ssd_scan_varlen(*a, tiles=tiles, **k)  # noqa: E731
    y1, b1 = run(x, dt, A, B, C, cu_seqlens=_cu([L]), ssm_state=one,
                 has_initial_state=torch.tensor([False], device="cuda"), **base)
    ya, ba = run(x[:cut], dt[:cut], A, B[:cut], C[:cut], cu_seqlens=_cu([cut]), ssm_state=two,
                 has_initial_state=torch.tensor([False], device="cuda"),
                 seq_start_pos=torch.tensor([0], device="cuda"), **base)
    yb, bb = run(x[cut:], dt[cut:], A, B[cut:], C[cut:], cu_seqlens=_cu([L - cut]), ssm_state=two,
                 has_initial_state=torch.tensor([True], device="cuda"),
                 seq_start_pos=torch.tensor([cut], device="cuda"), **base)
    assert torch.isfinite(y1).all() and torch.isfinite(one).all() and torch.isfinite(b1.states).all()
    assert_close(torch.cat([ya, yb]), y1, 1e-2)
    assert_close(two, one, 5e-3)
    assert torch.cat([ba.positions, bb.positions]).tolist() == b1.positions.tolist()
    assert_close(torch.cat([ba.states, bb.states]), b1.states, 5e-3)
    ref_pool = torch.zeros(2, H, P, N, device="cuda")
    y_ref, _ = ssd_scan_varlen_ref(x, dt, A, B, C, cu_seqlens=_cu([L]), ssm_state=ref_pool,
                                   has_initial_state=torch.tensor([False], device="cuda"), **base)
    assert_close(y1, y_ref, 1e-2)
    # prefill then decode equals one long prefill
    y_dec = selective_state_update(two, x[-1:], dt[-1:], A, B[-1:], C[-1:], D, None, bias, state_indices=slot)
    long = torch.zeros(2, H, P, N, device="cuda")
    x2 = torch.cat([x, x[-1:]])
    y_long, _ = run(x2, torch.cat([dt, dt[-1:]]), A, torch.cat([B, B[-1:]]), torch.cat([C, C[-1:]]),
                    cu_seqlens=_cu([L + 1]), ssm_state=long,
                    has_initial_state=torch.tensor([False], device="cuda"), **base)
    assert_close(y_dec, y_long[-1:], 1e-2)


@pytest.mark.parametrize("G", [1, 2, 4, 8])
@pytest.mark.parametrize("state_dtype", [torch.float32, BF])
def test_selective_state_update_real_shapes(G, state_dtype):
    rows, slots = 96, 130
    g = torch.Generator(device="cuda").manual_seed(G)
    r = lambda *s: torch.randn(*s, generator=g, device="cuda")  # noqa: E731
    x, z = r(rows, H, P).to(BF), r(rows, H, P).to(BF)
    B, C = r(rows, G, N).to(BF), r(rows, G, N).to(BF)
    dt, A, D, bias = r(rows, H) * 10, -torch.rand(H, generator=g, device="cuda") * 16, r(H), r(H)
    pool = r(slots, H, P, N).to(state_dtype)
    ref_pool, before = pool.clone(), pool.clone()
    idx = torch.randperm(slots - 1, generator=g, device="cuda")[:rows]
    idx[::5] = -1
    dst = torch.where(idx >= 0, idx, -1)
    y = selective_state_update(pool, x, dt, A, B, C, D, z, bias, state_indices=idx, dst_state_indices=dst)
    y_ref = selective_state_update_ref(ref_pool, x, dt, A, B, C, D, z, bias, state_indices=idx,
                                       dst_state_indices=dst)
    assert_close(y, y_ref, 1e-2)
    assert_close(pool, ref_pool, 1e-5 if state_dtype == torch.float32 else 1e-2)
    untouched = torch.ones(slots, dtype=torch.bool, device="cuda")
    untouched[idx[idx >= 0]] = False
    assert torch.equal(pool[untouched], before[untouched])
    assert not y[::5].any()


def test_conv_real_shapes():
    Dm, K = 5376, 4
    lengths = [1, 2, 3, 700, 2048]
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(sum(lengths), Dm, generator=g, device="cuda").to(BF)
    w, b = torch.randn(Dm, K, generator=g, device="cuda"), torch.randn(Dm, generator=g, device="cuda")
    pool = torch.randn(9, Dm, K - 1, generator=g, device="cuda").to(BF)
    ref_pool = pool.clone()
    args = (_cu(lengths), torch.tensor([5, 1, 8, 2, 0], device="cuda"),
            torch.tensor([True, False, True, True, False], device="cuda"))
    out = causal_conv1d_varlen(x, w, b, pool, *args)
    ref = causal_conv1d_varlen_ref(x, w, b, ref_pool, *args)
    assert_close(out, ref, 1e-2)
    assert torch.equal(pool, ref_pool)
    nxt = torch.randn(6, Dm, generator=g, device="cuda").to(BF)
    idx = torch.tensor([5, -1, 8, 2, 0, -1], device="cuda")
    step = causal_conv1d_update(nxt, pool, w, b, idx)
    step_ref = causal_conv1d_update_ref(nxt, ref_pool, w, b, idx)
    assert_close(step, step_ref, 1e-2)
    assert torch.equal(pool, ref_pool)


def test_state_ops_and_norm_real_shapes():
    pool = torch.randn(4, 20, H, P, N, device="cuda")
    ref = pool.clone()
    src, dst = torch.tensor([1, 2, 3], device="cuda"), torch.tensor([10, 11, 12], device="cuda")
    copy_slots(pool, src, dst)
    copy_slots_ref(ref, src, dst)
    clear_slots(pool, torch.tensor([4, 19], device="cuda"))
    clear_slots_ref(ref, torch.tensor([4, 19], device="cuda"))
    steps = torch.randn(4, 3, 5, H, P, N, device="cuda")
    idx, step = torch.tensor([15, 16, 17], device="cuda"), torch.tensor([4, -1, 0], device="cuda")
    scatter_steps(pool, steps, idx, step)
    scatter_steps_ref(ref, steps, idx, step)
    assert torch.equal(pool, ref)
    for G in (1, 8):
        xz = torch.randn(300, 2 * 5120, device="cuda").to(BF)
        w = torch.randn(5120, device="cuda").to(BF)
        out = gated_rmsnorm(xz[:, :5120], xz[:, 5120:], w, 1e-5, 5120 // G)
        assert_close(out, gated_rmsnorm_ref(xz[:, :5120], xz[:, 5120:], w, 1e-5, 5120 // G), 1e-2)


@pytest.mark.parametrize("D", [768, 2560])  # mamba2-130m, mamba2-2.7b hidden sizes
@pytest.mark.parametrize("T", [1, 7, 300])
def test_rmsnorm_real_shapes(D, T):
    g = torch.Generator(device="cuda").manual_seed(D + T)
    r = lambda *s: torch.randn(*s, generator=g, device="cuda")  # noqa: E731
    x, w = r(T, D).to(BF), (r(D) * 0.2 + 1).to(BF)
    for residual, fp32 in [(None, True), (None, False), (r(T, D) * 4, True), ((r(T, D) * 4).to(BF), False)]:
        out, res = rmsnorm(x, residual, w, 1e-5, fp32)
        out_ref, res_ref = rmsnorm_ref(x, residual, w, 1e-5, fp32)
        assert out.dtype == BF and res.dtype == res_ref.dtype
        assert torch.equal(res, res_ref)  # one add rounded once, as torch rounds it
        # same roundings as the reference (round-to-nearest on the GPU): only the fp32 sum's order
        # differs, so a few elements move by one bf16 ulp at most
        assert_close(out, out_ref, 2e-3)


def test_conv_strided_input_real_shapes():
    """xBC as the model passes it: a column slice of the 2.7b in_proj output (5120 + 5376 + 80 wide)."""
    Dm, K, lengths = 5376, 4, [1, 300, 17]
    g = torch.Generator(device="cuda").manual_seed(1)
    proj = torch.randn(sum(lengths), 5120 + Dm + 80, generator=g, device="cuda").to(BF)
    x = proj[:, 5120:5120 + Dm]
    w, b = torch.randn(Dm, K, generator=g, device="cuda"), torch.randn(Dm, generator=g, device="cuda")
    pool = torch.randn(6, Dm, K - 1, generator=g, device="cuda").to(BF)
    pool_c = pool.clone()
    args = (_cu(lengths), torch.tensor([5, 1, 3], device="cuda"), torch.tensor([True, False, True], device="cuda"))
    out = causal_conv1d_varlen(x, w, b, pool, *args)
    assert torch.equal(out, causal_conv1d_varlen(x.contiguous(), w, b, pool_c, *args))
    assert torch.equal(pool, pool_c)
    idx = torch.tensor([5, -1, 3], device="cuda")
    step = proj[:3, 5120:5120 + Dm]
    y = causal_conv1d_update(step, pool, w, b, idx)
    assert torch.equal(y, causal_conv1d_update(step.contiguous(), pool_c, w, b, idx))
    assert torch.equal(pool, pool_c)


@pytest.mark.parametrize("N,K", [(10576, 2560), (3352, 768), (50288, 2560)])  # in_proj 2.7b / 130m, lm_head
def test_rmsnorm_linear_real_shapes(N, K):
    from mambaserve.kernels.norm_linear import rmsnorm_linear, rmsnorm_linear_ref

    g = torch.Generator(device="cuda").manual_seed(N)
    x, res = torch.randn(1, K, generator=g, device="cuda").to(BF), torch.randn(1, K, generator=g, device="cuda")
    w = (torch.randn(N, K, generator=g, device="cuda") / K ** 0.5).to(BF)
    nw = (1 + 0.1 * torch.randn(K, generator=g, device="cuda")).to(BF)
    for residual in (None, res):
        y, r = rmsnorm_linear(x, residual, nw, 1e-5, True, w)
        y_ref, r_ref = rmsnorm_linear_ref(x, residual, nw, 1e-5, True, w)
        assert torch.equal(r, r_ref)
        assert_close(y, y_ref, 1e-2)
        # the shared-memory pipeline only moves loads: the sums are the unpipelined loop's, bit for bit
        assert torch.equal(y, rmsnorm_linear(x, residual, nw, 1e-5, True, w, tiles={"STAGES": 1})[0])


@pytest.mark.parametrize("N,K", [(2560, 5120), (768, 1536)])  # out_proj 2.7b / 130m
def test_gated_rmsnorm_linear_real_shapes(N, K):
    from mambaserve.kernels.norm_linear import gated_rmsnorm_linear, gated_rmsnorm_linear_ref

    g = torch.Generator(device="cuda").manual_seed(N)
    x, z = (torch.randn(1, K, generator=g, device="cuda").to(BF) for _ in range(2))
    w = (torch.randn(N, K, generator=g, device="cuda") / K ** 0.5).to(BF)
    nw = (1 + 0.1 * torch.randn(K, generator=g, device="cuda")).to(BF)
    y = gated_rmsnorm_linear(x, z, nw, 1e-5, K, w)
    assert_close(y, gated_rmsnorm_linear_ref(x, z, nw, 1e-5, K, w), 1e-2)
    unpipelined = KernelConfig(linear_tiles={K: {"STAGES": 1}})  # by K, through the config
    assert torch.equal(y, gated_rmsnorm_linear(x, z, nw, 1e-5, K, w, config=unpipelined))
