"""The jitted kernels of paged attention; launchers, tile choices and the references are in
``paged_attention`` (shapes and the meaning of every argument: its module docstring).

Both attention kernels put the query heads that share a KV head into one program's rows, row
``r = token * GP + head_in_group`` (GP = the group padded to a power of two): each K/V tile is read once
per KV head instead of once per query head, which is what decode (one token per sequence) and chunked
prefill over a long cached prefix are bound by. Keys are gathered token by token through the block table
(``page = block_table[j // page_size]``), so every page size (1 included) runs the same tiles; a tile's
keys are contiguous in memory whenever the page holds the whole tile. Softmax is online (flash attention),
in base 2, fp32 from the scores on; the running maximum starts at a finite -1e30, so rows that see no key
(padding rows, empty splits, ``seq_lens == 0``) keep l = 0 and produce 0 without a NaN on the way.
Head dim and page size are compile-time constants: compiled for sm_90 (Triton 3.9) with a runtime
head dim, its mask held the K/V loads to 2 bytes and kept the key loop from pipelining; as constants the
tiles load 16 bytes a thread through cp.async.

  _write_kv_kernel          [T, E/BLOCK]        k, v rows into their slots; slot -1 moves nothing
  _prefill_kernel           [NB, Hkv]           NB = T // BLOCK_T + 2 B programs (``locate_block``: no host
                                                sync), one block of BLOCK_T new tokens x the group's heads;
                                                keys below the block's first position need no causal mask
                                                (one loop), the diagonal keys get it (a second loop)
  _decode_kernel            [B, Hkv, SPLITS]    flash decoding: split s of row b takes an equal share of the
                                                row's keys (the share sized on the device from seq_lens, so a
                                                CUDA graph sized for the longest context spreads short ones
                                                over all splits too); unsplit (SPLIT false) it writes the
                                                output directly. SPLITS is a runtime argument: two compiles
                                                serve every batch size
  _decode_reduce_kernel     [B, Hq]             merges the splits' (output, log-sum-exp) pairs

write_kv and the decode kernels launch with programmatic dependent launch where the other decode kernels
do (``pdl_args``: Hopper, ``MAMBASERVE_PDL``): ``pdl_start`` first, no read before its wait, so they join the
decode step's chain without moving any access ahead of the kernel that produces it.
"""

from __future__ import annotations

from mambaserve.kernels._dispatch import HAS_TRITON, locate_block, pdl_start, tl, triton

if HAS_TRITON:
    # the running maximum's start and an empty split's log-sum-exp: finite, so no inf - inf
    NEG = tl.constexpr(-1.0e30)

    @triton.jit
    def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, E: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                         k_t, k_h, k_d, v_t, v_h, v_d, kc_p, kc_o, kc_h, kc_d, vc_p, vc_o, vc_h, vc_d,
                         BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
        """Grid (T, cdiv(Hkv * D, BLOCK)): elements ``[BLOCK]`` of token t's K and V rows."""
        pdl_start(USE_PDL)
        t, pe = tl.program_id(0), tl.program_id(1)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        e = pe * BLOCK + tl.arange(0, BLOCK)
        m = e < tl.where(slot >= 0, E, 0)  # scalar flag folded into the bound
        slot = tl.maximum(slot, 0)
        page, off = slot // PAGE, slot % PAGE
        h, d = e // D, e % D
        t64 = t.to(tl.int64)
        k = tl.load(k_ptr + t64 * k_t + h * k_h + d * k_d, mask=m)
        v = tl.load(v_ptr + t64 * v_t + h * v_h + d * v_d, mask=m)
        tl.store(kc_ptr + page * kc_p + off * kc_o + h * kc_h + d * kc_d, k.to(kc_ptr.dtype.element_ty), mask=m)
        tl.store(vc_ptr + page * vc_p + off * vc_o + h * vc_h + d * vc_d, v.to(vc_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _attend(acc, m_i, l_i, q, kc_ptr, vc_ptr, bt_ptr, lo, hi, lim, q_pos, d, md,
                kc_p, kc_o, kc_d, vc_p, vc_o, vc_d, qk_scale, cap_scale, window, PAGE: tl.constexpr,
                CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK_N: tl.constexpr,
                DOT_T: tl.constexpr, PREC: tl.constexpr):
        """Online softmax of the rows ``q`` [BLOCK_M, BLOCK_D] over keys ``[lo, hi)``, those ``>= lim``
        masked; ``kc_ptr`` / ``vc_ptr`` already point at the KV head. CAUSAL / WINDOW: row r sees key j
        only when ``j <= q_pos[r]`` / ``j > q_pos[r] - window``. Scores in base 2: ``qk_scale`` is
        ``scale * log2(e)``, or with SOFTCAP ``cap * log2(e)`` after ``tanh(s * cap_scale)``."""
        for n0 in range(lo, hi, BLOCK_N):
            j = n0 + tl.arange(0, BLOCK_N)
            mj = j < lim
            page = tl.load(bt_ptr + j // PAGE, mask=mj, other=0).to(tl.int64)
            off = (j % PAGE).to(tl.int64)
            mk = mj[None, :] & md[:, None]
            kt = tl.load(kc_ptr + page[None, :] * kc_p + off[None, :] * kc_o + d[:, None] * kc_d, mask=mk,
                         other=0.0)  # [BLOCK_D, BLOCK_N]
            s = tl.dot(q, kt.to(DOT_T), input_precision=PREC)
            if SOFTCAP:
                s = (2.0 * tl.sigmoid(2.0 * cap_scale * s) - 1.0) * qk_scale  # tanh(x) = 2 sigmoid(2x) - 1
            else:
                s = s * qk_scale
            vis = mj[None, :]
            if CAUSAL:
                vis = vis & (j[None, :] <= q_pos[:, None])
            if WINDOW:
                vis = vis & (j[None, :] > q_pos[:, None] - window)
            s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(vc_ptr + page[:, None] * vc_p + off[:, None] * vc_o + d[None, :] * vc_d,
                        mask=mj[:, None] & md[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
            acc = acc * alpha[:, None] + tl.dot(p.to(DOT_T), v.to(DOT_T), input_precision=PREC)
            m_i = m_new
        return acc, m_i, l_i

    # Batch counts, block-table widths and split counts change from step to step: not specialised (== 1, % 16) and
    # free not to be (they bound masks and index rows, no vector access is aligned by them), so the variants left
    # are the constexprs' (``server/engine/warm_up.py`` compiles them at start).
    @triton.jit(do_not_specialize=["S", "bt_b", "max_tok"])
    def _prefill_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, cu_ptr, lens_ptr, out_ptr, S, D: tl.constexpr, G,
                        qk_scale, cap_scale, window,
                        q_t, q_h, q_d, kc_p, kc_o, kc_h, kc_d, vc_p, vc_o, vc_h, vc_d, bt_b, max_tok, o_t, o_h, o_d,
                        PAGE: tl.constexpr, GP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_D: tl.constexpr,
                        BLOCK_S: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
                        DOT_T: tl.constexpr, PREC: tl.constexpr):
        """Grid (NB, Hkv). Rows: BLOCK_T tokens x GP heads of KV head ``kvh``'s group. A sequence's blocks
        run last one first: the blocks with the most keys start earliest, so they do not make the tail."""
        pid, kvh = tl.program_id(0), tl.program_id(1)
        seq, blk, tok0, tok1 = locate_block(pid, cu_ptr, cu_ptr, S, BLOCK_T, False, BLOCK_S)
        has = seq < S  # past the last block: no rows, no keys, nothing stored
        # never past the block table's row (max_tok = its width x PAGE): a bad length reads nothing out of bounds
        L = tl.minimum(tl.load(lens_ptr + seq, mask=has, other=0), max_tok)
        first = tl.load(cu_ptr + seq, mask=has, other=0)
        n = tl.load(cu_ptr + seq + 1, mask=has, other=0) - first
        blk = tl.where(has, tl.cdiv(n, BLOCK_T) - 1 - blk, 0)
        tok0 = first + blk * BLOCK_T
        tok1 = tl.where(has, tl.minimum(tok0 + BLOCK_T, first + n), tok0)
        p0 = L - n + blk * BLOCK_T  # absolute position of the block's first token
        r = tl.arange(0, BLOCK_T * GP)
        tok = tok0 + r // GP
        hg = r % GP
        mrow = (tok < tok1) & (hg < G)
        q_pos = tl.where(mrow, p0 + r // GP, -1)
        hq = (kvh * G + hg).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        md = d < D
        tok64 = tok.to(tl.int64)
        q = tl.load(q_ptr + tok64[:, None] * q_t + hq[:, None] * q_h + d[None, :] * q_d,
                    mask=mrow[:, None] & md[None, :], other=0.0).to(DOT_T)
        kc = kc_ptr + kvh.to(tl.int64) * kc_h
        vc = vc_ptr + kvh.to(tl.int64) * vc_h
        bt = bt_ptr + seq.to(tl.int64) * bt_b
        acc = tl.zeros([BLOCK_T * GP, BLOCK_D], dtype=tl.float32)
        m_i = tl.full([BLOCK_T * GP], NEG, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_T * GP], dtype=tl.float32)
        end = tl.where(has, p0 + (tok1 - tok0), 0)  # one past the block's last position
        if WINDOW:
            lo = tl.maximum(p0 - window + 1, 0) // BLOCK_N * BLOCK_N
            acc, m_i, l_i = _attend(acc, m_i, l_i, q, kc, vc, bt, lo, end, end, q_pos, d, md,
                                    kc_p, kc_o, kc_d, vc_p, vc_o, vc_d, qk_scale, cap_scale, window, PAGE,
                                    True, True, SOFTCAP, BLOCK_N, DOT_T, PREC)
        else:
            # keys up to p0 are visible to every row: no causal mask below the last whole tile of them
            full = tl.where(has, tl.maximum(p0 + 1, 0) // BLOCK_N * BLOCK_N, 0)
            acc, m_i, l_i = _attend(acc, m_i, l_i, q, kc, vc, bt, 0, full, end, q_pos, d, md,
                                    kc_p, kc_o, kc_d, vc_p, vc_o, vc_d, qk_scale, cap_scale, window, PAGE,
                                    False, False, SOFTCAP, BLOCK_N, DOT_T, PREC)
            acc, m_i, l_i = _attend(acc, m_i, l_i, q, kc, vc, bt, full, end, end, q_pos, d, md,
                                    kc_p, kc_o, kc_d, vc_p, vc_o, vc_d, qk_scale, cap_scale, window, PAGE,
                                    True, False, SOFTCAP, BLOCK_N, DOT_T, PREC)
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(out_ptr + tok64[:, None] * o_t + hq[:, None] * o_h + d[None, :] * o_d,
                 o.to(out_ptr.dtype.element_ty), mask=mrow[:, None] & md[None, :])

    @triton.jit(do_not_specialize=["bt_b", "max_tok", "SPLITS"])
    def _decode_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, lens_ptr, out_ptr, part_ptr, lse_ptr, D: tl.constexpr, G,
                       qk_scale, cap_scale, window,
                       q_b, q_h, q_d, kc_p, kc_o, kc_h, kc_d, vc_p, vc_o, vc_h, vc_d, bt_b, max_tok, o_b, o_h, o_d,
                       SPLITS, PAGE: tl.constexpr, SPLIT: tl.constexpr, GP: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr,
                       BLOCK_D: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
                       DOT_T: tl.constexpr, PREC: tl.constexpr, USE_PDL: tl.constexpr = False):
        """Grid (B, Hkv, SPLITS). Rows: the group's heads (BLOCK_M >= 16 for the matrix unit, the rest
        masked). Split s covers keys ``[lo + s * share, lo + (s + 1) * share)`` of ``[lo, L)``, lo the
        window's first key; every key in it is at or before the query's position L - 1, so no causal mask."""
        pdl_start(USE_PDL)
        b, kvh, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        L = tl.minimum(tl.load(lens_ptr + b), max_tok)  # as in the prefill kernel
        lo = 0
        if WINDOW:
            lo = tl.maximum(L - window, 0)
        share = tl.cdiv(tl.cdiv(L - lo, SPLITS), BLOCK_N) * BLOCK_N
        k0 = lo + sp * share
        k1 = tl.minimum(k0 + share, L)
        r = tl.arange(0, BLOCK_M)
        mrow = r < G
        hq = (kvh * G + r).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        md = d < D
        b64 = b.to(tl.int64)
        q = tl.load(q_ptr + b64 * q_b + hq[:, None] * q_h + d[None, :] * q_d, mask=mrow[:, None] & md[None, :],
                    other=0.0).to(DOT_T)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], NEG, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc, m_i, l_i = _attend(acc, m_i, l_i, q, kc_ptr + kvh.to(tl.int64) * kc_h, vc_ptr + kvh.to(tl.int64) * vc_h,
                                bt_ptr + b64 * bt_b, k0, k1, k1, r, d, md, kc_p, kc_o, kc_d, vc_p, vc_o, vc_d,
                                qk_scale, cap_scale, window, PAGE, False, False, SOFTCAP, BLOCK_N, DOT_T, PREC)
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        mo = mrow[:, None] & md[None, :]
        if not SPLIT:
            tl.store(out_ptr + b64 * o_b + hq[:, None] * o_h + d[None, :] * o_d, o.to(out_ptr.dtype.element_ty),
                     mask=mo)
        else:  # partials [B, Hq, SPLITS, BLOCK_D] and log2-sum-exp [B, Hq, SPLITS], fp32, contiguous
            row = (b64 * (G * tl.num_programs(1)) + hq) * SPLITS + sp
            tl.store(part_ptr + row[:, None] * BLOCK_D + d[None, :], o, mask=mo)
            lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), NEG)
            tl.store(lse_ptr + row, lse, mask=mrow)

    @triton.jit(do_not_specialize=["SPLITS"])
    def _decode_reduce_kernel(part_ptr, lse_ptr, out_ptr, SPLITS, o_b, o_h, o_d, D: tl.constexpr,
                              BLOCK_SPLITS: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr = False):
        """Grid (B, Hq): out = sum_s 2^(lse_s - max) o_s / sum_s 2^(lse_s - max); all splits empty -> 0."""
        pdl_start(USE_PDL)
        b, h = tl.program_id(0), tl.program_id(1)
        s = tl.arange(0, BLOCK_SPLITS)
        ms = s < SPLITS
        d = tl.arange(0, BLOCK_D)
        row = (b.to(tl.int64) * tl.num_programs(1) + h) * SPLITS
        lse = tl.load(lse_ptr + row + s, mask=ms, other=NEG)
        w = tl.where(ms, tl.exp2(lse - tl.max(lse, 0)), 0.0)
        o = tl.load(part_ptr + (row + s)[:, None] * BLOCK_D + d[None, :], mask=ms[:, None] & (d < D)[None, :],
                    other=0.0)
        o = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
        tl.store(out_ptr + b.to(tl.int64) * o_b + h * o_h + d * o_d, o.to(out_ptr.dtype.element_ty), mask=d < D)
