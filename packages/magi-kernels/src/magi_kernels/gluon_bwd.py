"""Warp-specialised Hopper backward (Gluon): dK, dV and dQ in one pass, 5 matmuls per block.

One program per (key tile of BN=128 keys, KV head), on the Triton backend's key-tile tables
(members, layers), launched in the order ``program_order`` picks (``MAGI_GLUON_BWD_ORDER``):
mostly the key tiles of one KV head after another, so the resident programs share one query
head's Q/dO/dQ in L2, with the last heads tile-major where that shortens the tail. It
loops over the tile's member slices, the GQA group's query heads and the query blocks (BM=64
rows) that see its keys, starting at the tile's diagonal block and wrapping
(``MAGI_GLUON_BWD_ROTATE``), so that key tiles which see the same rows do not all reduce into
the same dQ rows at once. The last programs of a launch may run as pieces over a subset of
the GQA group's query heads (``program_order.split_tail``, ``MAGI_GLUON_BWD_SPLIT``), so that a
part-empty last wave is spread over every SM; a piece adds its dK/dV with fp32 atomics. Where
the key tiles of causal slices differ in length (causal, packed causal documents), every
program runs as pieces over a chunk of the GQA group instead, each KV head's tiles over one
chunk before the next, so that the resident pieces stay on one chunk's rows in L2; their dK/dV
go out as TMA reduce-adds (``MAGI_GLUON_BWD_PIECES``, ``MAGI_GLUON_BWD_PIECE_ADD``; x1.06-1.38
on causal). The program forks into:

* a loader warp (24 registers): TMA of the K/V tile once, then each step's Q and dO blocks into
  a ring of ``STAGES`` buffers ("ready" mbarriers with a byte count, an "empty" one per slot),
  and the block's LSE and delta rows into shared memory;
* two consumer warpgroups (240 registers), each owning 64 of the tile's keys. The scores are
  key-major: S^T = K Q^T and dP^T = V dO^T (issued together), so P^T and dS^T are already the
  register A operands of dV += P^T dO and dK += dS^T Q (FA3's layout for d=128; +4-10 % over
  the query-major S = Q K^T). The two warpgroups' dS halves make the
  block's dS (double-buffered, one mbarrier per buffer, ``_consumer``); each warpgroup then
  computes half of dQ = dS K (64 of the head dim's columns) and adds it to an fp32 dQ in global
  memory with a TMA bulk reduce-add, which runs while the next block is computed.

Query rows of a partial block past the slice are loaded (TMA reads whatever lies there, zeros
past the tensor's end) and get probability 0 and dS 0, so Q/dO must be finite everywhere (as
the forward needs for keys). The dQ adds (and the dK/dV of split pieces) are fp32 adds in no
fixed order: not bitwise deterministic (``torch.use_deterministic_algorithms`` selects the
split Triton backward).

Importable without a GPU; ``AVAILABLE`` says whether Gluon is present.
"""

from __future__ import annotations

import functools
import os

import torch

from . import program_order
from .env_config import env_choice, env_config
from .host_cache import upload
from .gluon_common import AVAILABLE, MAX_REGS, hopper_supported, sm_count

if AVAILABLE:
    try:  # Triton internals for the TMA reduce-add (no public Gluon wrapper in 3.6)
        from triton._C.libtriton import ir
        from triton.experimental.gluon.language._core import builtin
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    except ImportError:
        AVAILABLE = False

if AVAILABLE:
    from .epilogue_jit import key_row_bounds, key_tile_rows, walk_start, walk_step
    from .gluon_common import (
        CONSUMER_REGS,
        LOADER_REGS,
        descriptor,
        fence_async_shared,
        shared_layout,
        gl,
        gluon,
        load_slice,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

# (BM, BN, STAGES) per head dim: BM query rows per step, BN keys per program (two warpgroups of
# BN/2), STAGES-deep Q/dO ring (3: +3-5 % over 2 at 8k-32k; 231424 of the 232448
# bytes of shared memory)
CONFIGS = {128: (64, 128, 3)}
DEFAULT_HEAD_DIMS = (128,)  # where it is the default backward
__all__ = ["AVAILABLE", "CONFIGS", "DEFAULT_HEAD_DIMS", "MAX_REGS", "key_tile_size", "launch", "supported"]


def _config(d: int) -> tuple[int, int, int]:
    """``MAGI_GLUON_BWD_CFG=BM,BN,STAGES`` overrides the tuned config (tuning runs; a config
    that needs more shared memory than the GPU has fails at launch with Triton's
    "out of resource: shared memory")."""
    return env_config("MAGI_GLUON_BWD_CFG", CONFIGS[d], "BM,BN,STAGES")  # type: ignore[return-value]


def _rotate() -> bool:
    """``MAGI_GLUON_BWD_ROTATE=0/1`` (default 1): whether each key tile starts at its diagonal
    query block (see ``epilogue_jit.walk_start``; +4.5 % at 16k full, within 1 %
    elsewhere)."""
    return env_choice("MAGI_GLUON_BWD_ROTATE", "1", ("0", "1")) == "1"


def _split() -> bool:
    """``MAGI_GLUON_BWD_SPLIT=1/0`` (default 1): whether the launch's last programs may run as
    pieces of fewer GQA query heads, their dK/dV added with fp32 atomics
    (``program_order.split_tail``: the part-empty last wave of equal programs)."""
    return env_choice("MAGI_GLUON_BWD_SPLIT", "1", ("0", "1")) == "1"


def _pieces() -> int | str:
    """``MAGI_GLUON_BWD_PIECES=auto/0/s`` (default auto): 0 runs whole programs (but for
    ``_split``'s tail); s runs every program as pieces of s query heads, each KV head's tiles
    over one chunk of s heads before the next (``program_order.head_chunk_pieces``; dK/dV added
    into zeroed fp32 buffers). The launch order's band is then counted in (KV head, chunk)
    pieces: ``MAGI_GLUON_BWD_ORDER=2`` runs the last two chunks tile-major, ``auto`` chooses on
    the pieces' costs. ``auto``: pieces where the key tiles of causal slices differ in length
    (causal, packed causal documents), whole programs elsewhere
    (``program_order.auto_piece_heads``)."""
    raw = os.environ.get("MAGI_GLUON_BWD_PIECES", "auto")
    if raw == "auto":
        return raw
    if not raw.isdigit():
        raise ValueError(f"MAGI_GLUON_BWD_PIECES must be 'auto', 0 or a divisor of the GQA group size, got {raw!r}")
    return int(raw)


def _piece_add() -> str:
    """``MAGI_GLUON_BWD_PIECE_ADD=auto/atomic/tma`` (default auto): how a piece adds its dK/dV,
    per-element fp32 atomics or TMA bulk reduce-adds of [64, 64] boxes staged through the
    dQ buffer (needs BN = 2 BM). ``auto``: TMA where every program runs as pieces and the tiles
    allow it (pieces of 3 heads with TMA adds were the best set on causal and packed
    causal documents), atomics for a split tail's few pieces."""
    return env_choice("MAGI_GLUON_BWD_PIECE_ADD", "auto", ("auto", "atomic", "tma"))


def _order_mode() -> str | int:
    """``MAGI_GLUON_BWD_ORDER=auto/head/tile/<band>`` (default auto): the launch order of the
    (key tile, KV head) programs (``program_order``). ``head``: the key tiles of one KV head,
    then the next (resident programs share one query head's Q/dO/dQ in L2: +11 % at 16k full,
    +31 % at 32k full over ``tile``); ``tile``: every
    head's tile before the next tile, longest first (shortest tail); a number: the last that
    many heads tile-major; ``auto``: the smallest band of 1, 2, 4, ... heads whose simulated
    finish is within 5 % of tile-major's (``program_order.choose_band``)."""
    raw = os.environ.get("MAGI_GLUON_BWD_ORDER", "auto")
    if raw in ("auto", "head", "tile"):
        return raw
    if raw.isdigit() and int(raw) >= 1:
        return int(raw)
    raise ValueError(f"MAGI_GLUON_BWD_ORDER must be 'auto', 'head', 'tile' or a positive band size, got {raw!r}")


def order_band(costs: list[float], n_heads: int, n_sms: int, mode: str | int) -> int:
    """How many of the last KV heads run tile-major (1 = head-major) for tiles of ``costs``
    (``program_order.tile_costs``)."""
    if mode == "head":
        return 1
    if mode == "tile":
        return n_heads
    if isinstance(mode, int):
        return min(mode, n_heads)
    return program_order.choose_band(costs, n_heads, n_sms)


@functools.lru_cache(maxsize=256)
def _order_table(work: tuple[int, ...], n_heads: int, n_sms: int, mode: str | int, block_rows: int, group: int,
                 split: bool, piece_heads: int | str, device: torch.device,
                 staircase_share: float) -> tuple[torch.Tensor, bool, int]:
    """(the launch's pieces as int32 [n, 2]: program id, g_lo | g_hi << 16; whether some
    piece covers fewer than ``group`` query heads; the heads per piece of a launch run all as
    pieces, 0 for whole programs). ``piece_heads="auto"``: ``program_order.auto_piece_heads``
    on the tile costs and ``staircase_share`` (the causal / inv_causal share of the area)."""
    costs = program_order.tile_costs(work, block_rows)
    if piece_heads == "auto":
        piece_heads = program_order.auto_piece_heads(costs, group, staircase_share)
    if piece_heads == group:  # one piece per program: whole programs
        piece_heads = 0
    if piece_heads:  # the band is chosen over (KV head, query-head chunk) pieces and their costs
        chunks = group // piece_heads
        piece_costs = [program_order.piece_cost(c, piece_heads, group) for c in costs]
        band = order_band(piece_costs, n_heads * chunks, n_sms, mode)
        pieces = program_order.head_chunk_pieces(len(work), n_heads, group, piece_heads, band)
        partial = True  # (piece_heads < group here: a whole group is whole programs, above)
    else:
        band = order_band(costs, n_heads, n_sms, mode)
        order = program_order.band_order(len(work), n_heads, band)
        pieces = program_order.split_tail(order, costs, len(work), n_sms, group) if split else [
            (p, 0, group) for p in order]
        partial = len(pieces) > len(order)
    table = [(p, lo | hi << 16) for p, lo, hi in pieces]
    return upload(torch.tensor(table, dtype=torch.int32), device), partial, piece_heads


def key_tile_size(d: int) -> int:
    """Keys per program (the block of the key-tile tables the launch reads)."""
    return _config(d)[1]


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether this kernel can run the backward of these inputs (sm90, a tuned head dim,
    16-byte aligned rows)."""
    return AVAILABLE and hopper_supported(q, k, v, CONFIGS)


if AVAILABLE:

    @builtin
    def _reduce_add(tensor_desc, coord, src, _semantic=None):
        """TMA bulk reduce-add of shared memory ``src`` into the descriptor's tensor at ``coord``
        (asynchronous; ``tma.store_wait`` waits for it). Triton 3.6's Gluon builds the op but has
        no Python wrapper for it."""
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                                  src.handle)

    @gluon.jit
    def _reduce_add_rows(desc, buf, x, row, col, W: gl.constexpr, DH: gl.constexpr):
        """Add the [W, 2 DH] fp32 registers ``x`` into ``desc``'s tensor at (row, col) with two
        TMA reduce-adds of [W, DH] through shared ``buf``. Rows of ``x`` past the tile's keys
        are zeros (no query row sees them), so adding the whole box is exact; rows past the
        tensor are dropped."""
        lo, hi = gl.split(gl.permute(gl.reshape(x, [W, 2, DH]), (0, 2, 1)))
        tma.store_wait(0)  # the previous reduce-add has read buf
        buf.store(lo)
        fence_async_shared()
        _reduce_add(desc, [row, col], buf)
        tma.store_wait(0)
        buf.store(hi)
        fence_async_shared()
        _reduce_add(desc, [row, col + DH], buf)

    @gluon.jit
    def _loader(k_desc, v_desc, q_desc, do_desc, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, bars, LSE2,
                DELTA, META, MEMBERS, n0, first, count, hk, g_lo, g_hi, T, GROUP: gl.constexpr, BM: gl.constexpr,
                BN: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr, ROTATE: gl.constexpr):
        kv_bar, q_bars, do_bars, empty_bars, _ds_full = bars
        stat_layout: gl.constexpr = gl.BlockedLayout([BM // 32], [32], [1], [0])
        mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [n0, hk * D], kv_bar, k_smem)
        tma.async_copy_global_to_shared(v_desc, [n0, hk * D], kv_bar, v_smem)
        j = 0
        for i in range(first, first + count):
            qs, qe, ks, ke, inv, cau = load_slice(META, MEMBERS, i)
            q_lo, q_hi, _f_lo, _f_hi = key_tile_rows(n0, qs, qe, ks, ke, inv, cau, BN)
            n_blocks, first_block = walk_start(n0, q_lo, q_hi, BM, ROTATE)
            for g in range(g_lo, g_hi):
                for u in range(n_blocks):
                    mb = walk_step(u, n_blocks, first_block, q_lo, BM)
                    col = (hk * GROUP + g) * D
                    head = (hk * GROUP + g).to(gl.int64) * T
                    s = j % STAGES
                    # the block's LSE and delta, loaded before the wait for the slot (latency)
                    # (plain loads: TMA would need 16-byte aligned starts, and blocks start anywhere)
                    idx = mb + gl.arange(0, BM, layout=stat_layout)
                    ok = idx < T
                    lse2 = gl.load(LSE2 + head + idx, mask=ok, other=0.0)
                    delta = gl.load(DELTA + head + idx, mask=ok, other=0.0)
                    mbarrier.wait(empty_bars.index(s), ((j // STAGES) & 1) ^ 1)
                    mbarrier.expect(q_bars.index(s), q_desc.block_type.nbytes)
                    tma.async_copy_global_to_shared(q_desc, [mb, col], q_bars.index(s), q_smem.index(s))
                    mbarrier.expect(do_bars.index(s), do_desc.block_type.nbytes)
                    tma.async_copy_global_to_shared(do_desc, [mb, col], do_bars.index(s), do_smem.index(s))
                    # to shared memory: Q's barrier's second arrival
                    lse_smem.index(s).store(lse2)
                    delta_smem.index(s).store(delta)
                    gl.thread_barrier()
                    mbarrier.arrive(q_bars.index(s))
                    j += 1

    @gluon.jit
    def _consumer(k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem, bars, dq_desc,
                  dk_desc, dv_desc, DK, DV,
                  META, MEMBERS, n0, t_end, first, count, hk, g_lo, g_hi, HK, scale, qk_scale, cap_in, cap_out,
                  GROUP: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
                  HAS_SOFTCAP: gl.constexpr, ACCUM: gl.constexpr, ROTATE: gl.constexpr, PIECE_TMA: gl.constexpr,
                  PART: gl.constexpr):
        """dK/dV of keys [n0 + PART*W, n0 + (PART+1)*W) of the tile (W = BN/2) and, per query
        block, dQ's columns [PART*D/2, (PART+1)*D/2).

        Scores are computed key-major, S^T = K Q^T and dP^T = V dO^T ([keys, query rows]): P^T
        and dS^T are then already the [keys, rows] A operands of dV += P^T dO and dK += dS^T Q
        and stay in registers (no P in shared memory, no fence before dV), at 16 registers each
        for LSE and delta (S^T's columns), and dS^T is stored for dQ without a transpose.

        The two warpgroups exchange their dS halves through a double-buffered dS and one
        ``ds_full`` mbarrier per buffer (both halves stored). No barrier releases a buffer:
        a warpgroup overwrites buffer j % 2 at step j+2, after it has passed step j+1's
        exchange, and the other warpgroup arrives there only after its step-j dQ product, the
        buffer's last reader (x1.00-1.03 per mask over a release mbarrier on an H100)."""
        kv_bar, q_bars, do_bars, empty_bars, ds_full = bars
        W: gl.constexpr = BN // 2
        DH: gl.constexpr = D // 2
        kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, D, 16])
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, DH, 16])
        st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, BM, 16])  # S^T [W, BM]
        st_rows: gl.constexpr = gl.SliceLayout(0, st_layout)  # query rows are S^T's columns
        st_keys: gl.constexpr = gl.SliceLayout(1, st_layout)
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
        dtype: gl.constexpr = q_smem.dtype

        k_rows = k_smem.slice(PART * W, W, dim=0)
        v_rows = v_smem.slice(PART * W, W, dim=0)
        k_cols = k_smem.slice(PART * DH, DH, dim=1)
        my_dq = dq_smem.index(PART)
        dk = gl.zeros([W, D], gl.float32, kv_layout)
        dv = gl.zeros([W, D], gl.float32, kv_layout)
        inv_qk_scale = 1.0 / qk_scale
        mbarrier.wait(kv_bar, 0)
        j = 0
        for i in range(first, first + count):
            qs, qe, ks, ke, inv, cau = load_slice(META, MEMBERS, i)
            q_lo, q_hi, f_lo, f_hi = key_tile_rows(n0, qs, qe, ks, ke, inv, cau, BN)
            n_blocks, first_block = walk_start(n0, q_lo, q_hi, BM, ROTATE)
            for g in range(g_lo, g_hi):
                for u in range(n_blocks):
                    mb = walk_step(u, n_blocks, first_block, q_lo, BM)
                    h = hk * GROUP + g
                    s = j % STAGES
                    q_s = q_smem.index(s)
                    do_s = do_smem.index(s)
                    b = j % 2
                    ds_b = ds_smem.index(b)  # [BN, BM]: the block's dS^T, both warpgroups' halves
                    my_ds = ds_b.slice(PART * W, W, dim=0)
                    rows = mb + gl.arange(0, BM, layout=st_rows)
                    # LSE and delta come from shared memory (put there by the loader), read where used:
                    # 16 registers each in this layout, too many to keep live across the matmuls.
                    # S^T starts at -LSE/scale, so that LSE is dead once S^T is issued (nothing is
                    # in flight then; an initialised dP^T accumulator would make ptxas wait for S^T)
                    zero_st = gl.zeros([W, BM], gl.float32, st_layout)
                    mbarrier.wait(q_bars.index(s), (j // STAGES) & 1)
                    lse2 = lse_smem.index(s).load(st_rows)
                    s_init = zero_st if HAS_SOFTCAP else zero_st - (lse2 * inv_qk_scale)[None, :]
                    sc = warpgroup_mma(k_rows, q_s.permute((1, 0)), s_init, is_async=True)
                    mbarrier.wait(do_bars.index(s), (j // STAGES) & 1)
                    dp = warpgroup_mma(v_rows, do_s.permute((1, 0)), zero_st, use_acc=False, is_async=True)
                    sc = warpgroup_mma_wait(1, deps=(sc,))
                    if HAS_SOFTCAP:  # the cap applies to the raw score: LSE subtracted here
                        lse2 = lse_smem.index(s).load(st_rows)
                        th = 1.0 - 2.0 / (gl.exp(2.0 * cap_in * sc) + 1.0)
                        p = gl.exp2(th * cap_out - lse2[None, :])
                    else:
                        p = gl.exp2(sc * qk_scale)
                    if (mb < f_lo) | (mb + BM > f_hi):  # partial block: element mask
                        keys = n0 + PART * W + gl.arange(0, W, layout=st_keys)
                        lo, hi = key_row_bounds(keys, qs, qe, ks, ke, inv, cau, q_hi)
                        p = gl.where((rows[None, :] >= lo[:, None]) & (rows[None, :] < hi[:, None]), p, 0.0)
                    p_a = gl.convert_layout(p.to(dtype), a_layout)
                    dv = warpgroup_mma(p_a, do_s, dv, is_async=True)  # dV += P^T dO
                    dp = warpgroup_mma_wait(1, deps=(dp,))
                    ds = p * (dp - delta_smem.index(s).load(st_rows)[None, :])
                    if HAS_SOFTCAP:
                        ds = ds * (1.0 - th * th)
                    ds_a = gl.convert_layout(ds.to(dtype), a_layout)
                    dk = warpgroup_mma(ds_a, q_s, dk, is_async=True)  # dK += dS^T Q
                    my_ds.store(ds.to(dtype))
                    fence_async_shared()
                    mbarrier.arrive(ds_full.index(b))
                    zero_dq = gl.zeros([BM, DH], gl.float32, dq_layout)
                    mbarrier.wait(ds_full.index(b), (j // 2) & 1)  # both halves stored
                    dq = warpgroup_mma(ds_b.permute((1, 0)), k_cols, zero_dq, use_acc=False,
                                       is_async=True)  # dQ[:, my half] = dS K
                    # (issuing dQ before dK and writing it out while dK runs measured slower or even)
                    dv, dk, dq = warpgroup_mma_wait(0, deps=(dv, dk, dq))
                    mbarrier.arrive(empty_bars.index(s))
                    # (fp32 atomics from the registers instead measured 12-28 % slower)
                    tma.store_wait(0)  # the previous block's reduce-add has read my_dq
                    my_dq.store(dq * scale)
                    fence_async_shared()
                    _reduce_add(dq_desc, [mb, h * D + PART * DH], my_dq)  # rows past the tensor are dropped
                    j += 1
        tma.store_wait(0)

        out_layout: gl.constexpr = gl.SliceLayout(1, kv_layout)
        krows = n0 + PART * W + gl.arange(0, W, layout=out_layout)
        dcols = gl.arange(0, D, layout=gl.SliceLayout(0, kv_layout))
        ptr = (krows.to(gl.int64) * HK + hk)[:, None] * D + dcols[None, :]
        kmask = (krows < t_end)[:, None]
        dk = dk * scale
        if g_hi - g_lo < GROUP:  # a piece of the tile's heads: other pieces add into the same rows
            if PIECE_TMA:  # bulk reduce-adds through this warpgroup's dQ staging buffer
                _reduce_add_rows(dk_desc, my_dq, dk, n0 + PART * W, hk * D, W, DH)
                _reduce_add_rows(dv_desc, my_dq, dv, n0 + PART * W, hk * D, W, DH)
                tma.store_wait(0)
            else:
                gl.atomic_add(DK + ptr, dk, mask=kmask, sem="relaxed")
                gl.atomic_add(DV + ptr, dv, mask=kmask, sem="relaxed")
        else:
            if ACCUM:  # later layers add to the earlier ones' dK/dV
                dk += gl.load(DK + ptr, mask=kmask, other=0.0)
                dv += gl.load(DV + ptr, mask=kmask, other=0.0)
            gl.store(DK + ptr, dk, mask=kmask)
            gl.store(DV + ptr, dv, mask=kmask)

    @gluon.jit
    def _bwd_ws_kernel(q_desc, k_desc, v_desc, do_desc, dq_desc, dk_desc, dv_desc, DK, DV, LSE2, DELTA, META,
                       TILES, MEMBERS, ORDER, N_TILES, T, HQ, scale, qk_scale, cap_in, cap_out,
                       GROUP: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr,
                       STAGES: gl.constexpr, HAS_SOFTCAP: gl.constexpr, ACCUM: gl.constexpr, ROTATE: gl.constexpr,
                       PIECE_TMA: gl.constexpr):
        HK = HQ // GROUP
        # launch order (program_order): (head * n_tiles + tile, query heads g_lo | g_hi << 16)
        prog = gl.load(ORDER + gl.program_id(0) * 2)
        heads = gl.load(ORDER + gl.program_id(0) * 2 + 1)
        g_lo = heads & 0xFFFF
        g_hi = heads >> 16
        hk = prog // N_TILES
        tile = TILES + (prog % N_TILES) * 4
        n0 = gl.load(tile)
        t_end = gl.load(tile + 1)
        first = gl.load(tile + 2)
        count = gl.load(tile + 3)

        dtype: gl.constexpr = q_desc.dtype
        k_smem = gl.allocate_shared_memory(dtype, [BN, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [BN, D], v_desc.layout)
        q_smem = gl.allocate_shared_memory(dtype, [STAGES, BM, D], q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [STAGES, BM, D], do_desc.layout)
        ds_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        ds_smem = gl.allocate_shared_memory(dtype, [2, BN, BM], ds_layout)
        dq_smem = gl.allocate_shared_memory(gl.float32, [2, BM, D // 2], dq_desc.layout)
        stat_smem: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BM], stat_smem)
        delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BM], stat_smem)
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        do_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        ds_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        for s in gl.static_range(STAGES):
            mbarrier.init(q_bars.index(s), count=2)  # the TMA bytes + the loader's row statistics
            mbarrier.init(do_bars.index(s), count=1)
            mbarrier.init(empty_bars.index(s), count=2)  # one arrival per consumer warpgroup
        for s in gl.static_range(2):
            mbarrier.init(ds_full.index(s), count=2)
        bars = (kv_bar, q_bars, do_bars, empty_bars, ds_full)

        gl.warp_specialize([
            (_consumer, (k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem, bars,
                         dq_desc, dk_desc, dv_desc, DK, DV, META, MEMBERS, n0, t_end, first, count,
                         hk, g_lo, g_hi, HK, scale, qk_scale, cap_in, cap_out, GROUP, BM, BN, D, STAGES,
                         HAS_SOFTCAP, ACCUM, ROTATE, PIECE_TMA, 0)),
            (_consumer, (k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem, bars,
                         dq_desc, dk_desc, dv_desc, DK, DV, META, MEMBERS, n0, t_end, first, count,
                         hk, g_lo, g_hi, HK, scale, qk_scale, cap_in, cap_out, GROUP, BM, BN, D, STAGES,
                         HAS_SOFTCAP, ACCUM, ROTATE, PIECE_TMA, 1)),
            (_loader, (k_desc, v_desc, q_desc, do_desc, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, bars,
                       LSE2, DELTA, META, MEMBERS, n0, first, count, hk, g_lo, g_hi, T, GROUP, BM, BN, D, STAGES,
                       ROTATE)),
        ], [4, 1], [CONSUMER_REGS, LOADER_REGS])

    def dq_descriptor(dq: torch.Tensor, rows: int) -> "TensorDescriptor":
        """TMA descriptor of the fp32 dQ accumulator [tokens, heads, d] for the reduce-adds: box
        rows x d/2 (one warpgroup's half of a block)."""
        flat = dq.view(dq.shape[0], -1)
        box = [rows, dq.shape[-1] // 2]
        return TensorDescriptor(flat, list(flat.shape), list(flat.stride()), box, shared_layout(*box, dq.dtype))

    def launch(q, k, v, do, dq, dk, dv, lse2, delta, meta, tiles, members, work, scale, qk_scale, cap_in, cap_out,
               softcap, accum, staircase_share):
        """One launch over the key tiles (key-tile tables of block ``key_tile_size(d)``; ``work``:
        the host copy of their work, which sets the launch order) x KV heads. ``dq`` is an fp32
        accumulator the launch adds to; ``dk``/``dv`` are written (``accum``: added to).
        ``staircase_share``: the causal / inv_causal share of the mask's area (whether the
        launch runs as pieces, ``program_order.auto_piece_heads``)."""
        d = q.shape[-1]
        hq, hk = q.shape[1], k.shape[1]
        BM, BN, stages = _config(d)
        piece_heads = _pieces()
        if piece_heads != "auto" and piece_heads and (hq // hk) % piece_heads:
            raise ValueError(f"MAGI_GLUON_BWD_PIECES={piece_heads} must divide the GQA group of {hq // hk} query heads "
                             "per KV head (or be 0 or 'auto')")
        order, split, all_pieces = _order_table(work, hk, sm_count(q.device), _order_mode(), BM, hq // hk, _split(),
                                                piece_heads, q.device, round(staircase_share, 3))
        if split and not accum:  # the split tiles' pieces add their dK/dV into zeros
            dk.zero_()
            dv.zero_()
        add = _piece_add()
        piece_tma = add == "tma" or (add == "auto" and bool(all_pieces) and BN // 2 == BM)
        if piece_tma and BN // 2 != BM:
            raise ValueError(f"MAGI_GLUON_BWD_PIECE_ADD=tma stages a warpgroup's {BN // 2} key rows in the {BM}-row "
                             f"dQ buffer: it needs BN = 2 BM (MAGI_GLUON_BWD_CFG), got BM={BM}, BN={BN}")
        dq_d = dq_descriptor(dq, BM)
        # (without PIECE_TMA the dK/dV descriptors are not read: dQ's stands in, no host work)
        dk_d, dv_d = (dq_descriptor(dk, BN // 2), dq_descriptor(dv, BN // 2)) if piece_tma else (dq_d, dq_d)
        _bwd_ws_kernel[(len(order),)](
            descriptor(q, BM), descriptor(k, BN), descriptor(v, BN), descriptor(do, BM), dq_d, dk_d, dv_d, dk, dv,
            lse2, delta, meta, tiles, members, order, len(work), q.shape[0], hq, scale, qk_scale, cap_in, cap_out,
            GROUP=hq // hk, BM=BM, BN=BN, D=d, STAGES=stages, HAS_SOFTCAP=softcap > 0, ACCUM=accum,
            ROTATE=_rotate(), PIECE_TMA=piece_tma, num_warps=4, maxnreg=MAX_REGS,
        )
