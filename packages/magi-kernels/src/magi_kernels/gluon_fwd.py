"""Warp-specialised Hopper forward (Gluon): the FA3 schedule over the Triton backend's tiles.

Persistent: one program per SM runs a queue of (query tile, query head) items, on the same
tile tables as ``triton_backend`` (so overlapping slices, members and layers work unchanged).
The items are taken KV-major: the tiles of one KV head's query heads, then the next KV head, so
the resident programs share one KV head's K/V in L2 (+3-5 % at 16k, +4-7 % at 32k over
each tile for every head on the H200; on an H100 tile-major lost 2-6 % on full and causal). Each
SM's queue holds the items the list schedule of that order gives it
(``program_order.list_queues``); the ring position and the ping-pong rounds run on from one
item to the next, and a ``q_empty`` barrier hands the query buffer back to the loader, which
loads the next item's query rows and first key blocks while the consumers finish the current
one (x1.00-1.08 over one program per item on an H100, most on packed documents).
The program forks into:

* a loader warp (24 registers) that TMA-loads each item's query tile, then every key block of
  the tile's members into a ring of ``STAGES`` (3) K/V shared-memory buffers; each buffer has a
  "K ready", a "V ready" and an "empty" mbarrier;
* two consumer warpgroups of BM/2 rows, each its own partition (240 registers), that run the
  online softmax. Within a member the S = Q K^T of block j+1 is issued before the P V of block
  j, so the softmax of one block overlaps the tensor cores' work on the other (FA3's intra-
  warpgroup overlap; the softmax sits whole in each branch of the partial-block test, or ptxas
  hoists the wait for P V above it: +0.5-2 % over the mask alone in the branch); with
  ping-pong the two warpgroups also issue their
  matmuls in alternate rounds, so one's softmax runs while the other's matmuls hold the
  tensor cores.

Blocks are walked from each member's first visible key in steps of BN (as in the Triton
kernel); a block is masked element-wise only when it is not entirely visible to every row.
Key rows of a partial block past the member's keys are loaded (TMA reads whatever lies there,
zeros past the tensor's end) and get probability 0, so K/V must be finite everywhere.

Importable without a GPU; ``AVAILABLE`` says whether Gluon is present.
"""

from __future__ import annotations

import functools

import torch

from . import program_order
from .env_config import env_config
from .host_cache import upload
from .gluon_common import AVAILABLE, MAX_REGS, hopper_supported, sm_count

if AVAILABLE:
    from .epilogue_jit import lse_merge_weights, softmax_lse
    from .gluon_common import (
        CONSUMER_REGS,
        LOADER_REGS,
        descriptor,
        gl,
        gluon,
        load_slice,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

# (BM, BN, STAGES, PARTS, PING) per head dim; BM is the query tile (two warpgroups of BM/2 rows,
# in PARTS consumer partitions; PING: ping-pong of their matmuls when PARTS is 2)
# d=64 compiles and timed faster than Triton's forward at 16k (full 454 vs 380 TFLOP/s) but its
# correctness run did not finish on the device: not offered until it does
CONFIGS = {128: (128, 128, 3, 2, 1)}  # the tile sweep's best: docs/design.md
DEFAULT_HEAD_DIMS = (128,)  # where it is the default forward (measured faster than Triton's)
__all__ = ["AVAILABLE", "CONFIGS", "DEFAULT_HEAD_DIMS", "MAX_REGS", "launch", "supported", "tile_rows"]


def _config(d: int) -> tuple[int, int, int, int, int]:
    """``MAGI_GLUON_FWD_CFG=BM,BN,STAGES,PARTS,PING`` overrides the tuned config (tuning runs)."""
    return env_config("MAGI_GLUON_FWD_CFG", CONFIGS[d], "BM,BN,STAGES,PARTS,PING",
                      lambda v: v[3] in (1, 2) and v[4] in (0, 1), " with PARTS 1 or 2 and PING 0 or 1")  # type: ignore[return-value]


# an item's fixed cost in key blocks (its output and the ring's refill), for the queues
PERSIST_ITEM_OVERHEAD_BLOCKS = 0.5


def item_tiles(n_tiles: int, hq: int, group: int) -> list[int]:
    """The tile of each item of the KV-major order, item id = position (``_program_tile``)."""
    per_kv = n_tiles * group
    return [(p % per_kv) // group for p in range(n_tiles * hq)]


@functools.lru_cache(maxsize=256)
def _queue_table(work: tuple[int, ...], hq: int, group: int, block_keys: int, n_sms: int,
                 device: torch.device) -> tuple[torch.Tensor, int]:
    """(queue table, programs) of a launch: the list schedule of the KV-major order's items on
    ``n_sms`` SMs (``program_order.list_queues``, item cost: its tile's key blocks), as int32
    [programs + 1 offsets, then the items of program 0, 1, ...]."""
    blocks = [-(-w // block_keys) + PERSIST_ITEM_OVERHEAD_BLOCKS for w in work]
    queues = program_order.list_queues([blocks[t] for t in item_tiles(len(work), hq, group)], n_sms)
    offsets = [0]
    for qu in queues:
        offsets.append(offsets[-1] + len(qu))
    table = offsets + [item for qu in queues for item in qu]
    return upload(torch.tensor(table, dtype=torch.int32), device), len(queues)


def tile_rows(d: int) -> int:
    """Query rows per tile (the block of the tile tables the launch reads)."""
    return _config(d)[0]


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether this kernel can run the forward of these inputs (sm90, a tuned head dim,
    16-byte aligned rows)."""
    return hopper_supported(q, k, v, CONFIGS)


if AVAILABLE:
    @gluon.jit
    def _member_keys(META, MEMBERS, i, m0, t_end, BM: gl.constexpr, BN: gl.constexpr):
        """Slice of member ``i`` and the tile's key extent [k_lo, k_hi) and full-block run edges
        (b1, b2): blocks starting in [b1, b2) are visible to every row of the tile."""
        qs, qe, ks, ke, inv, cau = load_slice(META, MEMBERS, i)
        last = gl.minimum(m0 + BM, qe) - 1
        k_lo = gl.where(inv, ks + m0 - qs, ks)
        k_hi = gl.minimum(gl.where(cau, last + ke - qe + 1, ke), ke)
        full_lo = gl.where(inv, ks + last - qs, ks)
        full_hi = gl.minimum(gl.where(cau, m0 + ke - qe + 1, ke), ke)
        full_hi = gl.where(qe < t_end, full_lo, full_hi)  # rows of other members: no block is full
        n = gl.cdiv(gl.maximum(k_hi - k_lo, 0), BN)
        j0 = gl.minimum(gl.cdiv(gl.maximum(full_lo - k_lo, 0), BN), n)
        j1 = gl.minimum(gl.maximum(gl.minimum(full_hi, k_hi) - k_lo, 0) // BN, n)
        return qs, qe, ks, ke, inv, cau, k_lo, n, j0, gl.maximum(j0, j1)

    @gluon.jit
    def _program_tile(TILES, pid, N_TILES, GROUP: gl.constexpr):
        """(query head, first row, end row, first member, member count) of item ``pid`` of the
        KV-major order: the tiles x group heads of one KV head, then the next KV head."""
        per_kv = N_TILES * GROUP
        r = pid % per_kv
        h = (pid // per_kv) * GROUP + r % GROUP
        t_idx = r // GROUP
        tile = TILES + t_idx * 4
        return h, gl.load(tile), gl.load(tile + 1), gl.load(tile + 2), gl.load(tile + 3)

    @gluon.jit
    def _queue(QUEUE):
        """This program's items [lo, hi) of the launch's queue table (``_queue_table``)."""
        pid = gl.program_id(0)
        return gl.load(QUEUE + pid), gl.load(QUEUE + pid + 1), gl.num_programs(0) + 1

    @gluon.jit
    def _load_tile(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, bars, META, MEMBERS, m0, t_end, first, count,
                   h, hk, j, it, BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr):
        """TMA loads of one tile: its query rows (once both consumers are done with the previous
        tile's, ``q_empty``), then every key block of its members into the ring from position
        ``j``. Returns the next ring position."""
        q_bar, k_bars, v_bars, empty_bars, _turn_bars, q_empty = bars
        mbarrier.wait(q_empty, (it & 1) ^ 1)  # the first tile's passes: a fresh barrier
        mbarrier.expect(q_bar, q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [m0, h * D], q_bar, q_smem)
        for i in range(first, first + count):
            _qs, _qe, _ks, _ke, _inv, _cau, k_lo, n, _b1, _b2 = _member_keys(META, MEMBERS, i, m0, t_end, BM, BN)
            for t in range(n):
                s = j % STAGES
                mbarrier.wait(empty_bars.index(s), ((j // STAGES) & 1) ^ 1)
                kb = k_lo + t * BN
                mbarrier.expect(k_bars.index(s), k_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(k_desc, [kb, hk * D], k_bars.index(s), k_smem.index(s))
                mbarrier.expect(v_bars.index(s), v_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(v_desc, [kb, hk * D], v_bars.index(s), v_smem.index(s))
                j += 1
        return j

    @gluon.jit
    def _loader(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, bars, META, MEMBERS, TILES, QUEUE, N_TILES,
                GROUP: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr):
        """The loader warp: each tile of the program's queue, the ring position running on from
        one tile to the next."""
        lo, hi, items = _queue(QUEUE)
        j = 0
        for it in range(lo, hi):
            h, m0, t_end, first, count = _program_tile(TILES, gl.load(QUEUE + items + it), N_TILES, GROUP)
            j = _load_tile(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, bars, META, MEMBERS, m0, t_end, first,
                           count, h, h // GROUP, j, it - lo, BM, BN, D, STAGES)

    @gluon.jit
    def _qk(q_smem, k_smem, k_bars, j, s_layout: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
            STAGES: gl.constexpr):
        """Issue S = Q K^T of ring position ``j`` (asynchronous)."""
        s = j % STAGES
        mbarrier.wait(k_bars.index(s), (j // STAGES) & 1)
        zero = gl.zeros([BM, BN], gl.float32, s_layout)
        return warpgroup_mma(q_smem, k_smem.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)

    @gluon.jit
    def _pv(p, v_smem, v_bars, acc, j, STAGES: gl.constexpr):
        """Issue acc += P V of ring position ``j`` (asynchronous)."""
        s = j % STAGES
        mbarrier.wait(v_bars.index(s), (j // STAGES) & 1)
        return warpgroup_mma(p, v_smem.index(s), acc, is_async=True)

    @gluon.jit
    def _take_turn(turn_bars, c, PART: gl.constexpr, PINGPONG: gl.constexpr):
        """Ping-pong (FA3): the two consumer warpgroups issue their matmuls in alternate rounds,
        so one's softmax runs while the other's matmuls hold the tensor cores. Round ``c`` of
        consumer 0 waits for round c-1 of consumer 1 (its first round passes: a fresh barrier's
        phase 1 counts as complete), round c of consumer 1 for round c of consumer 0."""
        if PINGPONG:
            mbarrier.wait(turn_bars.index(PART), (c & 1) ^ (1 - PART))

    @gluon.jit
    def _pass_turn(turn_bars, PART: gl.constexpr, PINGPONG: gl.constexpr):
        if PINGPONG:
            mbarrier.arrive(turn_bars.index(1 - PART))

    @gluon.jit
    def _softmax(sc, kb, m_i, l_i, lo, hi, partial, qk_scale, cap_in, cap_out, s_layout: gl.constexpr,
                 BN: gl.constexpr, HAS_SOFTCAP: gl.constexpr, MASK: gl.constexpr):
        """Online-softmax step of a block (keys from ``kb``): probabilities, new max and sum,
        and the rescale factor of the accumulator. The element mask: MASK 0 never, 1 always,
        2 where ``partial`` (a runtime branch around the mask alone)."""
        if HAS_SOFTCAP:
            x = cap_out * (1.0 - 2.0 / (gl.exp(2.0 * cap_in * sc) + 1.0))
            scale = 1.0
        else:  # scale inside the exponent: one FFMA per score (max of the raw scores, scale > 0)
            x = sc
            scale = qk_scale
        if MASK == 1 or (MASK == 2 and partial):
            cols = kb + gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
            vis = (cols[None, :] >= lo[:, None]) & (cols[None, :] < hi[:, None])
            x = gl.where(vis, x, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(x, 1) * scale)
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # rows without a visible key yet
        p = gl.exp2(x * scale - m_use[:, None])
        alpha = gl.exp2(m_i - m_use)
        return p, m_new, l_i * alpha + gl.sum(p, 1), alpha

    @gluon.jit
    def _block_softmax(sc, t, kb, m_i, l_i, lo, hi, b1, b2, qk_scale, cap_in, cap_out,
                       s_layout: gl.constexpr, BN: gl.constexpr, HAS_SOFTCAP: gl.constexpr):
        """``_softmax`` of block ``t``, element-masked when the block is partial (outside the
        full run [b1, b2)). Each branch holds a whole softmax, so the wait for the previous
        P V that follows sits after the branches' join, where ptxas cannot hoist it above the
        softmax. With the mask alone in the branch ptxas placed that wait right after
        the branch, before the row max: P V no longer overlapped the softmax."""
        partial = (t < b1) | (t >= b2)
        if partial:
            p, m_new, l_new, alpha = _softmax(sc, kb, m_i, l_i, lo, hi, partial, qk_scale, cap_in, cap_out,
                                              s_layout, BN, HAS_SOFTCAP, 1)
        else:
            p, m_new, l_new, alpha = _softmax(sc, kb, m_i, l_i, lo, hi, partial, qk_scale, cap_in, cap_out,
                                              s_layout, BN, HAS_SOFTCAP, 0)
        return p, m_new, l_new, alpha

    @gluon.jit
    def _consume_tile(q_smem, k_smem, v_smem, bars, O, LSE, META, MEMBERS, m0, t_end, first, count, h, HQ,
                      qk_scale, cap_in, cap_out, j, c, it, BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr,
                      STAGES: gl.constexpr, HAS_SOFTCAP: gl.constexpr, ACCUM: gl.constexpr,
                      PART: gl.constexpr, PARTS: gl.constexpr, PING: gl.constexpr):
        """Online softmax of rows [m0 + PART*R, m0 + (PART+1)*R) of one tile, R = BM / PARTS,
        in 4*(2/PARTS) warps, from ring position ``j`` and ping-pong round ``c`` (the program's
        ``it``-th tile); returns the next (j, c). The tile's member bounds (and so the block
        walk) are shared with the loader and the other consumer."""
        q_bar, k_bars, v_bars, empty_bars, turn_bars, q_empty = bars
        PINGPONG: gl.constexpr = PARTS == 2 and PING
        R: gl.constexpr = BM // PARTS
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8 // PARTS, 1],
                                                           instr_shape=[16, BN, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8 // PARTS, 1],
                                                           instr_shape=[16, D, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        orow_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
        dtype: gl.constexpr = q_smem.dtype

        r0 = m0 + PART * R
        rows = r0 + gl.arange(0, R, layout=row_layout)
        m_i = gl.full([R], float("-inf"), gl.float32, row_layout)
        l_i = gl.zeros([R], gl.float32, row_layout)
        acc = gl.zeros([R, D], gl.float32, o_layout)
        q_rows = q_smem.slice(PART * R, R, dim=0)
        mbarrier.wait(q_bar, it & 1)
        last_n = gl.to_tensor(0)  # key blocks of the last member seen
        for i in range(first, first + count):
            qs, qe, ks, ke, inv, cau, k_lo, n, b1, b2 = _member_keys(META, MEMBERS, i, m0, t_end, BM, BN)
            last_n = n
            lo = gl.where(inv, ks + rows - qs, ks)
            hi = gl.minimum(gl.where(cau, rows + ke - qe + 1, ke), ke)
            hi = gl.where(rows < qe, hi, lo)  # tile rows past this slice see none of it
            if n > 0:
                _take_turn(turn_bars, c, PART, PINGPONG)
                sc = _qk(q_rows, k_smem, k_bars, j, s_layout, R, BN, STAGES)
                _pass_turn(turn_bars, PART, PINGPONG)
                c += 1
                sc = warpgroup_mma_wait(0, deps=(sc,))
                p, m_i, l_i, alpha = _block_softmax(sc, 0, k_lo, m_i, l_i, lo, hi, b1, b2, qk_scale, cap_in,
                                                    cap_out, s_layout, BN, HAS_SOFTCAP)
                acc = acc * gl.convert_layout(alpha, orow_layout)[:, None]
                for t in range(1, n):
                    pop = gl.convert_layout(p.to(dtype), p_layout)
                    _take_turn(turn_bars, c, PART, PINGPONG)
                    sc = _qk(q_rows, k_smem, k_bars, j + 1, s_layout, R, BN, STAGES)
                    acc = _pv(pop, v_smem, v_bars, acc, j, STAGES)
                    _pass_turn(turn_bars, PART, PINGPONG)
                    c += 1
                    sc = warpgroup_mma_wait(1, deps=(sc,))  # S done, P V may still run
                    p, m_i, l_i, alpha = _block_softmax(sc, t, k_lo + t * BN, m_i, l_i, lo, hi, b1, b2,
                                                        qk_scale, cap_in, cap_out, s_layout, BN, HAS_SOFTCAP)
                    acc = warpgroup_mma_wait(0, deps=(acc,))
                    mbarrier.arrive(empty_bars.index(j % STAGES))
                    acc = acc * gl.convert_layout(alpha, orow_layout)[:, None]
                    j += 1
                if i == first + count - 1:  # the tile's last S is done: the loader may reload Q
                    mbarrier.arrive(q_empty)  # (one P V earlier than after the member loop)
                pop = gl.convert_layout(p.to(dtype), p_layout)
                _take_turn(turn_bars, c, PART, PINGPONG)
                acc = _pv(pop, v_smem, v_bars, acc, j, STAGES)
                _pass_turn(turn_bars, PART, PINGPONG)
                c += 1
                acc = warpgroup_mma_wait(0, deps=(acc,))
                mbarrier.arrive(empty_bars.index(j % STAGES))
                j += 1
        if last_n == 0:  # no block in the last member (or no member): released here instead
            mbarrier.arrive(q_empty)

        l_safe, lse = softmax_lse(l_i, m_i)
        o = acc / gl.convert_layout(l_safe, orow_layout)[:, None]
        orows = r0 + gl.arange(0, R, layout=orow_layout)
        ocols = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
        optr = O + (orows.to(gl.int64) * HQ + h)[:, None] * D + ocols[None, :]
        omask = (orows < t_end)[:, None]
        lptr = LSE + rows.to(gl.int64) * HQ + h
        rmask = rows < t_end
        if ACCUM:  # merge with the previous layers' output and LSE
            old_l = gl.load(lptr, mask=rmask, other=float("-inf"))
            old_o = gl.load(optr, mask=omask, other=0.0)
            wa, wb, den_safe, lse = lse_merge_weights(old_l, lse)
            o = (old_o * gl.convert_layout(wa, orow_layout)[:, None]
                 + o * gl.convert_layout(wb, orow_layout)[:, None]) / gl.convert_layout(den_safe, orow_layout)[:, None]
        gl.store(optr, o.to(O.dtype.element_ty), mask=omask)
        gl.store(lptr, lse, mask=rmask)
        return j, c

    @gluon.jit
    def _consumer(q_smem, k_smem, v_smem, bars, O, LSE, META, MEMBERS, TILES, QUEUE, HQ, N_TILES, qk_scale, cap_in,
                  cap_out, GROUP: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr,
                  STAGES: gl.constexpr, HAS_SOFTCAP: gl.constexpr, ACCUM: gl.constexpr, PART: gl.constexpr,
                  PARTS: gl.constexpr, PING: gl.constexpr):
        """A consumer partition: each tile of the program's queue."""
        lo, hi, items = _queue(QUEUE)
        j = 0  # ring position of the next block
        c = 0  # matmul-issue rounds (ping-pong)
        for it in range(lo, hi):
            h, m0, t_end, first, count = _program_tile(TILES, gl.load(QUEUE + items + it), N_TILES, GROUP)
            j, c = _consume_tile(q_smem, k_smem, v_smem, bars, O, LSE, META, MEMBERS, m0, t_end, first, count, h,
                                 HQ, qk_scale, cap_in, cap_out, j, c, it - lo, BM, BN, D, STAGES, HAS_SOFTCAP,
                                 ACCUM, PART, PARTS, PING)

    @gluon.jit
    def _fwd_ws_kernel(q_desc, k_desc, v_desc, O, LSE, META, TILES, MEMBERS, QUEUE, HQ, N_TILES, qk_scale, cap_in,
                       cap_out, GROUP: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr,
                       STAGES: gl.constexpr, HAS_SOFTCAP: gl.constexpr, ACCUM: gl.constexpr, PARTS: gl.constexpr,
                       PING: gl.constexpr):
        # (the partitions walk this program's queue of tiles, ``_queue``)
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [BM, D], q_desc.layout)
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BN, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BN, D], v_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for s in gl.static_range(STAGES):
            mbarrier.init(k_bars.index(s), count=1)
            mbarrier.init(v_bars.index(s), count=1)
            mbarrier.init(empty_bars.index(s), count=PARTS)  # one arrival per consumer partition
        turn_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(2):
            mbarrier.init(turn_bars.index(s), count=1)
        # the query tile's buffer is free again: both consumers' matmuls of it are done
        q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(q_empty, count=PARTS)
        bars = (q_bar, k_bars, v_bars, empty_bars, turn_bars, q_empty)

        loader_args = (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, bars, META, MEMBERS, TILES, QUEUE, N_TILES,
                       GROUP, BM, BN, D, STAGES)
        if PARTS == 1:  # both warpgroups in one 8-warp partition
            gl.warp_specialize([
                (_consumer, (q_smem, k_smem, v_smem, bars, O, LSE, META, MEMBERS, TILES, QUEUE, HQ, N_TILES, qk_scale,
                             cap_in, cap_out, GROUP, BM, BN, D, STAGES, HAS_SOFTCAP, ACCUM, 0, 1, PING)),
                (_loader, loader_args)], [1], [LOADER_REGS])
        else:  # one partition per warpgroup: they synchronise only through the mbarriers
            # (the argument tuples written out: a tuple built with + loses its constexprs)
            gl.warp_specialize([
                (_consumer, (q_smem, k_smem, v_smem, bars, O, LSE, META, MEMBERS, TILES, QUEUE, HQ, N_TILES, qk_scale,
                             cap_in, cap_out, GROUP, BM, BN, D, STAGES, HAS_SOFTCAP, ACCUM, 0, 2, PING)),
                (_consumer, (q_smem, k_smem, v_smem, bars, O, LSE, META, MEMBERS, TILES, QUEUE, HQ, N_TILES, qk_scale,
                             cap_in, cap_out, GROUP, BM, BN, D, STAGES, HAS_SOFTCAP, ACCUM, 1, 2, PING)),
                (_loader, loader_args)], [4, 1], [CONSUMER_REGS, LOADER_REGS])

    def launch(q, k, v, out, lse, meta, tiles, members, work, qk_scale, cap_in, cap_out, softcap, accum):
        """One launch over the query tiles x heads (tile tables of block ``CONFIGS[d][0]``; ``work``:
        the host copy of each tile's visible keys, which sets the programs' queues)."""
        d = q.shape[-1]
        hq, hk = q.shape[1], k.shape[1]
        BM, BN, stages, parts, ping = _config(d)
        queue, programs = _queue_table(work, hq, hq // hk, BN, sm_count(q.device), q.device)
        _fwd_ws_kernel[(programs,)](
            descriptor(q, BM), descriptor(k, BN), descriptor(v, BN), out, lse, meta, tiles, members, queue, hq,
            len(work), qk_scale, cap_in, cap_out, GROUP=hq // hk, BM=BM, BN=BN, D=d, STAGES=stages,
            HAS_SOFTCAP=softcap > 0, ACCUM=accum, PARTS=parts, PING=bool(ping), num_warps=8 // parts,
            maxnreg=MAX_REGS,
        )
