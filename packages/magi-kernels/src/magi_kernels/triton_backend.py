"""Fused GPU backend (Triton): flash attention over (q_range, k_range, mask_type) slices.

This module launches a plan (``plan.AttentionPlan``: kernels, tiles, tile tables and program
orders, built on the host by ``plan`` and ``tiles``); it holds the Triton kernels and reads no
configuration of its own.

Forward: one program per (query tile, query head). Keys of each member are pruned to the
tile's visible extent and walked in three runs: partial blocks before, full blocks (no element
mask, no -inf bookkeeping; optionally TMA descriptor loads), partial blocks after. Online
softmax in base 2, fp32 accumulation. On sm90 at d=128 the forward runs instead as the
warp-specialised Gluon kernel of ``gluon_fwd`` over the same tile tables (``plan.use_gluon_fwd``).

Backward (no atomics): a preprocess kernel computes delta = rowsum(dO * O) - dLSE (head-major);
dK/dV programs, one per (key tile, KV head), loop over the GQA group and the visible query
blocks; dQ programs, one per (query tile, query head), loop over the visible keys. Scores are
recomputed in both. With a single layer on each axis both kinds run in one launch.

Tiles of a launch are ordered longest first, heads fastest, so the heaviest work starts first
and programs sharing K/V run side by side (the Gluon forward launches them KV-major: each KV
head's tiles x query heads in turn, see ``gluon_fwd``). Pointer offsets of the token axis are 64-bit.

Importable without triton; ``AVAILABLE`` says whether it can run.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from . import gluon_bwd, gluon_common, gluon_fwd
from . import plan as planning
from .kernel_config import KernelConfig, resolve_kernel_config
from .plan import SUPPORTED_HEAD_DIMS, AttentionPlan, DeviceCaps, call_plan, kernel_head_dim

LOG2E = 1.4426950408889634

try:
    import triton
    import triton.language as tl

    AVAILABLE = True
except ImportError:  # CPU-only installs
    AVAILABLE = False


def supports_head_dim(d: int) -> bool:
    """Whether the Triton backend runs head dim ``d`` (natively or zero-padded)."""
    return kernel_head_dim(d) is not None


def _pad_head_dim(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Zero-pad the last dim of each tensor to its kernel head dim (copies)."""
    pad = kernel_head_dim(xs[0].shape[-1]) - xs[0].shape[-1]
    return tuple(torch.nn.functional.pad(x, (0, pad)) for x in xs)


if AVAILABLE:
    from .epilogue_jit import lse_merge_weights, softmax_lse
    from .slice_bounds_jit import key_tile_rows
    from .slice_bounds_jit import row_bounds as _row_bounds

    @triton.jit
    def _tanh(x):
        return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)

    @triton.jit
    def _load_slice(META, sid):
        """(qs, qe, ks, ke, inv_causal, causal) of slice ``sid``."""
        qs = tl.load(META + sid * 5 + 0)
        qe = tl.load(META + sid * 5 + 1)
        ks = tl.load(META + sid * 5 + 2)
        ke = tl.load(META + sid * 5 + 3)
        t = tl.load(META + sid * 5 + 4)
        return qs, qe, ks, ke, (t & 2) != 0, (t & 1) != 0

    @triton.jit
    def _tile(TILES, pid, NH):
        """Program ``pid`` of a launch over (tile, head) pairs, heads fastest: (head, first row,
        end row, first member, member count) of its tile."""
        t = TILES + (pid // NH) * 4
        return pid % NH, tl.load(t), tl.load(t + 1), tl.load(t + 2), tl.load(t + 3)

    @triton.jit
    def _runs(lo, hi, full_lo, full_hi, B: tl.constexpr):
        """Split [lo, hi) walked in steps of B into partial / full / partial runs: returns the
        run edges (b1, b2); blocks starting in [b1, b2) lie inside [full_lo, full_hi)."""
        n = tl.cdiv(tl.maximum(hi - lo, 0), B)
        j0 = tl.minimum(tl.cdiv(tl.maximum(full_lo - lo, 0), B), n)
        j1 = tl.minimum(tl.maximum(tl.minimum(full_hi, hi) - lo, 0) // B, n)
        return lo + j0 * B, lo + tl.maximum(j0, j1) * B

    @triton.jit
    def _q_tile(Q, K, V, TILES, pid, HQ, GROUP: tl.constexpr, BM: tl.constexpr, D: tl.constexpr):
        """Setup of a query-tile program (forward, dQ): head, tile rows and members, q offsets
        (``base + loc``), the loaded q tile and the K/V head pointers."""
        h, m0, t_end, first, count = _tile(TILES, pid, HQ)
        rows = m0 + tl.arange(0, BM)
        rmask = rows < t_end
        sqt = HQ * D
        base = m0.to(tl.int64) * sqt + h * D
        loc = tl.arange(0, BM)[:, None] * sqt + tl.arange(0, D)[None, :]
        q = tl.load(Q + base + loc, mask=rmask[:, None], other=0.0)
        Kp = K + (h // GROUP) * D
        Vp = V + (h // GROUP) * D
        return h, m0, t_end, first, count, rows, rmask, base, loc, q, Kp, Vp

    @triton.jit
    def _q_member(META, MEMBERS, i, m0, t_end, rows, BM: tl.constexpr, BN: tl.constexpr):
        """Keys of member ``i`` of a query tile: per-row bounds [lo, hi), the tile's key extent
        [k_lo, k_hi) and the partial/full/partial run edges b1, b2."""
        qs, qe, ks, ke, inv, cau = _load_slice(META, tl.load(MEMBERS + i))
        lo, hi = _row_bounds(rows, qs, qe, ks, ke, inv, cau)
        hi = tl.where(rows < qe, hi, lo)  # tile rows past this slice (another member's) see none of it
        last = tl.minimum(m0 + BM, qe) - 1
        k_lo = tl.where(inv, ks + m0 - qs, ks)
        k_hi = tl.minimum(tl.where(cau, last + ke - qe + 1, ke), ke)
        full_lo = tl.where(inv, ks + last - qs, ks)  # keys every row of the tile sees
        full_hi = tl.minimum(tl.where(cau, m0 + ke - qe + 1, ke), ke)
        full_hi = tl.where(qe < t_end, full_lo, full_hi)  # rows of other members: no block is full
        b1, b2 = _runs(k_lo, k_hi, full_lo, full_hi, BN)
        return lo, hi, k_lo, k_hi, b1, b2

    @triton.jit
    def _kv_block_ptrs(Kp, Vp, skt, start, BN: tl.constexpr, D: tl.constexpr):
        offs = start.to(tl.int64) * skt + tl.arange(0, BN)[:, None] * skt + tl.arange(0, D)[None, :]
        return Kp + offs, Vp + offs

    @triton.jit
    def _load_kv(kp, vp, cols, k_hi, MASKED: tl.constexpr):
        """K and V blocks; partial blocks are zero past k_hi."""
        if MASKED:
            k = tl.load(kp, mask=(cols < k_hi)[:, None], other=0.0)
            v = tl.load(vp, mask=(cols < k_hi)[:, None], other=0.0)
        else:
            k = tl.load(kp)
            v = tl.load(vp)
        return k, v

    @triton.jit
    def _scores(q, kT, qk_scale, cap_in, cap_out, HAS_SOFTCAP: tl.constexpr):
        """Scores in base 2 (and tanh of the softcap, for the backward)."""
        s = tl.dot(q, kT)
        if HAS_SOFTCAP:
            th = _tanh(s * cap_in)
            return th * cap_out, th
        return s * qk_scale, s

    @triton.jit
    def _fwd_runs(acc, l_i, m_i, q, Kp, Vp, KD, VD, hk, skt, start, end, k_hi, lo, hi, qk_scale, cap_in, cap_out,
                  BN: tl.constexpr, D: tl.constexpr, MASKED: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                  TMA: tl.constexpr):
        kp, vp = _kv_block_ptrs(Kp, Vp, skt, start, BN, D)
        for kb in tl.range(start, end, BN):
            cols = kb + tl.arange(0, BN)
            if TMA and not MASKED:  # full blocks: rows lie inside the slice, no bounds to mask
                k = KD.load([kb, hk * D])
                v = VD.load([kb, hk * D])
            else:
                k, v = _load_kv(kp, vp, cols, k_hi, MASKED)
            s, _ = _scores(q, tl.trans(k), qk_scale, cap_in, cap_out, HAS_SOFTCAP)
            if MASKED:
                s = tl.where((cols[None, :] >= lo[:, None]) & (cols[None, :] < hi[:, None]), s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows without a key yet
            else:
                m_new = tl.maximum(m_i, tl.max(s, 1))
                m_use = m_new
            p = tl.exp2(s - m_use[:, None])
            alpha = tl.exp2(m_i - m_use)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
            m_i = m_new
            kp += BN * skt
            vp += BN * skt
        return acc, l_i, m_i

    @triton.jit
    def _fwd_kernel(
        Q, K, V, KD, VD, O, LSE, ROWMAX, META, TILES, MEMBERS,
        HQ, qk_scale, cap_in, cap_out,
        GROUP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr, ACCUM: tl.constexpr, TMA: tl.constexpr, HAS_ROWMAX: tl.constexpr,
    ):
        h, m0, t_end, first, count, rows, rmask, base, loc, q, Kp, Vp = _q_tile(
            Q, K, V, TILES, tl.program_id(0), HQ, GROUP, BM, D)
        skt = HQ // GROUP * D
        hk = h // GROUP
        m_i = tl.full([BM], float("-inf"), tl.float32)
        l_i = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, D], tl.float32)
        for i in range(first, first + count):  # members: one online softmax over all their keys
            lo, hi, k_lo, k_hi, b1, b2 = _q_member(META, MEMBERS, i, m0, t_end, rows, BM, BN)
            acc, l_i, m_i = _fwd_runs(acc, l_i, m_i, q, Kp, Vp, KD, VD, hk, skt, k_lo, b1, k_hi, lo, hi, qk_scale,
                                      cap_in, cap_out, BN, D, True, HAS_SOFTCAP, TMA)
            acc, l_i, m_i = _fwd_runs(acc, l_i, m_i, q, Kp, Vp, KD, VD, hk, skt, b1, b2, k_hi, lo, hi, qk_scale,
                                      cap_in, cap_out, BN, D, False, HAS_SOFTCAP, TMA)
            acc, l_i, m_i = _fwd_runs(acc, l_i, m_i, q, Kp, Vp, KD, VD, hk, skt, b2, k_hi, k_hi, lo, hi, qk_scale,
                                      cap_in, cap_out, BN, D, True, HAS_SOFTCAP, TMA)
        l_safe, lse = softmax_lse(l_i, m_i)
        o = acc / l_safe[:, None]
        optr = O + base + loc
        lptr = LSE + m0.to(tl.int64) * HQ + h + tl.arange(0, BM) * HQ
        if ACCUM:
            old_l = tl.load(lptr, mask=rmask, other=float("-inf"))
            old_o = tl.load(optr, mask=rmask[:, None], other=0.0)
            wa, wb, den_safe, lse = lse_merge_weights(old_l, lse)
            o = (old_o * wa[:, None] + o * wb[:, None]) / den_safe[:, None]
        tl.store(optr, o.to(O.dtype.element_ty), mask=rmask[:, None])
        tl.store(lptr, lse, mask=rmask)
        if HAS_ROWMAX:  # the row's largest scaled logit (m_i is in base 2), max-merged into what is there
            mptr = ROWMAX + m0.to(tl.int64) * HQ + h + tl.arange(0, BM) * HQ
            old_m = tl.load(mptr, mask=rmask, other=float("-inf"))
            tl.store(mptr, tl.maximum(old_m, m_i * 0.6931471805599453), mask=rmask)

    @triton.jit
    def _bwd_preprocess_kernel(O, DO, LSE, DLSE, DELTA, LSE2, DQ, n_rows, HQ, T, D: tl.constexpr, BR: tl.constexpr,
                               ZERO_DQ: tl.constexpr):
        """Per (token, head) row: delta = rowsum(dO * O) - dLSE and the lse in base 2, written
        head-major ([HQ, T]) so the backward kernels read them contiguously. ``ZERO_DQ``: also
        zero the row of the fp32 dQ accumulator DQ ([T, HQ, D], the rows of O), which the
        backward then adds into (one launch and pass less than a separate fill)."""
        r = tl.program_id(0) * BR + tl.arange(0, BR)
        rm = r < n_rows
        r64 = r.to(tl.int64)
        x = tl.arange(0, D)
        if ZERO_DQ:
            tl.store(DQ + r64[:, None] * D + x[None, :], tl.zeros([BR, D], tl.float32), mask=rm[:, None])
        o = tl.load(O + r64[:, None] * D + x[None, :], mask=rm[:, None], other=0.0).to(tl.float32)
        do = tl.load(DO + r64[:, None] * D + x[None, :], mask=rm[:, None], other=0.0).to(tl.float32)
        dl = tl.load(DLSE + r64, mask=rm, other=0.0)
        hm = (r64 % HQ) * T + r64 // HQ
        tl.store(DELTA + hm, tl.sum(o * do, 1) - dl, mask=rm)
        tl.store(LSE2 + hm, tl.load(LSE + r64, mask=rm, other=0.0) * 1.4426950408889634, mask=rm)

    @triton.jit
    def _dq_runs(dq, q, do, lse2, delta, Kp, Vp, skt, start, end, k_hi, lo, hi, qk_scale, cap_in, cap_out,
                 BN: tl.constexpr, D: tl.constexpr, MASKED: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
        kp, vp = _kv_block_ptrs(Kp, Vp, skt, start, BN, D)
        for kb in tl.range(start, end, BN):
            cols = kb + tl.arange(0, BN)
            k, v = _load_kv(kp, vp, cols, k_hi, MASKED)
            s, th = _scores(q, tl.trans(k), qk_scale, cap_in, cap_out, HAS_SOFTCAP)
            p = tl.exp2(s - lse2[:, None])
            if MASKED:
                p = tl.where((cols[None, :] >= lo[:, None]) & (cols[None, :] < hi[:, None]), p, 0.0)
            dp = tl.dot(do, tl.trans(v))
            ds = p * (dp - delta[:, None])
            if HAS_SOFTCAP:
                ds = ds * (1.0 - th * th)
            dq = tl.dot(ds.to(k.dtype), k, dq)
            kp += BN * skt
            vp += BN * skt
        return dq

    @triton.jit
    def _dq_program(
        Q, K, V, DO, LSE2, DELTA, DQ, META, TILES, MEMBERS, pid, T,
        HQ, scale, qk_scale, cap_in, cap_out,
        GROUP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr, ACCUM: tl.constexpr,
    ):
        h, m0, t_end, first, count, rows, rmask, base, loc, q, Kp, Vp = _q_tile(Q, K, V, TILES, pid, HQ, GROUP, BM, D)
        skt = HQ // GROUP * D
        do = tl.load(DO + base + loc, mask=rmask[:, None], other=0.0)
        rptr = h.to(tl.int64) * T + rows
        lse2 = tl.load(LSE2 + rptr, mask=rmask, other=0.0)
        lse2 = tl.where(lse2 == float("-inf"), 0.0, lse2)  # rows without keys: p is masked to 0
        delta = tl.load(DELTA + rptr, mask=rmask, other=0.0)
        dq = tl.zeros([BM, D], tl.float32)
        for i in range(first, first + count):
            lo, hi, k_lo, k_hi, b1, b2 = _q_member(META, MEMBERS, i, m0, t_end, rows, BM, BN)
            dq = _dq_runs(dq, q, do, lse2, delta, Kp, Vp, skt, k_lo, b1, k_hi, lo, hi, qk_scale, cap_in, cap_out,
                          BN, D, True, HAS_SOFTCAP)
            dq = _dq_runs(dq, q, do, lse2, delta, Kp, Vp, skt, b1, b2, k_hi, lo, hi, qk_scale, cap_in, cap_out,
                          BN, D, False, HAS_SOFTCAP)
            dq = _dq_runs(dq, q, do, lse2, delta, Kp, Vp, skt, b2, k_hi, k_hi, lo, hi, qk_scale, cap_in, cap_out,
                          BN, D, True, HAS_SOFTCAP)
        dq = dq * scale
        if ACCUM:
            dq += tl.load(DQ + base + loc, mask=rmask[:, None], other=0.0)
        tl.store(DQ + base + loc, dq, mask=rmask[:, None])

    @triton.jit
    def _dkdv_runs(dk, dv, k, v, Qp, DOp, LSEp, DELp, DQp, DQD, h, sqt, start, end, q_hi, cols, qs, qe, ks, ke,
                   inv, cau, scale, qk_scale, cap_in, cap_out,
                   BM: tl.constexpr, D: tl.constexpr, MASKED: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                   DQ_MODE: tl.constexpr):
        d = tl.arange(0, D)
        locT = tl.arange(0, BM)[None, :] * sqt + d[:, None]  # [D, BM] offsets of q^T in a block
        loc = tl.arange(0, BM)[:, None] * sqt + d[None, :]
        for mb in tl.range(start, end, BM):
            # block pointers are rebuilt from the 64-bit row offset each step: carrying pointer
            # tensors (or the offset) through the pipelined loop spills dK/dV at BM=64
            row0 = tl.cast(mb, tl.int64) * sqt
            qTp = Qp + row0 + locT
            dop = DOp + row0 + loc
            rows = mb + tl.arange(0, BM)
            if MASKED:
                rmask = rows < q_hi
                qT = tl.load(qTp, mask=rmask[None, :], other=0.0)
                do = tl.load(dop, mask=rmask[:, None], other=0.0)
                lse2 = tl.load(LSEp + rows, mask=rmask, other=0.0)
                delta = tl.load(DELp + rows, mask=rmask, other=0.0)
            else:
                qT = tl.load(qTp)
                do = tl.load(dop)
                lse2 = tl.load(LSEp + rows)
                delta = tl.load(DELp + rows)
            sT, th = _scores(k, qT, qk_scale, cap_in, cap_out, HAS_SOFTCAP)  # [BN, BM]
            pT = tl.exp2(sT - lse2[None, :])
            if MASKED:
                lo, hi = _row_bounds(rows, qs, qe, ks, ke, inv, cau)
                vis = (cols[:, None] >= lo[None, :]) & (cols[:, None] < hi[None, :]) & rmask[None, :]
                pT = tl.where(vis, pT, 0.0)
            dv = tl.dot(pT.to(do.dtype), do, dv)
            dpT = tl.dot(v, tl.trans(do))
            dsT = pT * (dpT - delta[None, :])
            if HAS_SOFTCAP:
                dsT = dsT * (1.0 - th * th)
            ds16 = dsT.to(qT.dtype)
            dk = tl.dot(ds16, tl.trans(qT), dk)
            if DQ_MODE != 0:  # this block's share of dQ = dS K, added to the fp32 dQ in memory
                dq = tl.dot(tl.trans(ds16), k) * scale  # rows outside the slice add exact zeros
                dqp = DQp + row0 + loc
                if DQ_MODE == 2:  # TMA bulk reduce-add (rows past the tensor end are dropped)
                    DQD.atomic_add([mb, h * D], dq)
                elif MASKED:
                    tl.atomic_add(dqp, dq, mask=rmask[:, None], sem="relaxed")
                else:
                    tl.atomic_add(dqp, dq, sem="relaxed")
        return dk, dv

    @triton.jit
    def _dkdv_program(
        Q, K, V, DO, LSE2, DELTA, DK, DV, DQ, DQD, META, TILES, MEMBERS, pid, T,
        HQ, scale, qk_scale, cap_in, cap_out,
        GROUP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr, ACCUM: tl.constexpr, DQ_MODE: tl.constexpr,
    ):
        HK = HQ // GROUP
        hk, n0, t_end, first, count = _tile(TILES, pid, HK)
        cols = n0 + tl.arange(0, BN)
        cmask = cols < t_end
        sqt = HQ * D
        skt = HK * D
        d = tl.arange(0, D)
        kbase = n0.to(tl.int64) * skt + hk * D
        kloc = tl.arange(0, BN)[:, None] * skt + d[None, :]
        k = tl.load(K + kbase + kloc, mask=cmask[:, None], other=0.0)
        v = tl.load(V + kbase + kloc, mask=cmask[:, None], other=0.0)
        dk = tl.zeros([BN, D], tl.float32)
        dv = tl.zeros([BN, D], tl.float32)
        for i in range(first, first + count):  # members: the slices whose keys include this block
            qs, qe, ks, ke, inv, cau = _load_slice(META, tl.load(MEMBERS + i))
            q_lo, q_hi, f_lo, f_hi = key_tile_rows(n0, qs, qe, ks, ke, inv, cau, BN)
            b1, b2 = _runs(q_lo, q_hi, f_lo, f_hi, BM)
            # partial blocks in half steps: their element mask is live next to dK/dV, and at BM=64
            # it spills them in every loop (the TMA dQ reduce needs the descriptor's box, BM)
            BMP: tl.constexpr = BM if DQ_MODE == 2 else BM // 2
            for g in range(GROUP):
                h = hk * GROUP + g
                Qp = Q + h * D
                DOp = DO + h * D
                LSEp = LSE2 + h.to(tl.int64) * T
                DELp = DELTA + h.to(tl.int64) * T
                DQp = DQ + h * D
                dk, dv = _dkdv_runs(dk, dv, k, v, Qp, DOp, LSEp, DELp, DQp, DQD, h, sqt, q_lo, b1, q_hi, cols, qs, qe,
                                    ks, ke, inv, cau, scale, qk_scale, cap_in, cap_out, BMP, D, True, HAS_SOFTCAP,
                                    DQ_MODE)
                dk, dv = _dkdv_runs(dk, dv, k, v, Qp, DOp, LSEp, DELp, DQp, DQD, h, sqt, b1, b2, q_hi, cols, qs, qe,
                                    ks, ke, inv, cau, scale, qk_scale, cap_in, cap_out, BM, D, False, HAS_SOFTCAP,
                                    DQ_MODE)
                dk, dv = _dkdv_runs(dk, dv, k, v, Qp, DOp, LSEp, DELp, DQp, DQD, h, sqt, b2, q_hi, q_hi, cols, qs, qe,
                                    ks, ke, inv, cau, scale, qk_scale, cap_in, cap_out, BMP, D, True, HAS_SOFTCAP,
                                    DQ_MODE)
        dk = dk * scale
        kptr = kbase + kloc
        if ACCUM:
            dk += tl.load(DK + kptr, mask=cmask[:, None], other=0.0)
            dv += tl.load(DV + kptr, mask=cmask[:, None], other=0.0)
        tl.store(DK + kptr, dk, mask=cmask[:, None])
        tl.store(DV + kptr, dv, mask=cmask[:, None])

    @triton.jit
    def _bwd_kernel(
        Q, K, V, DO, LSE2, DELTA, DQ, DQD, DK, DV, KV_META, KV_TILES, KV_MEMBERS, Q_META, Q_TILES, Q_MEMBERS, n_kv,
        T, HQ, scale, qk_scale, cap_in, cap_out,
        GROUP: tl.constexpr, BM1: tl.constexpr, BN1: tl.constexpr, BM2: tl.constexpr, BN2: tl.constexpr,
        D: tl.constexpr, HAS_SOFTCAP: tl.constexpr, ACCUM: tl.constexpr, DO_KV: tl.constexpr, DO_Q: tl.constexpr,
        DQ_MODE: tl.constexpr,
    ):
        """Programs [0, n_kv) are dK/dV programs, the rest dQ programs: with one layer on each
        axis both run in one launch (no tail between them, both kinds resident together). With
        DQ_MODE 1 (pointer atomics) or 2 (TMA reduce-add) the dK/dV programs also add dQ and no
        dQ programs run."""
        pid = tl.program_id(0)
        if DO_KV and pid < n_kv:
            _dkdv_program(Q, K, V, DO, LSE2, DELTA, DK, DV, DQ, DQD, KV_META, KV_TILES, KV_MEMBERS, pid, T, HQ,
                          scale, qk_scale, cap_in, cap_out, GROUP, BM1, BN1, D, HAS_SOFTCAP, ACCUM, DQ_MODE)
        elif DO_Q:
            _dq_program(Q, K, V, DO, LSE2, DELTA, DQ, Q_META, Q_TILES, Q_MEMBERS, pid - n_kv, T, HQ, scale,
                        qk_scale, cap_in, cap_out, GROUP, BM2, BN2, D, HAS_SOFTCAP, ACCUM)


def _scale_args(softmax_scale: float, softcap: float) -> tuple[float, float, float]:
    """(qk_scale, cap_in, cap_out): base-2 score = dot * qk_scale, or cap_out * tanh(dot * cap_in)."""
    if softcap > 0:
        return softmax_scale * LOG2E, softmax_scale / softcap, softcap * LOG2E
    return softmax_scale * LOG2E, 1.0, 1.0


def _descriptor(x: torch.Tensor, rows: int, use: bool):
    """2-D TMA descriptor over a [tokens, heads, d] tensor as [tokens, heads*d] with a box of
    ``rows`` tokens x d, or ``x`` itself when TMA is off (the kernel then never reads it as one)."""
    if not use or x.shape[0] == 0:
        return x
    from triton.tools.tensor_descriptor import TensorDescriptor

    flat = x.view(x.shape[0], -1)
    return TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [rows, x.shape[-1]])


def _alloc(shape, dtype, device, covered: bool, fill: float) -> torch.Tensor:
    """Output buffer; rows that no tile writes must hold ``fill``, so fill only when some exist."""
    return torch.empty(shape, dtype=dtype, device=device) if covered else torch.full(shape, fill, dtype=dtype, device=device)


def _device_caps(device: str) -> DeviceCaps:
    """What the planner needs of ``device`` (read per call from cached device queries, so that a
    test may stand in another SM count through ``gluon_common.sm_count``)."""
    if not device.startswith("cuda"):
        return DeviceCaps(device, 0, 1, False, False)
    dev = torch.device(device)
    major = _capability(dev)
    return DeviceCaps(device, major, gluon_common.sm_count(dev), gluon_fwd.AVAILABLE and major == 9,
                      gluon_bwd.AVAILABLE and major == 9)


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> int:
    return torch.cuda.get_device_capability(device)[0]


planning.register_device_caps(_device_caps)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy when its base is not 16-byte aligned (TMA descriptors need it; views at
    an odd offset are rare, and the plan was made for aligned tensors)."""
    return t if t.data_ptr() % 16 == 0 else t.clone()


def ffa_forward(q, k, v, q_ranges, k_ranges, attn_type_map, softmax_scale, softcap, acc_out=False,
                config: KernelConfig | None = None, plan: AttentionPlan | None = None,
                row_max: torch.Tensor | None = None):
    """The forward: (out, lse). ``config``: tiles and pipeline choices (None: the process
    default, ``default_kernel_config``, or the plan's); ``plan``: a plan of these inputs
    (``plan_attention``; None: the memoised one). ``row_max``: fp32 ``[tq, hq]``, max-merged in
    place with each row's largest scaled logit (QK-clip's max logits); the Gluon forward has no
    such output, so these calls run the Triton forward."""
    d = q.shape[-1]
    if d not in SUPPORTED_HEAD_DIMS:  # zero-padded head dim (kernel_head_dim); scale stays the caller's
        out, lse = ffa_forward(*_pad_head_dim(q, k, v), q_ranges, k_ranges, attn_type_map, softmax_scale, softcap,
                               acc_out, config, plan, row_max)
        return out[..., :d].contiguous(), lse
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    fp = call_plan(q, k, q_ranges, k_ranges, attn_type_map, config, plan).forward
    if row_max is not None and fp.kernel == "gluon":
        base = config if config is not None else plan.key.config if plan is not None else None
        triton_fwd = dataclasses.replace(resolve_kernel_config(base), gluon_fwd=False)
        fp = call_plan(q, k, q_ranges, k_ranges, attn_type_map, triton_fwd, None).forward
    tq, hq, d = q.shape
    hk = k.shape[1]
    if fp.kernel == "gluon" or fp.tma:
        q, k, v = _aligned(q), _aligned(k), _aligned(v)
    # one layer writes every row once: the kernel can write q's dtype directly; several layers
    # merge into an fp32 accumulator
    out_dtype = torch.float32 if acc_out or len(fp.layers) > 1 else q.dtype
    out = _alloc((tq, hq, d), out_dtype, q.device, fp.covered, 0.0)
    lse = _alloc((tq, hq), torch.float32, q.device, fp.covered, float("-inf"))
    qk_scale, cap_in, cap_out = _scale_args(softmax_scale, softcap)
    if fp.kernel == "gluon":
        for li, (layer, queue) in enumerate(zip(fp.layers, fp.queues)):
            gluon_fwd.launch(q, k, v, out, lse, fp.meta, layer, queue, fp.tiles, qk_scale, cap_in, cap_out, softcap,
                             li > 0)
    else:
        BM, BN, warps, stages = fp.tiles
        kd, vd = _descriptor(k, BN, fp.tma), _descriptor(v, BN, fp.tma)
        for li, layer in enumerate(fp.layers):
            _fwd_kernel[(layer.n * hq,)](
                q, k, v, kd, vd, out, lse, lse if row_max is None else row_max, fp.meta, layer.tiles, layer.members,
                hq, qk_scale, cap_in, cap_out,
                GROUP=hq // hk, BM=BM, BN=BN, D=d, HAS_SOFTCAP=softcap > 0, ACCUM=li > 0, TMA=fp.tma,
                HAS_ROWMAX=row_max is not None, num_warps=warps, num_stages=stages,
            )
    return (out if acc_out or out.dtype == q.dtype else out.to(q.dtype)), lse


def ffa_backward(do, q, k, v, out, lse, dlse, q_ranges, k_ranges, attn_type_map, softmax_scale, softcap,
                 config: KernelConfig | None = None, plan: AttentionPlan | None = None):
    """The backward: fp32 (dq, dk, dv). ``config`` and ``plan`` as in ``ffa_forward``."""
    d = q.shape[-1]
    if d not in SUPPORTED_HEAD_DIMS:  # as in ffa_forward: padded columns of do/out are 0, so delta is unchanged
        grads = ffa_backward(*_pad_head_dim(do, q, k, v, out), lse, dlse, q_ranges, k_ranges, attn_type_map,
                             softmax_scale, softcap, config, plan)
        return tuple(g[..., :d].contiguous() for g in grads)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    do, out = do.contiguous().to(q.dtype), out.contiguous()
    bp = call_plan(q, k, q_ranges, k_ranges, attn_type_map, config, plan).backward
    tq, hq, d = q.shape
    tk, hk = k.shape[:2]
    dev = q.device
    delta = torch.empty(hq, tq, dtype=torch.float32, device=dev)
    lse2 = torch.empty(hq, tq, dtype=torch.float32, device=dev)
    # the fp32 dQ accumulator: zeroed by the preprocess wherever the kernels add into it (the
    # Gluon backward and the Triton dK/dV programs' atomics or TMA adds), and wherever the
    # Triton dQ programs leave rows unwritten; left as is where those write every row
    dq = torch.empty(tq, hq, d, dtype=torch.float32, device=dev)
    zero_dq = bp.kernel == "gluon" or bp.dq_mode != "split" or not bp.q_covered
    rows = tq * hq
    if rows:
        _bwd_preprocess_kernel[(triton.cdiv(rows, 64),)](
            out, do, lse.float().contiguous(), dlse.float().contiguous(), delta, lse2, dq, rows, hq, tq,
            D=d, BR=64, ZERO_DQ=zero_dq, num_warps=4)
    qk_scale, cap_in, cap_out = _scale_args(softmax_scale, softcap)
    if bp.kernel == "gluon":  # one pass: dK/dV programs that also reduce-add dQ
        q, k, v, do = _aligned(q), _aligned(k), _aligned(v), _aligned(do)
        dk = _alloc((tk, hk, d), torch.float32, dev, bp.kv_covered, 0.0)
        dv = _alloc((tk, hk, d), torch.float32, dev, bp.kv_covered, 0.0)
        for li, (layer, order, piece_tma) in enumerate(zip(bp.kv_layers, bp.orders, bp.piece_tma)):
            gluon_bwd.launch(q, k, v, do, dq, dk, dv, lse2, delta, bp.kv_meta, layer, order, piece_tma, bp.tiles,
                             bp.rotate, softmax_scale, qk_scale, cap_in, cap_out, softcap, li > 0)
        return dq, dk, dv
    BM1, BN1, warps1, stages1 = bp.tiles
    BM2, BN2, warps2, stages2 = bp.dq_tiles
    dq_mode = bp.dq_mode
    kv_meta, q_meta = bp.kv_meta, bp.q_meta
    dk = _alloc((tk, hk, d), torch.float32, dev, bp.kv_covered, 0.0)
    dv = _alloc((tk, hk, d), torch.float32, dev, bp.kv_covered, 0.0)
    dqd = _descriptor(dq, BM1, dq_mode == "tma")
    none = torch.empty(0, dtype=torch.int32, device=dev)

    def launch(kv_layer, q_layer, accum, warps, stages):
        n_kv = kv_layer.n * hk if kv_layer else 0
        n_q = q_layer.n * hq if q_layer else 0
        if n_kv + n_q == 0:
            return
        _bwd_kernel[(n_kv + n_q,)](
            q, k, v, do, lse2, delta, dq, dqd, dk, dv,
            kv_meta, *(kv_layer[:2] if kv_layer else (none, none)),
            q_meta, *(q_layer[:2] if q_layer else (none, none)),
            n_kv, tq, hq, softmax_scale, qk_scale, cap_in, cap_out,
            GROUP=hq // hk, BM1=BM1, BN1=BN1, BM2=BM2, BN2=BN2, D=d, HAS_SOFTCAP=softcap > 0, ACCUM=accum,
            DO_KV=kv_layer is not None, DO_Q=q_layer is not None, DQ_MODE=planning.DQ_MODE_IDS[dq_mode],
            num_warps=warps, num_stages=stages,
        )

    if dq_mode != "split":  # the dK/dV programs add dQ: no dQ programs
        for li, layer in enumerate(bp.kv_layers):
            launch(layer, None, li > 0, warps1, stages1)
        return dq, dk, dv
    if bp.fused:  # dK/dV and dQ programs in one launch (one layer on each axis)
        launch(bp.kv_layers[0], bp.q_layers[0], False, warps1, stages1)
    else:  # layers after the first read-modify-write the previous ones: one launch per layer
        for li, layer in enumerate(bp.kv_layers):
            launch(layer, None, li > 0, warps1, stages1)
        for li, layer in enumerate(bp.q_layers):
            launch(None, layer, li > 0, warps2, stages2)
    return dq, dk, dv
