"""Fused GPU backend (Triton): flash attention over (q_range, k_range, mask_type) slices.

Forward: one program per (query block of a slice, query head); keys are pruned to the block's
unmasked extent, element masks are applied only on partial blocks, online softmax in fp32.
Slices whose q ranges overlap are placed in separate *layers* (interval colouring on the host);
each layer is one launch that LSE-merges into the fp32 output of the previous layers, so no two
programs ever write the same row. Backward: one program per (key block of a slice, KV head)
loops over the GQA group and the visible query blocks, accumulates dK/dV in registers
(layered by k-range overlap) and adds dQ with fp32 atomics.

Importable without triton; ``AVAILABLE`` says whether it can run.
"""

from __future__ import annotations

import functools
import os
import weakref

import torch

SUPPORTED_HEAD_DIMS = (64, 128)

try:
    import triton
    import triton.language as tl

    AVAILABLE = True
except ImportError:  # CPU-only installs
    AVAILABLE = False


def supports_head_dim(d: int) -> bool:
    return d in SUPPORTED_HEAD_DIMS


def _layers(slices: tuple[tuple[int, ...], ...], axis: int) -> list[list[int]]:
    """Colour slices so that within a layer the ranges on ``axis`` (0 = q, 2 = k) are disjoint."""
    order = sorted(range(len(slices)), key=lambda i: (slices[i][axis], slices[i][axis + 1]))
    ends: list[int] = []
    layers: list[list[int]] = []
    for i in order:
        s, e = slices[i][axis], slices[i][axis + 1]
        if e <= s or slices[i][2] >= slices[i][3] or slices[i][0] >= slices[i][1]:
            continue
        for li, end in enumerate(ends):
            if end <= s:
                layers[li].append(i)
                ends[li] = e
                break
        else:
            layers.append([i])
            ends.append(e)
    return layers


try:
    from . import _native  # C++ tile tables (same result as _layers below)
except ImportError:
    _native = None


def _i32(b: bytes, device: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(b), dtype=torch.int32).to(device) if b else torch.empty(0, dtype=torch.int32, device=device)


@functools.lru_cache(maxsize=256)
def _tiles(slices: tuple[tuple[int, ...], ...], axis: int, block: int, device: str):
    """Per layer: (tile -> slice index, tile start) int32 tensors and the slice table."""
    meta = torch.tensor(slices, dtype=torch.int32).reshape(-1, 5).to(device)
    if _native is not None:
        return meta, [(_i32(a, device), _i32(b, device), n) for a, b, n in _native.tiles(list(slices), axis, block)]
    out = []
    for layer in _layers(slices, axis):
        sid, start = [], []
        for i in layer:
            s, e = slices[i][axis], slices[i][axis + 1]
            for b in range(s, e, block):
                sid.append(i)
                start.append(b)
        out.append((torch.tensor(sid, dtype=torch.int32, device=device),
                    torch.tensor(start, dtype=torch.int32, device=device), len(sid)))
    return meta, out


if AVAILABLE:

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
    def _tile_of(TILE_S, TILE_START, GROUP: tl.constexpr):
        """(query head, kv head, slice index, first row) of this program's tile."""
        tile = tl.program_id(0)
        h = tl.program_id(1)
        return h, h // GROUP, tl.load(TILE_S + tile), tl.load(TILE_START + tile)

    @triton.jit
    def _row_bounds(rows, qs, qe, ks, ke, inv, cau):
        """Per-row visible keys [lo, hi): INVCAUSAL top-left, CAUSAL bottom-right."""
        lo = tl.where(inv, ks + rows - qs, ks)
        hi = tl.minimum(tl.where(cau, rows + ke - qe + 1, ke), ke)
        return lo, hi

    @triton.jit
    def _fwd_kernel(
        Q, K, V, O, LSE, META, TILE_S, TILE_M,
        sqt, sqh, skt, skh, sot, soh, slt, slh,
        scale, softcap,
        GROUP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr, ACCUM: tl.constexpr,
    ):
        h, hk, sid, m0 = _tile_of(TILE_S, TILE_M, GROUP)
        qs, qe, ks, ke, inv, cau = _load_slice(META, sid)
        rows = m0 + tl.arange(0, BM)
        rmask = rows < qe
        lo, hi = _row_bounds(rows, qs, qe, ks, ke, inv, cau)
        last = tl.minimum(m0 + BM, qe) - 1
        k_lo = tl.where(inv, ks + m0 - qs, ks)
        k_hi = tl.minimum(tl.where(cau, last + ke - qe + 1, ke), ke)
        k_lo = tl.maximum(k_lo, ks)
        full_lo = tl.where(inv, ks + last - qs, ks)  # blocks in [full_lo, full_hi) need no mask
        full_hi = tl.where(cau, m0 + ke - qe + 1, ke)
        d = tl.arange(0, D)
        q = tl.load(Q + rows[:, None] * sqt + h * sqh + d[None, :], mask=rmask[:, None], other=0.0)
        m_i = tl.full([BM], float("-inf"), tl.float32)
        l_i = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, D], tl.float32)
        for kb in range(k_lo, k_hi, BN):
            cols = kb + tl.arange(0, BN)
            cmask = cols < k_hi
            k = tl.load(K + cols[:, None] * skt + hk * skh + d[None, :], mask=cmask[:, None], other=0.0)
            v = tl.load(V + cols[:, None] * skt + hk * skh + d[None, :], mask=cmask[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * scale
            if HAS_SOFTCAP:
                s = softcap * _tanh(s / softcap)
            s = s * 1.4426950408889634  # log2(e): exp2 below
            if (kb < full_lo) | (kb + BN > full_hi) | (kb + BN > k_hi):
                vis = (cols[None, :] >= lo[:, None]) & (cols[None, :] < hi[:, None])
                s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_use[:, None])
            alpha = tl.exp2(m_i - m_use)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        ok = l_i > 0
        l_safe = tl.where(ok, l_i, 1.0)
        lse = tl.where(ok, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        o = acc / l_safe[:, None]
        optr = O + rows[:, None] * sot + h * soh + d[None, :]
        lptr = LSE + rows * slt + h * slh
        if ACCUM:
            old_l = tl.load(lptr, mask=rmask, other=float("-inf"))
            old_o = tl.load(optr, mask=rmask[:, None], other=0.0)
            new_l = tl.maximum(old_l, lse)
            base = tl.where(new_l == float("-inf"), 0.0, new_l)
            wa = tl.exp(old_l - base)
            wb = tl.exp(lse - base)
            den = wa + wb
            den_safe = tl.where(den > 0, den, 1.0)
            o = (old_o * wa[:, None] + o * wb[:, None]) / den_safe[:, None]
            lse = tl.where(den > 0, base + tl.log(den_safe), float("-inf"))
        tl.store(optr, o, mask=rmask[:, None])
        tl.store(lptr, lse, mask=rmask)

    @triton.jit
    def _bwd_kernel(
        Q, K, V, DO, LSE, DELTA, DQ, DK, DV, META, TILE_S, TILE_N,
        sqt, sqh, skt, skh, slt, slh, sdt, sdh,
        scale, softcap,
        GROUP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr, ACCUM: tl.constexpr,
    ):
        h, hk, sid, n0 = _tile_of(TILE_S, TILE_N, GROUP)
        qs, qe, ks, ke, inv, cau = _load_slice(META, sid)
        cols = n0 + tl.arange(0, BN)
        cmask = cols < ke
        n_last = tl.minimum(n0 + BN, ke) - 1
        # rows that see any key of this block
        q_lo = tl.maximum(tl.where(cau, n0 - ke + qe, qs), qs)
        q_hi = tl.minimum(tl.where(inv, n_last - ks + qs + 1, qe), qe)
        d = tl.arange(0, D)
        k = tl.load(K + cols[:, None] * skt + hk * skh + d[None, :], mask=cmask[:, None], other=0.0)
        v = tl.load(V + cols[:, None] * skt + hk * skh + d[None, :], mask=cmask[:, None], other=0.0)
        dk = tl.zeros([BN, D], tl.float32)
        dv = tl.zeros([BN, D], tl.float32)
        for mb in range(q_lo, q_hi, BM):
            rows = mb + tl.arange(0, BM)
            rmask = rows < q_hi
            q = tl.load(Q + rows[:, None] * sqt + h * sqh + d[None, :], mask=rmask[:, None], other=0.0)
            do = tl.load(DO + rows[:, None] * sqt + h * sqh + d[None, :], mask=rmask[:, None], other=0.0)
            lse = tl.load(LSE + rows * slt + h * slh, mask=rmask, other=float("-inf"))
            delta = tl.load(DELTA + rows * slt + h * slh, mask=rmask, other=0.0)
            s = tl.dot(q, tl.trans(k)) * scale
            if HAS_SOFTCAP:
                th = _tanh(s / softcap)
                s = softcap * th
            lo, hi = _row_bounds(rows, qs, qe, ks, ke, inv, cau)
            vis = (cols[None, :] >= lo[:, None]) & (cols[None, :] < hi[:, None]) & rmask[:, None]
            vis = vis & (lse[:, None] != float("-inf"))
            lse_safe = tl.where(lse == float("-inf"), 0.0, lse)
            p = tl.where(vis, tl.exp(s - lse_safe[:, None]), 0.0)
            dv += tl.dot(tl.trans(p.to(do.dtype)), do)
            dp = tl.dot(do, tl.trans(v))
            ds = p * (dp - delta[:, None])
            if HAS_SOFTCAP:
                ds = ds * (1.0 - th * th)
            ds = ds * scale
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q)
            dq = tl.dot(ds.to(k.dtype), k)
            tl.atomic_add(DQ + rows[:, None] * sqt + h * sqh + d[None, :], dq, mask=rmask[:, None])
        kptr = cols[:, None] * sdt + h * sdh + d[None, :]
        if ACCUM:
            dk += tl.load(DK + kptr, mask=cmask[:, None], other=0.0)
            dv += tl.load(DV + kptr, mask=cmask[:, None], other=0.0)
        tl.store(DK + kptr, dk, mask=cmask[:, None])
        tl.store(DV + kptr, dv, mask=cmask[:, None])


def _env_config(name: str, default: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
    """Tile config override ``BM,BN,warps,stages`` from the environment (for tuning runs)."""
    raw = os.environ.get(name)
    if not raw:
        return default
    vals = tuple(int(x) for x in raw.split(","))
    if len(vals) != 4:
        raise ValueError(f"{name} must be 'BM,BN,num_warps,num_stages', got {raw!r}")
    return vals  # type: ignore[return-value]


def _fwd_config(d: int) -> tuple[int, int, int, int]:
    """(BM, BN, num_warps, num_stages) per head dim, measured on H200 (see docs/notes)."""
    return _env_config("MAGI_TRITON_FWD_CFG", (128, 64, 8, 3) if d == 128 else (128, 64, 4, 3))


def _bwd_config(d: int) -> tuple[int, int, int, int]:
    return _env_config("MAGI_TRITON_BWD_CFG", (64, 64, 8, 2) if d == 128 else (64, 64, 4, 2))


_TUPLES: dict[int, tuple] = {}  # id(q_ranges) -> (weakref, stamp, slice tuple); entries die with the tensor


def _host_tuple(q_ranges: torch.Tensor, k_ranges: torch.Tensor, types: torch.Tensor) -> tuple[tuple[int, ...], ...]:
    """Slice table as a hashable tuple, memoised per range tensor (and its in-place version
    counters), so repeated calls with the same metadata cost a dictionary lookup."""
    key = id(q_ranges)
    stamp = (id(k_ranges), id(types), q_ranges._version, k_ranges._version, types._version)
    hit = _TUPLES.get(key)
    if hit is not None and hit[0]() is q_ranges and hit[1] == stamp:
        return hit[2]
    t = torch.cat([q_ranges.reshape(-1, 2), k_ranges.reshape(-1, 2), types.reshape(-1, 1)], dim=1).tolist()
    value = tuple(tuple(r) for r in t)
    _TUPLES[key] = (weakref.ref(q_ranges, lambda _, k=key: _TUPLES.pop(k, None)), stamp, value)
    return value


def _check(q: torch.Tensor, k: torch.Tensor) -> None:
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("triton backend needs the head_dim axis of q, k, v to be contiguous")


def ffa_forward(q, k, v, q_ranges, k_ranges, attn_type_map, softmax_scale, softcap, acc_out=False):
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    _check(q, k)
    tq, hq, d = q.shape
    hk = k.shape[1]
    slices = _host_tuple(q_ranges, k_ranges, attn_type_map)
    BM, BN, warps, stages = _fwd_config(d)
    meta, layers = _tiles(slices, 0, BM, str(q.device))
    out = torch.zeros(tq, hq, d, dtype=torch.float32, device=q.device)
    lse = torch.full((tq, hq), float("-inf"), dtype=torch.float32, device=q.device)
    for li, (sid, start, n) in enumerate(layers):
        _fwd_kernel[(n, hq)](
            q, k, v, out, lse, meta, sid, start,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
            softmax_scale, softcap if softcap > 0 else 1.0,
            GROUP=hq // hk, BM=BM, BN=BN, D=d, HAS_SOFTCAP=softcap > 0, ACCUM=li > 0,
            num_warps=warps, num_stages=stages,
        )
    return (out if acc_out else out.to(q.dtype)), lse


def ffa_backward(do, q, k, v, out, lse, dlse, q_ranges, k_ranges, attn_type_map, softmax_scale, softcap):
    q, k, v, do = q.contiguous(), k.contiguous(), v.contiguous(), do.contiguous().to(q.dtype)
    _check(q, k)
    tq, hq, d = q.shape
    hk = k.shape[1]
    delta = ((do.float() * out.float()).sum(-1) - dlse.float()).contiguous()
    lse = lse.float().contiguous()
    slices = _host_tuple(q_ranges, k_ranges, attn_type_map)
    BM, BN, warps, stages = _bwd_config(d)
    meta, layers = _tiles(slices, 2, BN, str(q.device))
    dq = torch.zeros(tq, hq, d, dtype=torch.float32, device=q.device)
    # dK/dV per *query* head (more parallel programs, no cross-head race), summed per group below
    dk = torch.zeros(k.shape[0], hq, d, dtype=torch.float32, device=q.device)
    dv = torch.zeros(k.shape[0], hq, d, dtype=torch.float32, device=q.device)
    for li, (sid, start, n) in enumerate(layers):
        _bwd_kernel[(n, hq)](
            q, k, v, do, lse, delta, dq, dk, dv, meta, sid, start,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), lse.stride(0), lse.stride(1), dk.stride(0), dk.stride(1),
            softmax_scale, softcap if softcap > 0 else 1.0,
            GROUP=hq // hk, BM=BM, BN=BN, D=d, HAS_SOFTCAP=softcap > 0, ACCUM=li > 0,
            num_warps=warps, num_stages=stages,
        )
    g = hq // hk
    return dq, dk.view(-1, hk, g, d).sum(2), dv.view(-1, hk, g, d).sum(2)
