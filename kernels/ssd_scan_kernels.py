"""The jitted kernels of the chunked SSD scan; the launcher, its tile plan and the reference are in
``ssd_scan``. Shapes and the meaning of every argument: ssd_scan's module docstring.

Four launches, no host synchronisation (one when boundary states are asked for: their count sizes the
output). "Chunk" below is a block of one sequence cut at absolute multiples of the kernels' chunk size QI
(``locate_block``; QI = SCAN_CONFIG["chunk"] when it is smaller than the model's Q, which then divides Q;
boundary states stay at multiples of Q); chunk c of the call is one of at most NC = T // QI + 2 S.

  1. _ssd_prep_kernel        [NC, H]            dt -> softplus(dt + bias), clamp; dA cumsum within each
                                                chunk; the state kernel's token weights exp(cs_end - cs_t) dt_t;
                                                the chunk table (first token, end token)
  2. _ssd_states_kernel      [P/bp * N/bn, H, S] one program walks one sequence's chunks in order over a
                                                [bp, bn] tile of the state: each chunk's own state from zero
                                                (a matrix product over its tokens), then the recurrence in
                                                registers. Writes the start states (the output kernel's
                                                operand, 16-bit), boundary states and the final state: no fp32
                                                chunk states round-trip through memory
  3. _ssd_bmm_kernel         [NC*t*t, G]         C B^T within each chunk, once per (chunk, group), lower
                                                triangle of tiles only (shared by the group's heads), zero above
                                                the diagonal: the causal mask comes with it
  4. _ssd_chunk_scan_kernel  [H*P/bp*NC*Q/BM]    y = C S_start decay + causal (CB * decay * dt) x + D x, the
                                                decays factored into row and token scales; heads fastest so
                                                concurrent programs share CB and C in L2

On Hopper the big tiles are read through TMA tensor descriptors: no per-element address arithmetic (the
output kernel: 311 vs 364 us through pointers, same tiles, mamba2-2.7b 8x2048, H100).
"""

from __future__ import annotations

from mambaserve.kernels._dispatch import HAS_TRITON, dt_prologue, locate_block, tl, triton

if HAS_TRITON:

    # S and T (sequences and tokens of the call) are not specialised (== 1, % 16): they bound masks and index the
    # [H, T] rows from a chunk's first token, never aligned anyway, so one compile serves every batch (the
    # constexprs' variants are compiled at start: ``server/engine/warm_up.py``).
    @triton.jit(do_not_specialize=["S", "T"])
    def _ssd_prep_kernel(dt_ptr, bias_ptr, A_ptr, cu_ptr, pos_ptr, dtp_ptr, cs_ptr, ws_ptr, meta_ptr, S, T, H,
                         dt_lo, dt_hi, dt_t, dt_h,
                         Q: tl.constexpr, HAS_POS: tl.constexpr, HAS_BIAS: tl.constexpr,
                         SOFTPLUS: tl.constexpr, CLAMP: tl.constexpr, BLOCK_Q: tl.constexpr,
                         BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr):
        """Chunk c, BLOCK_H heads: a [tokens, heads] tile of dt, read along its rows (dt is [T, H])."""
        c, hb = tl.program_id(0), tl.program_id(1)
        _seq, _j, tok0, tok1 = locate_block(c, cu_ptr, pos_ptr, S, Q, HAS_POS, BLOCK_S)
        if hb == 0:  # chunk table for the later kernels: (first token, end token)
            tl.store(meta_ptr + 2 * c, tok0)
            tl.store(meta_ptr + 2 * c + 1, tok1)
        t = tok0 + tl.arange(0, BLOCK_Q)
        h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        mh = h < H
        m = (t < tok1)[:, None] & mh[None, :]
        dt = tl.load(dt_ptr + t[:, None] * dt_t + h[None, :] * dt_h, mask=m, other=0.0).to(tl.float32)
        bias = bias_ptr + tl.minimum(h, H - 1)[None, :]
        dt = tl.where(m, dt_prologue(dt, bias, dt_lo, dt_hi, HAS_BIAS, SOFTPLUS, CLAMP), 0.0)
        cs = tl.cumsum(dt * tl.load(A_ptr + h, mask=mh, other=0.0).to(tl.float32)[None, :], 0)
        tl.store(dtp_ptr + h[None, :] * T + t[:, None], dt, mask=m)
        tl.store(cs_ptr + h[None, :] * T + t[:, None], cs, mask=m)
        # the state kernel's token weights exp(cs_end - cs_t) dt_t, cs_end the chunk's last cs
        cs_end = tl.sum(tl.where((t == tok1 - 1)[:, None], cs, 0.0), 0)
        w = tl.where(m, tl.exp(tl.minimum(cs_end[None, :] - cs, 0.0)) * dt, 0.0)
        tl.store(ws_ptr + h[None, :] * T + t[:, None], w, mask=m)

    @triton.jit
    def _own_state_block(acc, k0, tok1, x_ptr, B_ptr, x_desc, B_desc, ws_ptr, h, g, T, P, N, p0, n0,
                         p, n, mp, mn, x_t, x_h, x_p, B_t, B_g, B_n,
                         BLOCK_K: tl.constexpr, TMA: tl.constexpr, PREC: tl.constexpr, DOT_T: tl.constexpr):
        """acc + sum over tokens k0..k0+BLOCK_K (< tok1) of w_k x_k B_k^T: [bp, bn], w_k = exp(cs_end - cs_k) dt_k
        from the prep kernel (one load instead of cs and dt and an exp on the walk's path)."""
        k = k0 + tl.arange(0, BLOCK_K)
        mk = k < tok1
        if TMA:  # rows past tok1 are read (they get weight 0 below), past T they read as 0
            xk = tl.trans(x_desc.load([k0, h * P + p0]))  # [bp, K]
            Bk = B_desc.load([k0, g * N + n0])  # [K, bn]
        else:
            xk = tl.load(x_ptr + k[None, :] * x_t + h * x_h + p[:, None] * x_p, mask=mp[:, None] & mk[None, :],
                         other=0.0)  # [bp, K]
            Bk = tl.load(B_ptr + k[:, None] * B_t + g * B_g + n[None, :] * B_n, mask=mk[:, None] & mn[None, :],
                         other=0.0)  # [K, bn]
        w = tl.load(ws_ptr + h * T + k, mask=mk, other=0.0)  # 0 past the chunk's end (prep kernel)
        return tl.dot((xk * w[None, :]).to(DOT_T), Bk.to(DOT_T), acc, input_precision=PREC)

    @triton.jit(do_not_specialize=["S", "T"])
    def _ssd_states_kernel(x_ptr, B_ptr, x_desc, B_desc, ws_ptr, cs_ptr, dtp_ptr, cu_ptr, pos_ptr, slot_ptr,
                           init_ptr, snap_ptr, snap_len_ptr, start_ptr, ssm_ptr,
                           bnd_ptr, bnd_dest_ptr, S, T, H, P, N, heads_per_group, x_t, x_h, x_p, B_t, B_g, B_n,
                           ss_s, ss_h, ss_p, ss_n,
                           Q: tl.constexpr, QI: tl.constexpr, HAS_POS: tl.constexpr, HAS_BND: tl.constexpr,
                           SNAP: tl.constexpr, SNAP_LEN: tl.constexpr, BLOCK_K: tl.constexpr,
                           BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, N_BLOCKS: tl.constexpr,
                           BLOCK_S: tl.constexpr, UNROLL: tl.constexpr, STAGES: tl.constexpr,
                           CHUNK_STAGES: tl.constexpr, TMA: tl.constexpr, PREC: tl.constexpr,
                           DOT_T: tl.constexpr):
        """Sequence s, head h, a [BLOCK_P, BLOCK_N] tile of the state, chunk after chunk:
        start[c] = state; state = exp(cs_end) state + own(c), own(c) = sum_t exp(cs_end - cs_t) dt_t x_t B_t^T.

        The loads of a chunk do not depend on the carried state, so they pipeline: over the chunk's
        token blocks (``UNROLL`` off, an inner loop of ``STAGES`` stages) or over whole chunks (``UNROLL``
        on: the token blocks unrolled, the chunk loop pipelined).

        ``SNAP``: the state before the sequence's last token also goes to its snapshot slot (``snap_ptr``,
        -1: none); with ``SNAP_LEN`` the state after the first ``snap_len[s]`` tokens of this call instead, a
        position inside the last chunk (the launcher's caller sees to it). The walk of such a sequence stops
        before its last chunk, which runs apart (nothing is added to the pipelined loop): its tokens before the
        position give the snapshot, and the rest are added as a block, a matrix product like the walk's (one rank-one
        update per token was a serial chain of up to a page of tokens: this kernel took 35 us for a hit's 8 x 64 new
        tokens at granite's widths on an H200, 24 us as a block)."""
        pid, h, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        p0, n0 = (pid // N_BLOCKS) * BLOCK_P, (pid % N_BLOCKS) * BLOCK_N
        p = p0 + tl.arange(0, BLOCK_P)
        n = n0 + tl.arange(0, BLOCK_N)
        mp, mn = p < P, n < N
        # sequence s and its chunks, numbered as locate_block numbers them
        s_idx = tl.arange(0, BLOCK_S)
        ms = s_idx < S
        beg_all = tl.load(cu_ptr + s_idx, mask=ms, other=0).to(tl.int32)
        L_all = tl.load(cu_ptr + s_idx + 1, mask=ms, other=0).to(tl.int32) - beg_all
        if HAS_POS:
            pos = tl.load(pos_ptr + s_idx, mask=ms, other=0)
        else:
            pos = tl.zeros([BLOCK_S], dtype=tl.int64)
        off_all = (pos % QI).to(tl.int32)
        nch = tl.where(L_all > 0, (off_all + L_all + QI - 1) // QI, 0)
        nbd = ((pos + L_all) // Q - pos // Q).to(tl.int32)
        before, this = s_idx < s, s_idx == s
        c0 = tl.sum(tl.where(before, nch, 0), 0)
        b0 = tl.sum(tl.where(before, nbd, 0), 0)
        n_chunks = tl.sum(tl.where(this, nch, 0), 0)
        pos_s = tl.sum(tl.where(this, pos, 0), 0)
        beg = tl.sum(tl.where(this, beg_all, 0), 0)
        L = tl.sum(tl.where(this, L_all, 0), 0)
        off = tl.sum(tl.where(this, off_all, 0), 0)

        g = h // heads_per_group
        tile = p[:, None] * N + n[None, :]
        m_tile = mp[:, None] & mn[None, :]
        slot = tl.load(slot_ptr + s).to(tl.int64)
        has_init = tl.load(init_ptr + s) != 0
        sptr = ssm_ptr + slot * ss_s + h * ss_h + p[:, None] * ss_p + n[None, :] * ss_n
        state = tl.load(sptr, mask=(p < tl.where(has_init, P, 0))[:, None] & mn[None, :], other=0.0).to(tl.float32)
        n_walk = n_chunks
        if SNAP:
            snap = tl.load(snap_ptr + s).to(tl.int64)
            n_walk = tl.where(snap >= 0, n_chunks - 1, n_chunks)
        for j in tl.range(0, n_walk, num_stages=CHUNK_STAGES):
            c = c0 + j
            tok0 = beg + tl.maximum(j * QI - off, 0)
            tok1 = beg + tl.minimum((j + 1) * QI - off, L)
            tl.store(start_ptr + (c * H + h).to(tl.int64) * P * N + tile, state.to(start_ptr.dtype.element_ty),
                     mask=m_tile)
            cs_end = tl.load(cs_ptr + h * T + tok1 - 1)
            own = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
            if UNROLL:
                for kb in tl.static_range(QI // BLOCK_K):
                    own = _own_state_block(own, tok0 + kb * BLOCK_K, tok1, x_ptr, B_ptr, x_desc, B_desc, ws_ptr, h, g,
                                           T, P, N, p0, n0, p, n, mp, mn, x_t, x_h, x_p, B_t, B_g, B_n, BLOCK_K, TMA,
                                           PREC, DOT_T)
            else:
                for k0 in tl.range(tok0, tok1, BLOCK_K, num_stages=STAGES):
                    own = _own_state_block(own, k0, tok1, x_ptr, B_ptr, x_desc, B_desc, ws_ptr, h, g, T, P, N, p0, n0,
                                           p, n, mp, mn, x_t, x_h, x_p, B_t, B_g, B_n, BLOCK_K, TMA, PREC, DOT_T)
            state = tl.exp(cs_end) * state + own
            if HAS_BND:  # a chunk that ends on an absolute multiple of Q: the state of that position, if asked
                e = pos_s + (tok1 - beg)
                b = b0 + e // Q - pos_s // Q - 1
                d = tl.load(bnd_dest_ptr + b, mask=e % Q == 0, other=-1)
                tl.store(bnd_ptr + (d * H + h).to(tl.int64) * P * N + tile, state,
                         mask=(p < tl.where(d >= 0, P, 0))[:, None] & mn[None, :])
        if SNAP:
            if (snap >= 0) & (n_chunks > 0):  # the last chunk, apart
                c = c0 + n_chunks - 1
                tok0 = beg + tl.maximum((n_chunks - 1) * QI - off, 0)
                e = beg + L - 1  # the first token after the snapshot: the last one
                if SNAP_LEN:
                    e = beg + tl.load(snap_len_ptr + s).to(tl.int32)
                tl.store(start_ptr + (c * H + h).to(tl.int64) * P * N + tile, state.to(start_ptr.dtype.element_ty),
                         mask=m_tile)
                # the chunk's tokens but the last, weighted exp(cs_{e-1} - cs_k) dt_k as a chunk ending before the
                # last token would weigh them
                cs_ref = tl.load(cs_ptr + h * T + e - 1, mask=e > tok0, other=0.0)
                own = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
                for k0 in tl.range(tok0, e, BLOCK_K):
                    k = k0 + tl.arange(0, BLOCK_K)
                    mk = k < e
                    xk = tl.load(x_ptr + k[None, :] * x_t + h * x_h + p[:, None] * x_p,
                                 mask=mp[:, None] & mk[None, :], other=0.0)  # [bp, K]
                    Bk = tl.load(B_ptr + k[:, None] * B_t + g * B_g + n[None, :] * B_n,
                                 mask=mk[:, None] & mn[None, :], other=0.0)  # [K, bn]
                    cs_k = tl.load(cs_ptr + h * T + k, mask=mk, other=0.0)
                    dt_k = tl.load(dtp_ptr + h * T + k, mask=mk, other=0.0)
                    w = tl.where(mk, tl.exp(tl.minimum(cs_ref - cs_k, 0.0)) * dt_k, 0.0)
                    own = tl.dot((xk * w[None, :]).to(DOT_T), Bk.to(DOT_T), own, input_precision=PREC)
                tl.store(sptr + (snap - slot) * ss_s, (tl.exp(cs_ref) * state + own).to(ssm_ptr.dtype.element_ty),
                         mask=m_tile)
                # then the tokens from e on: what came before decays to the last token, and they add their own
                # (the prep kernel's weights: this chunk ends with the sequence), as in the walk
                end = beg + L
                cs_last = tl.load(cs_ptr + h * T + end - 1)
                own = tl.exp(cs_last - cs_ref) * own
                for k0 in tl.range(e, end, BLOCK_K):
                    own = _own_state_block(own, k0, end, x_ptr, B_ptr, x_desc, B_desc, ws_ptr, h, g, T, P, N, p0, n0,
                                           p, n, mp, mn, x_t, x_h, x_p, B_t, B_g, B_n, BLOCK_K, TMA, PREC, DOT_T)
                state = tl.exp(cs_last) * state + own
                if HAS_BND:
                    e_abs = pos_s + L
                    b = b0 + e_abs // Q - pos_s // Q - 1
                    d = tl.load(bnd_dest_ptr + b, mask=e_abs % Q == 0, other=-1)
                    tl.store(bnd_ptr + (d * H + h).to(tl.int64) * P * N + tile, state,
                             mask=(p < tl.where(d >= 0, P, 0))[:, None] & mn[None, :])
        # slot -1: a padding sequence (prefill CUDA graphs), whose state goes nowhere
        tl.store(sptr, state.to(ssm_ptr.dtype.element_ty),
                 mask=(p < tl.where((n_chunks > 0) & (slot >= 0), P, 0))[:, None] & mn[None, :])

    @triton.jit
    def _ssd_bmm_kernel(C_ptr, B_ptr, meta_ptr, cb_ptr, G, N, C_t, C_g, C_n, B_t, B_g, B_n,
                        Q: tl.constexpr, TILE: tl.constexpr, N_TILES: tl.constexpr, BLOCK_N: tl.constexpr,
                        PREC: tl.constexpr, DOT_T: tl.constexpr):
        """cb[c, g, i, j] = C_i . B_j for chunk-local j <= i < the chunk's length (else 0), tiles with
        j-tile <= i-tile (the output kernel reads only those)."""
        pid, g = tl.program_id(0), tl.program_id(1)
        c = pid // (N_TILES * N_TILES)
        ib = (pid // N_TILES) % N_TILES
        jb = pid % N_TILES
        if jb <= ib:
            tok0 = tl.load(meta_ptr + 2 * c)
            L = tl.load(meta_ptr + 2 * c + 1) - tok0
            i = ib * TILE + tl.arange(0, TILE)
            j = jb * TILE + tl.arange(0, TILE)
            n = tl.arange(0, BLOCK_N)
            mi, mj, mn = i < L, j < L, n < N
            Ci = tl.load(C_ptr + (tok0 + i)[:, None] * C_t + g * C_g + n[None, :] * C_n,
                         mask=mi[:, None] & mn[None, :], other=0.0)  # [TILE, N]
            Bj = tl.load(B_ptr + (tok0 + j)[None, :] * B_t + g * B_g + n[:, None] * B_n,
                         mask=mn[:, None] & mj[None, :], other=0.0)  # [N, TILE]
            cb = tl.dot(Ci.to(DOT_T), Bj.to(DOT_T), input_precision=PREC)
            # zeros above the diagonal and past the chunk's end: the output kernel's factored path takes
            # these tiles as they are (causal mask included)
            cb = tl.where((j[None, :] <= i[:, None]) & mi[:, None] & mj[None, :], cb, 0.0)
            out = cb_ptr + (c * G + g).to(tl.int64) * Q * Q
            tl.store(out + i[:, None] * Q + j[None, :], cb.to(cb_ptr.dtype.element_ty))

    @triton.jit
    def _tile(desc, ptrs, mask, row, col, TMA: tl.constexpr):
        """A tile through its tensor descriptor at [row, col] (TMA: no per-element address work, rows past
        the tensor read as 0) or through ``ptrs`` under ``mask``."""
        if TMA:
            return desc.load([row, col])
        else:
            return tl.load(ptrs, mask=mask, other=0.0)

    @triton.jit
    def _scaled_x(x_desc, xh, dtp_ptr, cs_ptr, at, r, tok0, k0, L, x_t, x_col, mp, MAX_E,
                  BLOCK_K: tl.constexpr, TMA: tl.constexpr):
        """Tokens k0..k0+BLOCK_K of the chunk: x [K, bp] and x scaled per token by dt_k exp(min(r - cs_k, MAX_E))
        (0 past the chunk's end)."""
        kk = k0 + tl.arange(0, BLOCK_K)
        mk = kk < L
        xk = _tile(x_desc, xh + (tok0 + kk)[:, None] * x_t, mk[:, None] & mp[None, :], tok0 + k0, x_col, TMA)
        dt = tl.load(dtp_ptr + at + kk, mask=mk, other=0.0)
        cs = tl.load(cs_ptr + at + kk, mask=mk, other=0.0)
        s = tl.where(mk, dt * tl.exp(tl.minimum(r - cs, MAX_E)), 0.0)
        return xk, xk.to(tl.float32) * s[:, None]

    @triton.jit(do_not_specialize=["T"])
    def _ssd_chunk_scan_kernel(x_ptr, C_ptr, cb_ptr, D_ptr, dtp_ptr, cs_ptr, meta_ptr, start_ptr, y_ptr,
                               x_desc, xm_desc, C_desc, cb_desc, st_desc,
                               T, H, G, P, N, heads_per_group, x_t, x_h, x_p, C_t, C_g, C_n, y_t, y_h, y_p,
                               HAS_D: tl.constexpr, Q: tl.constexpr, M_BLOCKS: tl.constexpr,
                               P_BLOCKS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                               BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, N_BLOCKS: tl.constexpr,
                               STAGES: tl.constexpr, TMA: tl.constexpr, PREC: tl.constexpr, DOT_T: tl.constexpr):
        """Rows i0..i0+BLOCK_M of a chunk, one head, BLOCK_P columns of P.

        y_i = exp(cs_i) C_i S_start + sum_{k <= i} (C_i . B_k) exp(cs_i - cs_k) dt_k x_k (+ D x_i), with cs
        the dA cumsum within the chunk (non-increasing). Every weight is factored through one reference r:
        exp(cs_i - cs_k) = exp(cs_i - r) exp(r - cs_k) and exp(cs_i) = exp(cs_i - r) exp(r). The first
        factor scales the accumulator's rows once at the end, the second x's rows, so each k block is a
        plain product of a C B^T tile as stored (zeros above the diagonal and past the chunk's end,
        ``_ssd_bmm_kernel``) with scaled x, and the start-state term joins the same accumulator.

        r is cs at the row block's middle row where cs spans less than 60 on either side of it over the
        block's rows: then every factor is below e^60, and exp(r - cs_k) for tokens before the block and
        exp(r), both <= 1, underflow only for weights below e^-27 of the others. Otherwise (decay faster
        than e^-60 over half a block) r is cs before the block, the earlier tokens and the start state
        keep factors <= 1, and the diagonal block takes exact pairwise weights."""
        pid = tl.program_id(0)
        h = pid % H
        rest = pid // H
        pb = rest % P_BLOCKS
        cm = rest // P_BLOCKS
        c = cm // M_BLOCKS
        i0 = (cm % M_BLOCKS) * BLOCK_M
        tok0 = tl.load(meta_ptr + 2 * c)
        L = tl.load(meta_ptr + 2 * c + 1) - tok0
        if i0 >= L:  # a row block past the chunk's end, or an empty tail chunk of the grid
            return
        g = h // heads_per_group
        p0 = pb * BLOCK_P
        p = p0 + tl.arange(0, BLOCK_P)
        mp = p < P
        i = i0 + tl.arange(0, BLOCK_M)  # chunk-local rows
        mi = i < L
        t = tok0 + i
        at = h * T + tok0  # this chunk in the [H, T] dt and cs
        r_mid = tl.load(cs_ptr + at + tl.minimum(i0 + BLOCK_M // 2, L) - 1)
        cs_t = tl.load(cs_ptr + at + i, mask=mi, other=r_mid)  # rows past the end: factor 1
        factored = tl.maximum(tl.max(cs_t, 0) - r_mid, r_mid - tl.min(cs_t, 0)) < 60.0
        r = tl.where(factored, r_mid, tl.load(cs_ptr + at + i0 - 1, mask=i0 > 0, other=0.0))
        # start-state term, over N in BLOCK_N slices (fewer live registers and less shared memory)
        acc = tl.zeros([BLOCK_M, BLOCK_P], dtype=tl.float32)
        for nb in tl.static_range(N_BLOCKS):
            n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
            mn = n < N
            Ct = _tile(C_desc, C_ptr + t[:, None] * C_t + g * C_g + n[None, :] * C_n, mi[:, None] & mn[None, :],
                       tok0 + i0, g * N + nb * BLOCK_N, TMA)  # [M, n]
            if TMA:  # start states are [.., H, P, N]: the [p, n] tile, transposed
                st = tl.trans(st_desc.load([(c * H + h) * P + p0, nb * BLOCK_N]))
            else:
                st = tl.load(start_ptr + (c * H + h).to(tl.int64) * P * N + p[None, :] * N + n[:, None],
                             mask=mn[:, None] & mp[None, :], other=0.0)  # [n, bp]
            acc = tl.dot(Ct.to(DOT_T), st.to(DOT_T), acc, input_precision=PREC)
        acc *= tl.exp(r)
        cbp = cb_ptr + (c * G + g).to(tl.int64) * Q * Q + i[:, None] * Q
        cb_row = (c * G + g) * Q + i0
        xh = x_ptr + h * x_h + p[None, :] * x_p
        x_col = h * P + p0
        # tokens before the row block: exp(r - cs_k) <= 1
        for k0 in tl.range(0, i0, BLOCK_K, num_stages=STAGES):
            cb = _tile(cb_desc, cbp + k0 + tl.arange(0, BLOCK_K)[None, :], mi[:, None], cb_row, k0, TMA)  # [M, K]
            _, xs = _scaled_x(x_desc, xh, dtp_ptr, cs_ptr, at, r, tok0, k0, L, x_t, x_col, mp, 0.0, BLOCK_K, TMA)
            acc = tl.dot(cb.to(DOT_T), xs.to(DOT_T), acc, input_precision=PREC)
        if factored:  # the diagonal block like the rest
            if BLOCK_K == BLOCK_M:  # one k block: its x tile is also the D term's
                cb = _tile(cb_desc, cbp + i0 + tl.arange(0, BLOCK_K)[None, :], mi[:, None], cb_row, i0, TMA)
                xd, xs = _scaled_x(x_desc, xh, dtp_ptr, cs_ptr, at, r, tok0, i0, L, x_t, x_col, mp, 60.0, BLOCK_K,
                                   TMA)
                acc = tl.dot(cb.to(DOT_T), xs.to(DOT_T), acc, input_precision=PREC)
            else:
                for k0 in range(i0, tl.minimum(i0 + BLOCK_M, L), BLOCK_K):
                    cb = _tile(cb_desc, cbp + k0 + tl.arange(0, BLOCK_K)[None, :], mi[:, None], cb_row, k0, TMA)
                    _, xs = _scaled_x(x_desc, xh, dtp_ptr, cs_ptr, at, r, tok0, k0, L, x_t, x_col, mp, 60.0, BLOCK_K,
                                      TMA)
                    acc = tl.dot(cb.to(DOT_T), xs.to(DOT_T), acc, input_precision=PREC)
                xd = _tile(xm_desc, xh + t[:, None] * x_t, mi[:, None] & mp[None, :], tok0 + i0, x_col, TMA)
            acc *= tl.exp(cs_t - r)[:, None]
        else:
            acc *= tl.exp(tl.minimum(cs_t - r, 0.0))[:, None]
            for k0 in range(i0, tl.minimum(i0 + BLOCK_M, L), BLOCK_K):
                kk = k0 + tl.arange(0, BLOCK_K)
                mk = kk < L
                cb = _tile(cb_desc, cbp + kk[None, :], mi[:, None], cb_row, k0, TMA).to(tl.float32)
                cs_k = tl.load(cs_ptr + at + kk, mask=mk, other=0.0)
                dt_k = tl.load(dtp_ptr + at + kk, mask=mk, other=0.0)
                w = tl.where((i[:, None] >= kk[None, :]) & mk[None, :],
                             cb * tl.exp(tl.minimum(cs_t[:, None] - cs_k[None, :], 0.0)) * dt_k[None, :], 0.0)
                xk = _tile(x_desc, xh + (tok0 + kk)[:, None] * x_t, mk[:, None] & mp[None, :], tok0 + k0, x_col, TMA)
                acc = tl.dot(w.to(DOT_T), xk.to(DOT_T), acc, input_precision=PREC)
            xd = _tile(xm_desc, xh + t[:, None] * x_t, mi[:, None] & mp[None, :], tok0 + i0, x_col, TMA)
        if HAS_D:
            acc += tl.load(D_ptr + h).to(tl.float32) * xd.to(tl.float32)
        tl.store(y_ptr + t[:, None] * y_t + h * y_h + p[None, :] * y_p, acc.to(y_ptr.dtype.element_ty),
                 mask=mi[:, None] & mp[None, :])
