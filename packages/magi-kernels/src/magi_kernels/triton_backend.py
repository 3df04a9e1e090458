"""Fused GPU backend (Triton): flash attention over (q_range, k_range, mask_type) slices.

Tiles: every slice is cut into blocks of rows from its start (query rows for the forward and dQ,
key rows for dK/dV). Slices whose ranges start at the same phase of that grid have coinciding
tiles, so one tile serves all of them: its program loops over the member slices (one online
softmax across their keys, or one dK/dV accumulation across their queries). Only slices that
overlap at a different phase go to separate *layers* (interval colouring on the host); a later
layer LSE-merges (forward) or adds (backward) into the output of the previous ones, so no two
programs ever write the same rows. Packed documents, block-causal, sliding-window and
shared-prefix masks are all one layer.

Forward: one program per (query tile, query head). Keys of each member are pruned to the
tile's visible extent and walked in three runs: partial blocks before, full blocks (no element
mask, no -inf bookkeeping; optionally TMA descriptor loads), partial blocks after. Online
softmax in base 2, fp32 accumulation. On sm90 at d=128 the forward runs instead as the
warp-specialised Gluon kernel of ``gluon_fwd`` over the same tile tables (``_use_gluon``).

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

import functools

import torch
from magi_solver import AttnMaskType, slice_area

from . import gluon_bwd, gluon_fwd
from .env_config import env_choice, env_config, warn_removed_switches
from .host_cache import per_tensor, upload

warn_removed_switches()  # once per process: a removed variant's switch must not look as if it took effect

SUPPORTED_HEAD_DIMS = (64, 128, 256)
# head dims whose forward loads full K/V blocks through TMA descriptors on sm90+ (measured
# faster with the 128x128 tile below; docs/design.md)
TMA_FWD_HEAD_DIMS = (128,)
LOG2E = 1.4426950408889634

try:
    import triton
    import triton.language as tl

    AVAILABLE = True
except ImportError:  # CPU-only installs
    AVAILABLE = False


def kernel_head_dim(d: int) -> int | None:
    """Head dim the kernels run ``d`` at: ``d`` itself if they are compiled for it, else the next
    of SUPPORTED_HEAD_DIMS for a multiple of 8 up to 256 (e.g. 80, 96, 192: zero-padded, which
    leaves scores and outputs unchanged and costs the padded flops), else None."""
    if d in SUPPORTED_HEAD_DIMS:
        return d
    if d % 8 or d <= 0:
        return None
    return next((p for p in SUPPORTED_HEAD_DIMS if p > d), None)


def supports_head_dim(d: int) -> bool:
    """Whether the Triton backend runs head dim ``d`` (natively or zero-padded)."""
    return kernel_head_dim(d) is not None


def _pad_head_dim(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Zero-pad the last dim of each tensor to its kernel head dim (copies)."""
    pad = kernel_head_dim(xs[0].shape[-1]) - xs[0].shape[-1]
    return tuple(torch.nn.functional.pad(x, (0, pad)) for x in xs)


def _layers(slices: tuple[tuple[int, ...], ...], axis: int, block: int) -> list[list[int]]:
    """Colour slices into layers along ``axis`` (0 = q, 2 = k) so that no two tiles of a layer
    write the same rows. Tiles start every ``block`` rows from a slice's start, so slices whose
    starts agree modulo ``block`` (same *phase*) have coinciding tiles and may share a layer even
    when their ranges overlap: such a tile loops over all its slices. Slices of different phase
    share a layer only if their ranges are disjoint. Empty slices are dropped."""
    order = sorted(range(len(slices)), key=lambda i: (slices[i][axis], slices[i][axis + 1]))
    # per layer: {phase: largest end}; a slice starting at s conflicts with a layer if a slice
    # of another phase there ends after s (all earlier slices start at or before s)
    ends: list[dict[int, int]] = []
    layers: list[list[int]] = []
    for i in order:
        s, e = slices[i][axis], slices[i][axis + 1]
        if e <= s or slices[i][2] >= slices[i][3] or slices[i][0] >= slices[i][1]:
            continue
        phase = s % block
        for li, by_phase in enumerate(ends):
            if all(end <= s for ph, end in by_phase.items() if ph != phase):
                layers[li].append(i)
                by_phase[phase] = max(by_phase.get(phase, e), e)
                break
        else:
            layers.append([i])
            ends.append({phase: e})
    return layers


try:
    from . import _native  # C++ tile pairs (same layers and pairs as _layers / _layer_pairs)
except ImportError:
    _native = None


def _layer_pairs(slices: tuple[tuple[int, ...], ...], axis: int, block: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer: (slice index, tile start) of every slice's tiles, int32 CPU tensors, in slice order."""
    if _native is not None:
        def as_t(b: bytes) -> torch.Tensor:
            return torch.frombuffer(bytearray(b), dtype=torch.int32) if b else torch.empty(0, dtype=torch.int32)
        return [(as_t(a), as_t(b)) for a, b, _ in _native.tiles(list(slices), axis, block)]
    out = []
    for layer in _layers(slices, axis, block):
        pairs = [(i, b) for i in layer for b in range(slices[i][axis], slices[i][axis + 1], block)]
        out.append((torch.tensor([p[0] for p in pairs], dtype=torch.int32),
                    torch.tensor([p[1] for p in pairs], dtype=torch.int32)))
    return out


def tile_work(meta: torch.Tensor, sid: torch.Tensor, start: torch.Tensor, axis: int, block: int) -> torch.Tensor:
    """Visible extent on the other axis of each (slice, tile) pair (keys of a q tile, queries of
    a k tile)."""
    s = meta[sid.long()].long()
    qs, qe, ks, ke, t = s.unbind(1)
    inv, cau = (t & 2) != 0, (t & 1) != 0
    b0 = start.long()
    if axis == 0:
        last = torch.minimum(b0 + block, qe) - 1
        lo = torch.where(inv, ks + b0 - qs, ks)
        hi = torch.minimum(torch.where(cau, last + ke - qe + 1, ke), ke)
    else:
        last = torch.minimum(b0 + block, ke) - 1
        lo = torch.maximum(torch.where(cau, b0 - ke + qe, qs), qs)
        hi = torch.minimum(torch.where(inv, last - ks + qs + 1, qe), qe)
    return (hi - lo).clamp(min=0)


def _group_tiles(meta: torch.Tensor, sid: torch.Tensor, start: torch.Tensor, axis: int, block: int):
    """Merge a layer's (slice, tile start) pairs into tiles: a table of (start, end, first member,
    member count) per tile, ordered by descending work, the member slice ids and each tile's work
    (visible rows of the other axis, summed over members; descending). ``end`` is the last row
    any member covers (the tile writes [start, end))."""
    order = torch.sort(start.long() * len(meta) + sid.long(), stable=True).indices  # by start, then slice
    sid, start = sid[order], start[order]
    starts, counts = torch.unique_consecutive(start, return_counts=True)
    tile_of = torch.repeat_interleave(torch.arange(len(starts)), counts)
    pair_end = torch.minimum(start.long() + block, meta[sid.long(), axis + 1].long())
    end = torch.zeros(len(starts), dtype=torch.long).scatter_reduce(0, tile_of, pair_end, "amax", include_self=False)
    work = torch.zeros(len(starts), dtype=torch.long).index_add_(0, tile_of, tile_work(meta, sid, start, axis, block))
    first = torch.cumsum(counts, 0) - counts
    table = torch.stack([starts.long(), end, first, counts.long()], 1)
    by_work = torch.sort(work, descending=True, stable=True).indices
    return table[by_work].to(torch.int32).contiguous(), sid.contiguous(), tuple(work[by_work].tolist())


@functools.lru_cache(maxsize=256)
def _tiles(slices: tuple[tuple[int, ...], ...], axis: int, block: int, device: str, n_rows: int = -1):
    """(slice table, [(tile table, member slice ids, n tiles, work per tile) per layer], layer 0
    covers all rows).

    Tiles run longest first (the work tuple is on the host, descending). The last flag says
    whether layer 0 writes every one of ``n_rows`` rows (then outputs need no zero fill).
    """
    meta_cpu = torch.tensor(slices, dtype=torch.int32).reshape(-1, 5)
    layers, covered = [], 0
    for li, (sid, start) in enumerate(_layer_pairs(slices, axis, block)):
        table, members, work = _group_tiles(meta_cpu, sid, start, axis, block)
        if li == 0:  # tiles of a layer are disjoint: the rows layer 0 writes
            covered = int((table[:, 1] - table[:, 0]).sum())
        layers.append((upload(table, device), upload(members, device), len(table), work))
    return upload(meta_cpu, device), layers, covered == n_rows and all(s[axis + 1] <= n_rows for s in slices)


if AVAILABLE:
    from .epilogue_jit import key_tile_rows
    from .epilogue_jit import row_bounds as _row_bounds
    from .epilogue_jit import lse_merge_weights, softmax_lse

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
        Q, K, V, KD, VD, O, LSE, META, TILES, MEMBERS,
        HQ, qk_scale, cap_in, cap_out,
        GROUP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr, ACCUM: tl.constexpr, TMA: tl.constexpr,
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

    @triton.jit
    def _bwd_preprocess_kernel(O, DO, LSE, DLSE, DELTA, LSE2, n_rows, HQ, T, D: tl.constexpr, BR: tl.constexpr):
        """Per (token, head) row: delta = rowsum(dO * O) - dLSE and the lse in base 2, written
        head-major ([HQ, T]) so the backward kernels read them contiguously."""
        r = tl.program_id(0) * BR + tl.arange(0, BR)
        rm = r < n_rows
        r64 = r.to(tl.int64)
        x = tl.arange(0, D)
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


def _env_config(name: str, default: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
    """Tile config override ``BM,BN,num_warps,num_stages`` from the environment (for tuning runs)."""
    return env_config(name, default, "BM,BN,num_warps,num_stages")  # type: ignore[return-value]


# (BM, BN, num_warps, num_stages) per head dim, from tile sweeps (bench/sweep_tiles.py)
_FWD_DEFAULTS = {64: (128, 64, 4, 3), 128: (128, 64, 8, 3), 256: (64, 32, 4, 3)}
_FWD_TMA_DEFAULTS = {128: (128, 128, 8, 3)}
_DKDV_DEFAULTS = {64: (64, 128, 4, 3), 128: (64, 128, 8, 3), 256: (32, 64, 8, 2)}  # BM = query rows per step
_DQ_DEFAULTS = {64: (128, 64, 4, 3), 128: (128, 64, 8, 3), 256: (64, 32, 8, 2)}


def _fwd_config(d: int, tma: bool = False) -> tuple[int, int, int, int]:
    return _env_config("MAGI_TRITON_FWD_CFG", (_FWD_TMA_DEFAULTS if tma else _FWD_DEFAULTS).get(d, _FWD_DEFAULTS[d]))


def _bwd_config(d: int) -> tuple[int, int, int, int]:
    """dK/dV kernel: BN keys per program, BM query rows per step."""
    return _env_config("MAGI_TRITON_BWD_CFG", _DKDV_DEFAULTS[d])


def _dq_config(d: int) -> tuple[int, int, int, int]:
    return _env_config("MAGI_TRITON_DQ_CFG", _DQ_DEFAULTS[d])


def _host_tuple(q_ranges: torch.Tensor, k_ranges: torch.Tensor, types: torch.Tensor) -> tuple[tuple[int, ...], ...]:
    """Slice table as a hashable tuple, memoised per range tensor (and its in-place version), so
    repeated calls with the same metadata cost a dictionary lookup."""
    def build():
        t = torch.cat([q_ranges.reshape(-1, 2), k_ranges.reshape(-1, 2), types.reshape(-1, 1)], dim=1).tolist()
        return tuple(tuple(r) for r in t)

    return per_tensor(q_ranges, "slice_table", build, k_ranges, types)


@functools.lru_cache(maxsize=256)
def staircase_share(slices: tuple[tuple[int, ...], ...]) -> float:
    """The share of the slices' area in causal / inv_causal slices (the Gluon backward runs such
    launches as pieces where their tiles differ in length, ``program_order.auto_piece_heads``)."""
    stairs = (AttnMaskType.CAUSAL, AttnMaskType.INVCAUSAL)
    areas = [(slice_area(qe - qs, ke - ks, t), t in stairs) for qs, qe, ks, ke, t in slices]
    total = sum(a for a, _ in areas)
    return sum(a for a, stair in areas if stair) / total if total else 0.0


def _scale_args(softmax_scale: float, softcap: float) -> tuple[float, float, float]:
    """(qk_scale, cap_in, cap_out): base-2 score = dot * qk_scale, or cap_out * tanh(dot * cap_in)."""
    if softcap > 0:
        return softmax_scale * LOG2E, softmax_scale / softcap, softcap * LOG2E
    return softmax_scale * LOG2E, 1.0, 1.0


def _use_tma(x: torch.Tensor) -> bool:
    """Whether the forward loads full K/V blocks through TMA descriptors (Hopper and newer;
    Triton's interpreter emulates them): by default for the head dims in TMA_FWD_HEAD_DIMS.
    ``MAGI_TRITON_TMA=0/1`` overrides; partial blocks always use masked pointer loads."""
    env = env_choice("MAGI_TRITON_TMA", "auto", AUTO_SWITCH)
    if env != "auto":
        return env == "1"
    if x.device.type != "cuda":
        return False
    return x.shape[-1] in TMA_FWD_HEAD_DIMS and torch.cuda.get_device_capability(x.device)[0] >= 9


def _descriptor(x: torch.Tensor, rows: int, use: bool):
    """2-D TMA descriptor over a [tokens, heads, d] tensor as [tokens, heads*d] with a box of
    ``rows`` tokens x d, or ``x`` itself when TMA is off (the kernel then never reads it as one)."""
    if not use or x.shape[0] == 0:
        return x
    from triton.tools.tensor_descriptor import TensorDescriptor

    flat = x.view(x.shape[0], -1)
    return TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [rows, x.shape[-1]])


DQ_MODES = {"split": 0, "atomic": 1, "tma": 2}
AUTO_SWITCH = ("auto", "0", "1")  # a kernel switch whose unset value leaves the choice to the backend
DEFAULT_DQ_MODE = "split"  # on sm90+; see _dq_mode


def _dq_override() -> str:
    """``MAGI_TRITON_DQ``: one of ``DQ_MODES``, or "auto" when unset (the backend chooses)."""
    return env_choice("MAGI_TRITON_DQ", "auto", ("auto", *DQ_MODES))


def _dq_mode(x: torch.Tensor) -> str:
    """How the backward computes dQ:

    * ``split``: dQ programs of their own (recompute scores and dP; deterministic);
    * ``atomic``: the dK/dV programs add dS K into an fp32 dQ with pointer atomics;
    * ``tma``: the same through TMA bulk reduce-adds (sm90+; 5 matmuls per block instead of 7).

    The accumulating modes are not bitwise deterministic (the order of the fp32 adds varies), so
    ``torch.use_deterministic_algorithms(True)`` selects ``split``. ``MAGI_TRITON_DQ`` overrides.
    """
    env = _dq_override()
    if env != "auto":
        if env == "tma" and x.device.type == "cuda" and torch.cuda.get_device_capability(x.device)[0] < 9:
            raise ValueError("MAGI_TRITON_DQ=tma needs TMA (sm90+); use 'atomic' or 'split' on this GPU")
        return env
    if torch.are_deterministic_algorithms_enabled() or x.device.type != "cuda":
        return "split"
    return DEFAULT_DQ_MODE if torch.cuda.get_device_capability(x.device)[0] >= 9 else "split"


def _alloc(shape, dtype, device, covered: bool, fill: float) -> torch.Tensor:
    """Output buffer; rows that no tile writes must hold ``fill``, so fill only when some exist."""
    return torch.empty(shape, dtype=dtype, device=device) if covered else torch.full(shape, fill, dtype=dtype, device=device)


def _use_gluon(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the forward runs the warp-specialised Gluon kernel (``gluon_fwd``; sm90, a head
    dim it has a config for, non-empty K/V): by default for ``gluon_fwd.DEFAULT_HEAD_DIMS``.
    ``MAGI_GLUON_FWD=0`` turns it off, ``=1`` turns it on for every head dim it supports."""
    env = env_choice("MAGI_GLUON_FWD", "auto", AUTO_SWITCH)
    if env == "0" or k.shape[0] == 0 or q.shape[0] == 0 or not gluon_fwd.supported(q, k, v):
        return False
    return env == "1" or q.shape[-1] in gluon_fwd.DEFAULT_HEAD_DIMS


def _fwd_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[bool, bool, tuple[int, int, int, int]]:
    """(whether the forward runs the Gluon kernel, whether it loads K/V through TMA, its
    (BM, BN, warps, stages); BM is the query-tile size its tile tables are built for)."""
    gluon = _use_gluon(q, k, v)
    tma = _use_tma(q) and k.data_ptr() % 16 == 0 and v.data_ptr() % 16 == 0  # TMA needs aligned bases
    return gluon, tma, ((gluon_fwd.tile_rows(q.shape[-1]), 0, 0, 0) if gluon else _fwd_config(q.shape[-1], tma))


def ffa_forward(q, k, v, q_ranges, k_ranges, attn_type_map, softmax_scale, softcap, acc_out=False):
    d = q.shape[-1]
    if d not in SUPPORTED_HEAD_DIMS:  # zero-padded head dim (kernel_head_dim); scale stays the caller's
        out, lse = ffa_forward(*_pad_head_dim(q, k, v), q_ranges, k_ranges, attn_type_map, softmax_scale, softcap,
                               acc_out)
        return out[..., :d].contiguous(), lse
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    tq, hq, d = q.shape
    hk = k.shape[1]
    slices = _host_tuple(q_ranges, k_ranges, attn_type_map)
    gluon, tma, (BM, BN, warps, stages) = _fwd_plan(q, k, v)
    meta, layers, covered = _tiles(slices, 0, BM, str(q.device), tq)
    # one layer writes every row once: the kernel can write q's dtype directly; several layers
    # merge into an fp32 accumulator
    out_dtype = torch.float32 if acc_out or len(layers) > 1 else q.dtype
    out = _alloc((tq, hq, d), out_dtype, q.device, covered, 0.0)
    lse = _alloc((tq, hq), torch.float32, q.device, covered, float("-inf"))
    qk_scale, cap_in, cap_out = _scale_args(softmax_scale, softcap)
    kd, vd = (None, None) if gluon else (_descriptor(k, BN, tma), _descriptor(v, BN, tma))
    for li, (tiles, members, n, work) in enumerate(layers):
        if gluon:
            gluon_fwd.launch(q, k, v, out, lse, meta, tiles, members, work, qk_scale, cap_in, cap_out, softcap, li > 0)
            continue
        _fwd_kernel[(n * hq,)](
            q, k, v, kd, vd, out, lse, meta, tiles, members, hq, qk_scale, cap_in, cap_out,
            GROUP=hq // hk, BM=BM, BN=BN, D=d, HAS_SOFTCAP=softcap > 0, ACCUM=li > 0, TMA=tma,
            num_warps=warps, num_stages=stages,
        )
    return (out if acc_out or out.dtype == q.dtype else out.to(q.dtype)), lse


def _use_gluon_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor) -> bool:
    """Whether the backward runs the warp-specialised Gluon kernel (``gluon_bwd``: dK, dV and dQ
    in one pass; sm90, a head dim it has a config for, non-empty inputs): by default for
    ``gluon_bwd.DEFAULT_HEAD_DIMS``. Its dQ is a sum of fp32 reduce-adds in no fixed order, so
    ``torch.use_deterministic_algorithms(True)`` and an explicit ``MAGI_TRITON_DQ`` select the
    Triton backward; ``MAGI_GLUON_BWD=0`` turns it off, ``=1`` on for every supported head dim."""
    env = env_choice("MAGI_GLUON_BWD", "auto", AUTO_SWITCH)
    if env == "0" or torch.are_deterministic_algorithms_enabled() or _dq_override() != "auto":
        return False
    if k.shape[0] == 0 or q.shape[0] == 0 or do.data_ptr() % 16 or not gluon_bwd.supported(q, k, v):
        return False
    return env == "1" or q.shape[-1] in gluon_bwd.DEFAULT_HEAD_DIMS


def ffa_backward(do, q, k, v, out, lse, dlse, q_ranges, k_ranges, attn_type_map, softmax_scale, softcap):
    d = q.shape[-1]
    if d not in SUPPORTED_HEAD_DIMS:  # as in ffa_forward: padded columns of do/out are 0, so delta is unchanged
        grads = ffa_backward(*_pad_head_dim(do, q, k, v, out), lse, dlse, q_ranges, k_ranges, attn_type_map,
                             softmax_scale, softcap)
        return tuple(g[..., :d].contiguous() for g in grads)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    do, out = do.contiguous().to(q.dtype), out.contiguous()
    tq, hq, d = q.shape
    tk, hk = k.shape[:2]
    dev = q.device
    delta = torch.empty(hq, tq, dtype=torch.float32, device=dev)
    lse2 = torch.empty(hq, tq, dtype=torch.float32, device=dev)
    rows = tq * hq
    if rows:
        _bwd_preprocess_kernel[(triton.cdiv(rows, 64),)](
            out, do, lse.float().contiguous(), dlse.float().contiguous(), delta, lse2, rows, hq, tq,
            D=d, BR=64, num_warps=4)
    slices = _host_tuple(q_ranges, k_ranges, attn_type_map)
    qk_scale, cap_in, cap_out = _scale_args(softmax_scale, softcap)
    if _use_gluon_bwd(q, k, v, do):  # one pass: dK/dV programs that also reduce-add dQ
        kv_meta, kv_layers, kv_cov = _tiles(slices, 2, gluon_bwd.key_tile_size(d), str(dev), tk)
        dk = _alloc((tk, hk, d), torch.float32, dev, kv_cov, 0.0)
        dv = _alloc((tk, hk, d), torch.float32, dev, kv_cov, 0.0)
        dq = torch.zeros(tq, hq, d, dtype=torch.float32, device=dev)
        stairs = staircase_share(slices)
        for li, (tiles, members, n, work) in enumerate(kv_layers):
            gluon_bwd.launch(q, k, v, do, dq, dk, dv, lse2, delta, kv_meta, tiles, members, work, softmax_scale,
                             qk_scale, cap_in, cap_out, softcap, li > 0, stairs)
        return dq, dk, dv
    BM1, BN1, warps1, stages1 = _bwd_config(d)
    BM2, BN2, warps2, stages2 = _dq_config(d)
    dq_mode = _dq_mode(q)
    kv_meta, kv_layers, kv_cov = _tiles(slices, 2, BN1, str(dev), tk)
    q_meta, q_layers, q_cov = _tiles(slices, 0, BM2, str(dev), tq) if dq_mode == "split" else (kv_meta, [], False)
    dk = _alloc((tk, hk, d), torch.float32, dev, kv_cov, 0.0)
    dv = _alloc((tk, hk, d), torch.float32, dev, kv_cov, 0.0)
    dq = _alloc((tq, hq, d), torch.float32, dev, q_cov and dq_mode == "split", 0.0)  # atomics add into zeros
    dqd = _descriptor(dq, BM1, dq_mode == "tma")
    none = torch.empty(0, dtype=torch.int32, device=dev)

    def launch(kv_layer, q_layer, accum, warps, stages):
        n_kv = kv_layer[2] * hk if kv_layer else 0
        n_q = q_layer[2] * hq if q_layer else 0
        if n_kv + n_q == 0:
            return
        _bwd_kernel[(n_kv + n_q,)](
            q, k, v, do, lse2, delta, dq, dqd, dk, dv,
            kv_meta, *(kv_layer[:2] if kv_layer else (none, none)),
            q_meta, *(q_layer[:2] if q_layer else (none, none)),
            n_kv, tq, hq, softmax_scale, qk_scale, cap_in, cap_out,
            GROUP=hq // hk, BM1=BM1, BN1=BN1, BM2=BM2, BN2=BN2, D=d, HAS_SOFTCAP=softcap > 0, ACCUM=accum,
            DO_KV=kv_layer is not None, DO_Q=q_layer is not None, DQ_MODE=DQ_MODES[dq_mode],
            num_warps=warps, num_stages=stages,
        )

    if dq_mode != "split":  # the dK/dV programs add dQ: no dQ programs
        for li, layer in enumerate(kv_layers):
            launch(layer, None, li > 0, warps1, stages1)
        return dq, dk, dv

    # dK/dV and dQ programs in one launch where one layer on each axis allows it (no tail between
    # them, both kinds resident together: 358 vs 330 TFLOP/s at 16k full over two launches)
    fused = len(kv_layers) == 1 and len(q_layers) == 1 and (warps1, stages1) == (warps2, stages2)
    if fused:
        launch(kv_layers[0], q_layers[0], False, warps1, stages1)
    else:  # layers after the first read-modify-write the previous ones: one launch per layer
        for li, layer in enumerate(kv_layers):
            launch(layer, None, li > 0, warps1, stages1)
        for li, layer in enumerate(q_layers):
            launch(None, layer, li > 0, warps2, stages2)
    return dq, dk, dv
