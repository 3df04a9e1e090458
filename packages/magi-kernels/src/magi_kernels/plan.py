"""Planning an attention call (pure host code): which GPU kernels run, with which tiles, over which
tile tables and in which program order.

A plan is built once per (mask slices, shapes, dtype, device, :class:`KernelConfig`) and only
launched afterwards, as FlashInfer's ``plan()`` / ``run()``::

    plan = magi_kernels.plan_attention(q_ranges, k_ranges, attn_type_map, seqlen_q, seqlen_k,
                                       (heads_q, heads_kv), head_dim, torch.bfloat16)
    print(plan)                       # what will run: kernels, tiles, layers, program order
    out, lse = flex_flash_attn_func(q, k, v, q_ranges, k_ranges, attn_type_map, plan=plan)

A call without a plan finds one in a memo keyed on those explicit values (never on the
environment). The forward's and the backward's parts are built at their first use (a forward-only
caller never builds the backward's tables). No Triton import here: the launching modules
(``triton_backend``, ``gluon_fwd``, ``gluon_bwd``) only run a plan.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from . import program_order
from .host_cache import upload
from .kernel_config import (
    TUNED_GLUON_BWD,
    TUNED_GLUON_FWD,
    GluonBwdTiles,
    GluonFwdTiles,
    KernelConfig,
    TritonTiles,
    resolve_kernel_config,
)
from .tiles import SliceTable, TileLayer, host_slices, staircase_share, tile_tables
from .validation import normalize_slices

__all__ = ["AttentionPlan", "BackwardPlan", "DeviceCaps", "ForwardPlan", "PlanKey", "call_plan", "plan_attention"]

SUPPORTED_HEAD_DIMS = (64, 128, 256)  # the head dims the kernels are compiled for
# head dims whose Triton forward loads full K/V blocks through TMA descriptors on sm90+ (measured
# faster with the 128x128 tile; docs/design.md, "Triton kernels")
TMA_FWD_HEAD_DIMS = (128,)
GLUON_FWD_DEFAULT_HEAD_DIMS = (128,)  # where the Gluon forward is the default (measured faster than Triton's)
GLUON_BWD_DEFAULT_HEAD_DIMS = (128,)  # where the Gluon backward is the default
DQ_MODE_IDS = {"split": 0, "atomic": 1, "tma": 2}
DEFAULT_DQ_MODE = "split"  # on sm90+ (``dq_mode``)
_GLUON_DTYPES = (torch.bfloat16, torch.float16)
# an item's fixed cost in key blocks (its output and the ring's refill), for the forward's queues
PERSIST_ITEM_OVERHEAD_BLOCKS = 0.5


def kernel_head_dim(d: int) -> int | None:
    """Head dim the kernels run ``d`` at: ``d`` itself if they are compiled for it, else the next
    of SUPPORTED_HEAD_DIMS for a multiple of 8 up to 256 (e.g. 80, 96, 192: zero-padded, which
    leaves scores and outputs unchanged and costs the padded flops), else None."""
    if d in SUPPORTED_HEAD_DIMS:
        return d
    if d % 8 or d <= 0:
        return None
    return next((p for p in SUPPORTED_HEAD_DIMS if p > d), None)


class DeviceCaps(NamedTuple):
    """What the planner needs to know of the device (the launching side fills it in)."""

    device: str  # "cuda:0", "cpu"
    sm_major: int  # compute capability major (0 off CUDA)
    sm_count: int  # SMs (the list schedules of the Gluon launch orders)
    gluon_fwd: bool  # the Gluon forward can run here (Gluon present, sm90)
    gluon_bwd: bool  # the Gluon backward can run here


class PlanKey(NamedTuple):
    """Everything a plan depends on (explicit values only)."""

    slices: SliceTable
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    head_dim: int  # the head dim the kernels run (``kernel_head_dim``)
    dtype: torch.dtype
    config: KernelConfig
    caps: DeviceCaps
    deterministic: bool  # torch.use_deterministic_algorithms at planning time


@dataclass(frozen=True)
class ForwardPlan:
    """The forward's launches: ``kernel`` ("gluon" or "triton") with ``tiles``, over the query
    tile tables (``layers``; several layers merge into an fp32 accumulator), and for Gluon the
    per-layer queue tables of its persistent programs."""

    kernel: str
    tiles: TritonTiles | GluonFwdTiles
    tma: bool  # Triton: full K/V blocks through TMA descriptors
    meta: torch.Tensor
    layers: tuple[TileLayer, ...]
    covered: bool  # layer 0 writes every row: outputs need no fill
    queues: tuple[tuple[torch.Tensor, int], ...]  # Gluon: (queue table, programs) per layer


@dataclass(frozen=True)
class BackwardPlan:
    """The backward's launches. Gluon: one pass over the key tiles (``kv_layers``) in the
    per-layer program orders ``orders`` (pieces table, whether some piece covers part of the GQA
    group, heads per piece when all are pieces), pieces adding dK/dV through TMA where
    ``piece_tma``. Triton: dK/dV programs over ``kv_layers`` and, with ``dq_mode`` "split", dQ
    programs over ``q_layers``, in one launch where ``fused``."""

    kernel: str
    tiles: GluonBwdTiles | TritonTiles  # Gluon tiles, or the Triton dK/dV tiles
    dq_tiles: TritonTiles | None  # Triton: the dQ programs' tiles (their launch constants in every mode)
    dq_mode: str  # Triton: "split", "atomic" or "tma"; Gluon: "tma" (its own reduce-adds)
    kv_meta: torch.Tensor
    kv_layers: tuple[TileLayer, ...]
    kv_covered: bool
    q_meta: torch.Tensor | None
    q_layers: tuple[TileLayer, ...]
    q_covered: bool
    fused: bool
    orders: tuple[tuple[torch.Tensor, bool, int], ...]
    piece_tma: tuple[bool, ...]
    rotate: bool
    deterministic: bool


class AttentionPlan:
    """What a call with these slices, shapes and config runs (see the module docstring). Build it
    with :func:`plan_attention`; print it to see the launches. Parts are built at first use."""

    def __init__(self, key: PlanKey):
        self.key = key

    @functools.cached_property
    def forward(self) -> ForwardPlan:
        return _plan_forward(self.key)

    @functools.cached_property
    def backward(self) -> BackwardPlan:
        return _plan_backward(self.key)

    def describe(self) -> str:
        """A readable summary: inputs, config, and per pass the kernel, tiles, layers and order."""
        k = self.key
        f, b = self.forward, self.backward
        lines = [
            f"AttentionPlan: {len(k.slices)} slices, seqlen_q={k.seqlen_q}, seqlen_k={k.seqlen_k}, "
            f"heads={k.heads_q}/{k.heads_kv}, head_dim={k.head_dim}, {str(k.dtype).replace('torch.', '')}, "
            f"{k.caps.device}" + (f" (sm{k.caps.sm_major}x, {k.caps.sm_count} SMs)" if k.caps.sm_major else ""),
            f"  config: {k.config.describe()}",
            f"  forward: {f.kernel} {_tiles_text(f.tiles)}{', TMA loads' if f.tma else ''}; "
            f"{_layers_text(f.layers, k.heads_q)}" + (f"; {sum(p for _, p in f.queues)} persistent programs"
                                                      if f.queues else ""),
        ]
        if b.kernel == "gluon":
            pieces = [f"{len(o)} programs" + (f" ({h} heads per piece)" if h else ", split tail" if s else "")
                      for o, s, h in b.orders]
            lines.append(f"  backward: gluon {_tiles_text(b.tiles)}, dK/dV and dQ in one pass; "
                         f"{_layers_text(b.kv_layers, k.heads_kv, 'key')}; order: {'; '.join(pieces) or 'none'}"
                         f"{', rotated walk' if b.rotate else ''}")
        else:
            dq = (f"dQ programs {_tiles_text(b.dq_tiles)} over {_layers_text(b.q_layers, k.heads_q)}"
                  if b.dq_mode == "split" else f"dQ added by the dK/dV programs ({b.dq_mode})")
            lines.append(f"  backward: triton dK/dV {_tiles_text(b.tiles)} over {_layers_text(b.kv_layers, k.heads_kv, 'key')}"
                         f"; {dq}{'; one fused launch' if b.fused else ''}"
                         f"{'; deterministic' if b.deterministic else ''}")
        return "\n".join(lines)

    __str__ = describe

    def __repr__(self) -> str:
        k = self.key
        return (f"AttentionPlan({len(k.slices)} slices, seqlen_q={k.seqlen_q}, seqlen_k={k.seqlen_k}, "
                f"heads={k.heads_q}/{k.heads_kv}, head_dim={k.head_dim}, {k.dtype}, {k.caps.device})")

    def check(self, key: PlanKey) -> None:
        """Raise ``ValueError`` naming every way ``key`` (a call's inputs) differs from the plan's."""
        if key == self.key:
            return
        diffs = []
        for name in PlanKey._fields:
            mine, theirs = getattr(self.key, name), getattr(key, name)
            if mine != theirs:
                if name == "slices":
                    i = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
                    first = (f"slice {i}: plan {mine[i] if i < len(mine) else 'none'}, call "
                             f"{theirs[i] if i < len(theirs) else 'none'}")
                    diffs.append(f"mask slices (plan: {len(mine)} slices, call: {len(theirs)}; first difference at "
                                 f"{first}, as (q_start, q_end, k_start, k_end, mask_type))")
                elif name == "config":
                    diffs.append(f"kernel config (plan: {mine.describe()}; call: {theirs.describe()})")
                else:
                    diffs.append(f"{name} (plan: {mine}, call: {theirs})")
        raise ValueError("plan= was built for other inputs: " + "; ".join(diffs) + ". Build one for these inputs with "
                         "magi_kernels.plan_attention(...), or pass plan=None")


def _tiles_text(t) -> str:
    if t is None:
        return ""
    return "(" + ", ".join(f"{n}={v}" for n, v in zip(t._fields, t)) + ")"


def _layers_text(layers: tuple[TileLayer, ...], heads: int, axis: str = "query") -> str:
    tiles = " + ".join(str(layer.n) for layer in layers) or "0"
    return f"{len(layers)} layer{'s' if len(layers) != 1 else ''} of {tiles} {axis} tiles x {heads} heads"


# kernel choices -------------------------------------------------------------------------------

def _gluon_ok(key: PlanKey, available: bool, tuned: dict) -> bool:
    """The Gluon kernel can run: present and on sm90 (``available``), a tuned head dim, bf16/fp16,
    non-empty inputs (16-byte alignment is the launch's: it copies misaligned inputs)."""
    return (available and key.head_dim in tuned and key.dtype in _GLUON_DTYPES and key.seqlen_q > 0
            and key.seqlen_k > 0)


def use_gluon_fwd(key: PlanKey) -> bool:
    """Whether the forward runs the Gluon kernel: by default at GLUON_FWD_DEFAULT_HEAD_DIMS where it
    can run; ``config.gluon_fwd`` False turns it off, True on wherever it can run."""
    c = key.config.gluon_fwd
    if c is False or not _gluon_ok(key, key.caps.gluon_fwd, TUNED_GLUON_FWD):
        return False
    return c is True or key.head_dim in GLUON_FWD_DEFAULT_HEAD_DIMS


def use_tma(key: PlanKey) -> bool:
    """Whether the Triton forward loads full K/V blocks through TMA descriptors: by default on
    sm90+ at TMA_FWD_HEAD_DIMS; ``config.triton_tma`` overrides (Triton's CPU interpreter emulates
    them). Partial blocks always use masked pointer loads."""
    if key.config.triton_tma is not None:
        return key.config.triton_tma
    return key.caps.sm_major >= 9 and key.head_dim in TMA_FWD_HEAD_DIMS


def dq_mode(key: PlanKey) -> str:
    """How the Triton backward computes dQ:

    * ``split``: dQ programs of their own (recompute scores and dP; deterministic);
    * ``atomic``: the dK/dV programs add dS K into an fp32 dQ with pointer atomics;
    * ``tma``: the same through TMA bulk reduce-adds (sm90+; 5 matmuls per block instead of 7).

    The accumulating modes are not bitwise deterministic (the order of the fp32 adds varies), so
    ``torch.use_deterministic_algorithms(True)`` selects ``split``. ``config.dq_mode`` overrides."""
    mode = key.config.dq_mode
    if mode != "auto":
        if mode == "tma" and key.caps.device.startswith("cuda") and key.caps.sm_major < 9:
            raise ValueError("KernelConfig.dq_mode='tma' needs TMA (sm90+); use 'atomic' or 'split' on this GPU")
        return mode
    if key.deterministic or not key.caps.device.startswith("cuda"):
        return "split"
    return DEFAULT_DQ_MODE if key.caps.sm_major >= 9 else "split"


def use_gluon_bwd(key: PlanKey) -> bool:
    """Whether the backward runs the Gluon kernel (dK, dV and dQ in one pass): by default at
    GLUON_BWD_DEFAULT_HEAD_DIMS where it can run. Its dQ is a sum of fp32 reduce-adds in no fixed
    order, so ``torch.use_deterministic_algorithms(True)`` and an explicit ``config.dq_mode``
    select the Triton backward; ``config.gluon_bwd`` False turns it off, True on wherever it runs."""
    c = key.config
    if c.gluon_bwd is False or key.deterministic or c.dq_mode != "auto":
        return False
    if not _gluon_ok(key, key.caps.gluon_bwd, TUNED_GLUON_BWD):
        return False
    return c.gluon_bwd is True or key.head_dim in GLUON_BWD_DEFAULT_HEAD_DIMS


# program orders ---------------------------------------------------------------------------------

def item_tiles(n_tiles: int, hq: int, group: int) -> list[int]:
    """The tile of each item of the Gluon forward's KV-major order, item id = position."""
    per_kv = n_tiles * group
    return [(p % per_kv) // group for p in range(n_tiles * hq)]


@functools.lru_cache(maxsize=256)
def fwd_queue_table(work: tuple[int, ...], hq: int, group: int, block_keys: int, n_sms: int,
                    device: str) -> tuple[torch.Tensor, int]:
    """(queue table, programs) of a Gluon forward launch: the list schedule of the KV-major
    order's items on ``n_sms`` SMs (``program_order.list_queues``, item cost: its tile's key
    blocks), as int32 [programs + 1 offsets, then the items of program 0, 1, ...]."""
    blocks = [-(-w // block_keys) + PERSIST_ITEM_OVERHEAD_BLOCKS for w in work]
    queues = program_order.list_queues([blocks[t] for t in item_tiles(len(work), hq, group)], n_sms)
    offsets = [0]
    for qu in queues:
        offsets.append(offsets[-1] + len(qu))
    table = offsets + [item for qu in queues for item in qu]
    return upload(torch.tensor(table, dtype=torch.int32), device), len(queues)


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
def bwd_order_table(work: tuple[int, ...], n_heads: int, n_sms: int, mode: str | int, block_rows: int, group: int,
                    split: bool, piece_heads: int | str, device: str,
                    staircase: float) -> tuple[torch.Tensor, bool, int]:
    """(the Gluon backward launch's pieces as int32 [n, 2]: program id, g_lo | g_hi << 16; whether
    some piece covers fewer than ``group`` query heads; the heads per piece of a launch run all as
    pieces, 0 for whole programs). ``piece_heads="auto"``: ``program_order.auto_piece_heads`` on
    the tile costs and ``staircase`` (the causal / inv_causal share of the area)."""
    costs = program_order.tile_costs(work, block_rows)
    if piece_heads == "auto":
        piece_heads = program_order.auto_piece_heads(costs, group, staircase)
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


# building ---------------------------------------------------------------------------------------

def _plan_forward(key: PlanKey) -> ForwardPlan:
    d, dev = key.head_dim, key.caps.device
    if use_gluon_fwd(key):
        tiles = key.config.gluon_fwd_for(d)
        meta, layers, covered = tile_tables(key.slices, 0, tiles.block_m, dev, key.seqlen_q)
        group = key.heads_q // key.heads_kv
        queues = tuple(fwd_queue_table(layer.work, key.heads_q, group, tiles.block_n, key.caps.sm_count, dev)
                       for layer in layers)
        return ForwardPlan("gluon", tiles, False, meta, tuple(layers), covered, queues)
    tma = use_tma(key)
    tiles = key.config.triton_fwd_for(d, tma)
    meta, layers, covered = tile_tables(key.slices, 0, tiles.block_m, dev, key.seqlen_q)
    return ForwardPlan("triton", tiles, tma, meta, tuple(layers), covered, ())


def _plan_backward(key: PlanKey) -> BackwardPlan:
    d, dev, c = key.head_dim, key.caps.device, key.config
    group = key.heads_q // key.heads_kv
    if use_gluon_bwd(key):
        tiles = c.gluon_bwd_for(d)
        meta, layers, covered = tile_tables(key.slices, 2, tiles.block_n, dev, key.seqlen_k)
        piece_heads = "auto" if c.bwd_piece_heads is None else c.bwd_piece_heads
        if piece_heads != "auto" and piece_heads and group % piece_heads:
            raise ValueError(f"KernelConfig.bwd_piece_heads={piece_heads} must divide the GQA group of {group} "
                             "query heads per KV head (or be 0 or None for auto)")
        stairs = round(staircase_share(key.slices), 3)
        orders = tuple(bwd_order_table(layer.work, key.heads_kv, key.caps.sm_count, c.bwd_order, tiles.block_m, group,
                                       c.bwd_split_tail, piece_heads, dev, stairs) for layer in layers)
        pair = tiles.block_n // 2 == tiles.block_m
        piece_tma = tuple(c.bwd_piece_add == "tma" or (c.bwd_piece_add == "auto" and bool(all_pieces) and pair)
                          for _, _, all_pieces in orders)
        if any(piece_tma) and not pair:
            raise ValueError(f"KernelConfig.bwd_piece_add='tma' stages a warpgroup's {tiles.block_n // 2} key rows in "
                             f"the {tiles.block_m}-row dQ buffer: it needs block_n = 2 * block_m (gluon_bwd_tiles), got "
                             f"{tiles}")
        return BackwardPlan("gluon", tiles, None, "tma", meta, tuple(layers), covered, None, (), False, False, orders,
                            piece_tma, c.bwd_rotate, False)
    dkdv, dq_tiles = c.triton_dkdv_for(d), c.triton_dq_for(d)
    mode = dq_mode(key)
    kv_meta, kv_layers, kv_cov = tile_tables(key.slices, 2, dkdv.block_n, dev, key.seqlen_k)
    if mode == "split":
        q_meta, q_layers, q_cov = tile_tables(key.slices, 0, dq_tiles.block_m, dev, key.seqlen_q)
    else:
        q_meta, q_layers, q_cov = kv_meta, [], False
    # dK/dV and dQ programs in one launch where one layer on each axis allows it (no tail between
    # them, both kinds resident together: 358 against 330 TFLOP/s at 16k full on an H100)
    fused = (len(kv_layers) == 1 and len(q_layers) == 1
             and (dkdv.num_warps, dkdv.num_stages) == (dq_tiles.num_warps, dq_tiles.num_stages))
    return BackwardPlan("triton", dkdv, dq_tiles, mode, kv_meta, tuple(kv_layers), kv_cov,
                        q_meta, tuple(q_layers), q_cov, fused, (), (), c.bwd_rotate, mode == "split")


# the memo and the public entry point --------------------------------------------------------------

_MEMO: OrderedDict[PlanKey, AttentionPlan] = OrderedDict()
MEMO_SIZE = 256

# the launching side registers how to read a device's capabilities (``triton_backend``)
_caps_reader: Callable[[str], DeviceCaps] | None = None


def register_device_caps(reader: Callable[[str], DeviceCaps]) -> None:
    """Set how the planner reads a device's capabilities (called once by the GPU backend)."""
    global _caps_reader
    _caps_reader = reader


def device_caps(device: str) -> DeviceCaps:
    """The capabilities of ``device`` ("cuda:0", "cpu"); without a GPU backend: no Gluon, no SMs."""
    if _caps_reader is not None:
        return _caps_reader(device)
    return DeviceCaps(device, 0, 1, False, False)


def plan_key(slices: SliceTable, seqlen_q: int, seqlen_k: int, heads_q: int, heads_kv: int, head_dim: int,
             dtype: torch.dtype, config: KernelConfig, device: str) -> PlanKey:
    """The key of a call (``head_dim``: the inputs' head dim; the key holds the kernels')."""
    kd = kernel_head_dim(head_dim) or head_dim
    return PlanKey(slices, seqlen_q, seqlen_k, heads_q, heads_kv, kd, dtype, config, device_caps(device),
                   torch.are_deterministic_algorithms_enabled())


def plan_for_key(key: PlanKey) -> AttentionPlan:
    """The memoised plan of ``key`` (least recently used plans beyond MEMO_SIZE are dropped)."""
    plan = _MEMO.get(key)
    if plan is None:
        plan = _MEMO[key] = AttentionPlan(key)
        if len(_MEMO) > MEMO_SIZE:
            _MEMO.popitem(last=False)
    else:
        _MEMO.move_to_end(key)
    return plan


def clear_caches() -> None:
    """Drop every host-side cache of the kernels: the memoised plans and the tile, queue and order
    tables they hold on the device, the slices already validated and the host copies of range
    tensors (benchmarks of a first call; ``magi_attn.clear_cache`` calls it)."""
    from . import host_cache, validation

    _MEMO.clear()
    tile_tables.cache_clear()
    fwd_queue_table.cache_clear()
    bwd_order_table.cache_clear()
    staircase_share.cache_clear()
    validation.clear_checked()
    host_cache.clear()


def plan_attention(q_ranges, k_ranges, attn_type_map, seqlen_q: int, seqlen_k: int, num_heads: int | tuple[int, int],
                   head_dim: int, dtype: torch.dtype, config: KernelConfig | None = None,
                   device: str | torch.device | None = None) -> AttentionPlan:
    """The plan of attention over these slices (``flex_flash_attn_func``'s ``q_ranges``,
    ``k_ranges``, ``attn_type_map`` in any form it takes) for q of ``[seqlen_q, heads_q,
    head_dim]`` and k/v of ``[seqlen_k, heads_kv, head_dim]`` in ``dtype`` on ``device`` (the
    current CUDA device by default, else the CPU). ``num_heads``: ``heads_q`` or ``(heads_q,
    heads_kv)``; ``head_dim``: the wider of the query/key and value head dims. ``config``: None for
    the process default. Pass it as ``flex_flash_attn_func(..., plan=plan)``: a call whose inputs
    differ from these is refused. Printing it shows what runs."""
    if isinstance(num_heads, int):
        num_heads = (num_heads, num_heads)
    hq, hk = num_heads
    for name, v in (("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k), ("heads_q", hq), ("heads_kv", hk),
                    ("head_dim", head_dim)):
        if not isinstance(v, int) or isinstance(v, bool) or v < (1 if name.startswith("head") else 0):
            raise ValueError(f"plan_attention: {name} must be a {'positive' if name.startswith('head') else 'non-negative'}"
                             f" int, got {v!r}")
    if hq % hk:
        raise ValueError(f"plan_attention: heads_q ({hq}) must be a multiple of heads_kv ({hk}) (GQA)")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"plan_attention: dtype must be a torch.dtype, got {dtype!r}")
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    st = normalize_slices(q_ranges, k_ranges, attn_type_map)
    slices = host_slices(st.q_ranges, st.k_ranges, st.attn_type_map)
    key = plan_key(slices, seqlen_q, seqlen_k, hq, hk, head_dim, dtype, resolve_kernel_config(config), str(device))
    return plan_for_key(key)


def call_plan(q: torch.Tensor, k: torch.Tensor, q_ranges, k_ranges, attn_type_map, config: KernelConfig | None,
              plan: AttentionPlan | None) -> AttentionPlan:
    """The plan of a call: ``plan`` after checking that it was built for these inputs (a
    ``ValueError`` naming what differs), or the memoised plan of the call's values. With a plan
    and no ``config`` the plan's config runs."""
    if plan is not None and not isinstance(plan, AttentionPlan):
        raise TypeError(f"plan must be a magi_kernels.AttentionPlan (plan_attention) or None, got {type(plan).__name__}")
    config = plan.key.config if plan is not None and config is None else resolve_kernel_config(config)
    key = plan_key(host_slices(q_ranges, k_ranges, attn_type_map), q.shape[0], k.shape[0], q.shape[1], k.shape[1],
                   q.shape[-1], q.dtype, config, str(q.device))
    if plan is None:
        return plan_for_key(key)
    plan.check(key)
    return plan
