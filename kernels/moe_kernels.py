"""The jitted kernels of the fused MoE experts; launchers, tiles and the references are in ``moe`` (shapes and
the meaning of every argument: its module docstring).

The work is laid out as a grouped GEMM over *padded positions*: the ``T * top_k`` (token, expert) pairs
sorted by expert, each expert's run padded up to a multiple of BLOCK_M, so that a block of BLOCK_M
positions belongs to one expert. ``sorted_pairs[p]`` is the pair at position p (``N = T * top_k`` marks
padding), ``block_expert[b]`` the expert of block b (-1: past the last used block, nothing to do). Both
GEMMs walk the same blocks, so the intermediate activations are indexed by position and the down
projection reads its rows contiguously; only the up projection gathers token rows (``pair // top_k``).

  _moe_align_expert_  [E]                 program e lays out expert e's run: every expert's count (a histogram
  kernel                                  of the pairs), so the padded offset of its run (a sum over the
                                          experts before it), its pairs there in pair order (a cumsum over its
                                          hits: stable, deterministic), its run's padding and blocks, and its
                                          share of the positions and blocks past the last run
  _moe_count_kernel,  [N/CHUNK], [1],     the same in three launches for more pairs (each program above would
  _moe_runs_kernel,   [N/CHUNK]           walk them all): each program's counts (and its share of the sentinel
  _moe_scatter_kernel                     fill); one program turns them into each program's offsets and lays
                                          out the runs; each program scatters its pairs (still stable)
  _moe_up_kernel      [blocks, I/BLOCK_N] rows of ``x`` gathered by token, times expert e's first
                                          projection; GATED reads the gate columns n and the up columns
                                          I + n in the same K loop (two accumulators) and stores
                                          ``act(gate) * up``; otherwise ``act(h)`` (relu2: Nemotron-H)
  _moe_down_kernel    [blocks, H/BLOCK_N] the intermediate rows times expert e's second projection, stored
                                          at the pair's row in the activations' dtype (half the traffic
                                          of fp32, and the reference's rounding)
  _moe_sum_kernel     [T, H/BLOCK]        each token's k rows times their routing weights summed in order
                                          (fp32), cast to the
                                          output dtype: deterministic, no atomics; with the block's epilogue
                                          (a shared expert's output added, a scaled residual add) in the same pass

A single token (decode at batch 1) skips the align step (DIRECT): its k pairs go to k distinct experts, so
block b is pair b alone and its expert is read straight from ``topk_ids``; one launch fewer on the path where
launches weigh most. Padding positions are masked on load and on store. Nothing here waits on the host: the
grids depend only on ``(T, top_k, E, BLOCK_M)``, so the whole op can be captured in a CUDA graph. All four
launch with programmatic dependent launch where the decode kernels do (``pdl_args``): ``pdl_start`` first, no
read before its wait, so each launch overlaps the tail of the kernel before it without moving any access
ahead of it.
"""

from __future__ import annotations

from mambaserve.kernels._dispatch import HAS_TRITON, pdl_start, tl, triton

if HAS_TRITON:

    @triton.jit
    def _fill(pairs_ptr, N, lo, hi, FILL: tl.constexpr):
        """Positions [lo, hi) of ``pairs`` set to the padding sentinel N, FILL a step."""
        for p0 in range(lo, hi, FILL):
            p = p0 + tl.arange(0, FILL)
            tl.store(pairs_ptr + p, tl.zeros([FILL], dtype=tl.int32) + N, mask=p < hi)

    @triton.jit
    def _runs(counts, bexp_ptr, NB, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
        """From the per-expert pair counts [EP]: each block's expert (-1 past the last run) in ``bexp``; returns
        each expert's run start."""
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        pad_end = tl.cumsum(padded, 0)
        total = tl.sum(padded, 0)
        c = tl.arange(0, CHUNK)
        for b0 in range(0, NB, CHUNK):
            b = b0 + c
            first = b * BLOCK_M
            # block b belongs to the first expert whose padded run ends past its first position
            e_of = tl.sum((pad_end[None, :] <= first[:, None]).to(tl.int32), 1)
            tl.store(bexp_ptr + b, tl.where(first < total, e_of, -1), mask=b < NB)
        return pad_end - padded

    @triton.jit
    def _scatter(ids, i, N, base, pairs_ptr, EP: tl.constexpr):
        """Pairs ``i`` (experts ``ids``) to their positions: ``base[e]`` (where expert e's pairs before these go on)
        plus the rank among these pairs of the same expert (a cumsum over the one-hots). Returns the counts."""
        ex = tl.arange(0, EP)
        hit = (ids[:, None] == ex[None, :]).to(tl.int32)
        before = tl.cumsum(hit, 0) - hit + base[None, :]  # earlier pairs of the same expert
        tl.store(pairs_ptr + tl.sum(hit * before, 1), i, mask=i < N)
        return tl.sum(hit, 0)

    # The pair and position counts change with every batch size: not specialised (== 1, % 16), so one compile per
    # tile set serves every batch (``moe.moe_warm_up`` compiles them all at start).
    @triton.jit(do_not_specialize=["N", "P", "NB", "E"])
    def _moe_align_expert_kernel(ids_ptr, pairs_ptr, bexp_ptr, N, P, NB, E, BLOCK_M: tl.constexpr, EP: tl.constexpr,
                                 CHUNK: tl.constexpr, FILL: tl.constexpr, USE_PDL: tl.constexpr = False):
        """Grid (E,): program e lays out expert e's run alone. Every expert's count (a histogram of all the pairs,
        CHUNK a step) gives its run's start; its pairs go there in order (a cumsum over its hits); then its run's
        padding and blocks, and its share of the positions and blocks past the last run. The runs are disjoint, so
        the programs need nothing from each other: one launch, each program O(pairs / CHUNK) steps."""
        pdl_start(USE_PDL)
        e = tl.program_id(0)
        c = tl.arange(0, CHUNK)
        counts = tl.zeros([2 * EP], dtype=tl.int32)
        for i0 in range(0, N, CHUNK):
            i = i0 + c
            counts += tl.histogram(tl.load(ids_ptr + i, mask=i < N, other=EP).to(tl.int32), 2 * EP)  # past N: bin EP
        ex = tl.arange(0, 2 * EP)
        padded = tl.where(ex < EP, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
        start = tl.sum(tl.where(ex < e, padded, 0), 0)
        end = start + tl.sum(tl.where(ex == e, padded, 0), 0)
        total = tl.sum(padded, 0)
        seen = start
        for i0 in range(0, N, CHUNK):
            i = i0 + c
            hit = (tl.load(ids_ptr + i, mask=i < N, other=-1).to(tl.int32) == e).to(tl.int32)
            tl.store(pairs_ptr + seen + tl.cumsum(hit, 0) - hit, i, mask=hit > 0)
            seen += tl.sum(hit, 0)
        _fill(pairs_ptr, N, seen, end, FILL)
        share = (P - total + E - 1) // E
        lo = total + e * share
        _fill(pairs_ptr, N, lo, tl.minimum(lo + share, P), FILL)
        b = tl.arange(0, FILL)
        for b0 in range(start // BLOCK_M, end // BLOCK_M, FILL):
            tl.store(bexp_ptr + b0 + b, tl.zeros([FILL], dtype=tl.int32) + e, mask=b0 + b < end // BLOCK_M)
        share = (NB - total // BLOCK_M + E - 1) // E
        lo = total // BLOCK_M + e * share
        for b0 in range(lo, tl.minimum(lo + share, NB), FILL):
            tl.store(bexp_ptr + b0 + b, tl.full([FILL], -1, tl.int32), mask=b0 + b < tl.minimum(lo + share, NB))

    @triton.jit
    def _program_pairs(ids_ptr, N, CHUNK: tl.constexpr):
        """This program's CHUNK pairs (positions past N: expert -1) and their experts."""
        i = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
        return i, tl.load(ids_ptr + i, mask=i < N, other=-1).to(tl.int32)

    @triton.jit(do_not_specialize=["N", "P", "SPAN"])
    def _moe_count_kernel(ids_ptr, local_ptr, pairs_ptr, N, P, SPAN, EP: tl.constexpr, CHUNK: tl.constexpr,
                          FILL: tl.constexpr, USE_PDL: tl.constexpr = False):
        """Grid (cdiv(N, CHUNK),): program q's pairs per expert -> ``local[q]`` [EP], and positions [q * SPAN,
        (q + 1) * SPAN) of ``pairs`` set to the sentinel (one program filling all P of them took ~20 us at 8,192
        tokens)."""
        pdl_start(USE_PDL)
        _, ids = _program_pairs(ids_ptr, N, CHUNK)
        ex = tl.arange(0, EP)
        tl.store(local_ptr + tl.program_id(0) * EP + ex, tl.sum((ids[:, None] == ex[None, :]).to(tl.int32), 0))
        lo = tl.program_id(0) * SPAN
        _fill(pairs_ptr, N, lo, tl.minimum(lo + SPAN, P), FILL)

    @triton.jit(do_not_specialize=["NB", "Q"])
    def _moe_runs_kernel(local_ptr, start_ptr, bexp_ptr, NB, Q, BLOCK_M: tl.constexpr,
                         EP: tl.constexpr, CHUNK: tl.constexpr, QB: tl.constexpr,
                         USE_PDL: tl.constexpr = False):
        """Grid (1,): ``local[q]`` becomes the pairs of each expert in the Q programs before q (in place), QB
        programs' rows a step (an exclusive cumsum down a [QB, EP] tile: one row a step took 23 us at 192 rows on
        an H200); the runs (``_runs``) from the totals; ``start`` [EP] each expert's run start."""
        pdl_start(USE_PDL)
        ex = tl.arange(0, EP)
        rq = tl.arange(0, QB)
        seen = tl.zeros([EP], dtype=tl.int32)
        for q0 in range(0, Q, QB):
            rows = (q0 + rq)[:, None] * EP + ex[None, :]
            m = (q0 + rq < Q)[:, None]
            n = tl.load(local_ptr + rows, mask=m, other=0)
            tl.store(local_ptr + rows, tl.cumsum(n, 0) - n + seen[None, :], mask=m)
            seen += tl.sum(n, 0)
        tl.store(start_ptr + ex, _runs(seen, bexp_ptr, NB, BLOCK_M, CHUNK))

    @triton.jit(do_not_specialize=["N"])
    def _moe_scatter_kernel(ids_ptr, local_ptr, start_ptr, pairs_ptr, N, EP: tl.constexpr, CHUNK: tl.constexpr,
                            USE_PDL: tl.constexpr = False):
        """Grid (cdiv(N, CHUNK),): program q's pairs to their positions, after ``_moe_runs_kernel``."""
        pdl_start(USE_PDL)
        i, ids = _program_pairs(ids_ptr, N, CHUNK)
        ex = tl.arange(0, EP)
        _scatter(ids, i, N, tl.load(local_ptr + tl.program_id(0) * EP + ex) + tl.load(start_ptr + ex), pairs_ptr, EP)

    @triton.jit
    def _activate(h, ACT: tl.constexpr):
        if ACT == 0:  # silu
            out = h * tl.sigmoid(h)
        else:  # relu2 (squared ReLU)
            r = tl.maximum(h, 0.0)
            out = r * r
        return out

    @triton.jit
    def _row_block(pid_m, pairs_ptr, bexp_ptr, N, BLOCK_M: tl.constexpr, DIRECT: tl.constexpr):
        """(expert, positions, pairs) of row block ``pid_m``. DIRECT (no align step: one token, whose k pairs go
        to k distinct experts): block b holds pair b alone in its first row and ``bexp_ptr`` is the flat
        ``topk_ids``; otherwise the align step's ``block_expert`` and ``sorted_pairs``."""
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        e = tl.load(bexp_ptr + pid_m)
        if DIRECT:
            pair = tl.where(tl.arange(0, BLOCK_M) == 0, pid_m, N)
        else:
            pair = tl.load(pairs_ptr + rows)
        return e, rows, pair

    @triton.jit
    def _weight_tile(w_desc, row, k0):
        """Rows [row, row + BLOCK_N) of a 2-D view of stacked weights at columns [k0, k0 + BLOCK_K), through its
        TMA descriptor, as the [BLOCK_K, BLOCK_N] operand of a dot (rows past an expert's are the next
        expert's: their output columns are masked on store; columns past K read 0)."""
        return tl.trans(w_desc.load([row, k0]))

    @triton.jit(do_not_specialize=["N"])
    def _moe_up_kernel(x_ptr, w_ptr, w_desc, h_ptr, pairs_ptr, bexp_ptr, N, K, I,
                       x_t, x_k, w_e, w_n, w_k, h_p, h_i,
                       TOP_K: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr, EVEN_K: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       DOT_T: tl.constexpr, PREC: tl.constexpr, DIRECT: tl.constexpr = False,
                       TMA: tl.constexpr = False, USE_PDL: tl.constexpr = False):
        """Grid (blocks, cdiv(I, BLOCK_N)): ``h[p, n] = act(x[tok(p)] . w[e, n]) (* x[tok(p)] . w[e, I + n])``.
        TMA: the weight tiles through ``w_desc`` (``w`` as [E * F, K]); the token rows stay a gather."""
        pdl_start(USE_PDL)
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        e, rows, pair = _row_block(pid_m, pairs_ptr, bexp_ptr, N, BLOCK_M, DIRECT)
        if e < 0:
            return
        valid = pair < N
        tok = (pair // TOP_K).to(tl.int64)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mn = n < I
        kk = tl.arange(0, BLOCK_K)
        a_ptrs = x_ptr + tok[:, None] * x_t + kk[None, :] * x_k
        g_ptrs = w_ptr + e.to(tl.int64) * w_e + n[None, :] * w_n + kk[:, None] * w_k  # [BLOCK_K, BLOCK_N]
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        row = e * (2 * I if GATED else I) + pid_n * BLOCK_N  # (TMA) the gate tile's first row in w as [E * F, K]
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
            else:
                mk = (k0 + kk) < K
                a = tl.load(a_ptrs, mask=valid[:, None] & mk[None, :], other=0.0)
            if TMA:
                g = _weight_tile(w_desc, row, k0)
            elif EVEN_K:
                g = tl.load(g_ptrs, mask=mn[None, :], other=0.0)
            else:
                g = tl.load(g_ptrs, mask=mk[:, None] & mn[None, :], other=0.0)
            a = a.to(DOT_T)
            acc_g = tl.dot(a, g.to(DOT_T), acc_g, input_precision=PREC)
            if GATED:
                if TMA:
                    u = _weight_tile(w_desc, row + I, k0)
                elif EVEN_K:
                    u = tl.load(g_ptrs + I * w_n, mask=mn[None, :], other=0.0)
                else:
                    u = tl.load(g_ptrs + I * w_n, mask=mk[:, None] & mn[None, :], other=0.0)
                acc_u = tl.dot(a, u.to(DOT_T), acc_u, input_precision=PREC)
            a_ptrs += BLOCK_K * x_k
            g_ptrs += BLOCK_K * w_k
        y = _activate(acc_g, ACT)
        if GATED:
            y = y * acc_u
        tl.store(h_ptr + rows[:, None].to(tl.int64) * h_p + n[None, :] * h_i, y.to(h_ptr.dtype.element_ty),
                 mask=valid[:, None] & mn[None, :])

    @triton.jit(do_not_specialize=["N"])
    def _moe_down_kernel(h_ptr, w_ptr, h_desc, w_desc, out_ptr, pairs_ptr, bexp_ptr, N, I, H,
                         h_p, h_i, w_e, w_n, w_k, o_p, o_h, EVEN_K: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         DOT_T: tl.constexpr, PREC: tl.constexpr, DIRECT: tl.constexpr = False,
                         TMA: tl.constexpr = False, USE_PDL: tl.constexpr = False):
        """Grid (blocks, cdiv(H, BLOCK_N)): ``out[pair(p), n] = h[p] . w[e, n]``, rounded to out's dtype (as the
        reference's per-expert ``F.linear``); the routing weight is applied in the sum. TMA: h's rows and the weight
        tiles (``w`` as [E * H, I]) through their descriptors."""
        pdl_start(USE_PDL)
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        e, rows, pair = _row_block(pid_m, pairs_ptr, bexp_ptr, N, BLOCK_M, DIRECT)
        if e < 0:
            return
        valid = pair < N
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mn = n < H
        kk = tl.arange(0, BLOCK_K)
        a_ptrs = h_ptr + rows[:, None].to(tl.int64) * h_p + kk[None, :] * h_i
        b_ptrs = w_ptr + e.to(tl.int64) * w_e + n[None, :] * w_n + kk[:, None] * w_k  # [BLOCK_K, BLOCK_N]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            if TMA:  # the block's rows of h are contiguous positions (padding rows' products are never stored)
                a = h_desc.load([pid_m * BLOCK_M, k0])
                b = _weight_tile(w_desc, e * H + pid_n * BLOCK_N, k0)
            elif EVEN_K:
                a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
                b = tl.load(b_ptrs, mask=mn[None, :], other=0.0)
            else:
                mk = (k0 + kk) < I
                a = tl.load(a_ptrs, mask=valid[:, None] & mk[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=mk[:, None] & mn[None, :], other=0.0)
            acc = tl.dot(a.to(DOT_T), b.to(DOT_T), acc, input_precision=PREC)
            a_ptrs += BLOCK_K * h_i
            b_ptrs += BLOCK_K * w_k
        tl.store(out_ptr + pair[:, None].to(tl.int64) * o_p + n[None, :] * o_h, acc.to(out_ptr.dtype.element_ty),
                 mask=valid[:, None] & mn[None, :])

    @triton.jit
    def _moe_sum_kernel(src_ptr, out_ptr, add_ptr, res_ptr, wts_ptr, scale, H, s_p, o_t, a_t, r_t, TOP_K: tl.constexpr,
                        HAS_ADD: tl.constexpr, HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
                        USE_PDL: tl.constexpr = False):
        """Grid (T, cdiv(H, BLOCK)): ``out[t] = res[t] + scale * (sum_j wts[i] * src[i] + add[t])`` over the
        token's pairs ``i = t * TOP_K + j``, j in order, in fp32 and rounded once (``add`` and ``res`` where given:
        the block's epilogue)."""
        pdl_start(USE_PDL)
        t, pb = tl.program_id(0).to(tl.int64), tl.program_id(1)
        n = pb * BLOCK + tl.arange(0, BLOCK)
        m = n < H
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            i = t * TOP_K + j
            wt = tl.load(wts_ptr + i).to(tl.float32)
            acc += tl.load(src_ptr + i * s_p + n, mask=m, other=0.0).to(tl.float32) * wt
        if HAS_ADD:
            acc += tl.load(add_ptr + t * a_t + n, mask=m, other=0.0).to(tl.float32)
        acc = acc * scale
        if HAS_RES:
            acc += tl.load(res_ptr + t * r_t + n, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * o_t + n, acc.to(out_ptr.dtype.element_ty), mask=m)
