"""Kernel tuning as typed configuration: :class:`KernelConfig`.

Every tile size and pipeline choice of the GPU kernels is a field of one frozen, validated
dataclass. Its defaults are the measured fastest settings (docs/performance.md, docs/design.md);
``None`` / ``"auto"`` leave a choice to the backend, which decides per head dim and GPU as
described on each field. A config is passed to ``flex_flash_attn_func(..., kernel_config=)``,
carried by ``magi_attn.DistAttnConfig.kernel`` (and so checked across ranks), or held in a plan
(``plan_attention``).

Environment variables are a developer override only (tuning sweeps, A/B runs): they set the
process-wide default, :func:`default_kernel_config`, read once at its first use and never on a
launch. A config passed explicitly is used as it is. The variables and their fields:

=============================  ========================  =========================================
variable                       field                     values (default)
=============================  ========================  =========================================
``MAGI_TRITON_FWD_CFG``        ``triton_fwd_tiles``      ``BM,BN,num_warps,num_stages`` (tuned per
                                                         head dim, ``TUNED_TRITON_FWD``)
``MAGI_TRITON_BWD_CFG``        ``triton_dkdv_tiles``     ``BM,BN,num_warps,num_stages`` (tuned)
``MAGI_TRITON_DQ_CFG``         ``triton_dq_tiles``       ``BM,BN,num_warps,num_stages`` (tuned)
``MAGI_TRITON_TMA``            ``triton_tma``            ``auto`` / ``1`` / ``0`` (auto: on sm90+ at
                                                         head dim 128)
``MAGI_TRITON_DQ``             ``dq_mode``               ``auto`` / ``split`` / ``atomic`` / ``tma``
                                                         (auto: ``split``)
``MAGI_GLUON_FWD``             ``gluon_fwd``             ``auto`` / ``1`` / ``0`` (auto: on sm90 at
                                                         head dim 128)
``MAGI_GLUON_FWD_CFG``         ``gluon_fwd_tiles``       ``BM,BN,STAGES,PARTS,PING`` (128,128,3,2,1)
``MAGI_GLUON_BWD``             ``gluon_bwd``             ``auto`` / ``1`` / ``0`` (auto: on sm90 at
                                                         head dim 128)
``MAGI_GLUON_BWD_CFG``         ``gluon_bwd_tiles``       ``BM,BN,STAGES`` (64,128,3)
``MAGI_GLUON_BWD_ROTATE``      ``bwd_rotate``            ``1`` / ``0`` (1)
``MAGI_GLUON_BWD_SPLIT``       ``bwd_split_tail``        ``1`` / ``0`` (1)
``MAGI_GLUON_BWD_PIECES``      ``bwd_piece_heads``       ``auto`` / ``0`` / heads per piece (auto)
``MAGI_GLUON_BWD_PIECE_ADD``   ``bwd_piece_add``         ``auto`` / ``atomic`` / ``tma`` (auto)
``MAGI_GLUON_BWD_ORDER``       ``bwd_order``             ``auto`` / ``head`` / ``tile`` / band (auto)
=============================  ========================  =========================================

Other ``MAGI_*`` variables are not tuning: ``MAGI_SKIP_NATIVE`` (build without the native
extension), ``MAGI_LOG_LEVEL`` (logging). The switches of removed kernel variants
(``REMOVED_SWITCHES``) are ignored with one warning.

This module is pure host code (no Triton import).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple, Union

__all__ = ["GluonBwdTiles", "GluonFwdTiles", "KernelConfig", "TritonTiles", "default_kernel_config"]


class TritonTiles(NamedTuple):
    """Tiles of a Triton kernel: ``block_m`` query rows, ``block_n`` keys (for dK/dV: ``block_n``
    keys per program, ``block_m`` query rows per step), and the launch's warps and stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


class GluonFwdTiles(NamedTuple):
    """Tiles of the Gluon forward: ``block_m`` query rows (two warpgroups of ``block_m/2``),
    ``block_n`` keys per ring slot, ``stages`` ring slots, ``parts`` consumer partitions (1 or 2)
    and ``pingpong`` (their matmuls in alternate rounds, with 2 parts)."""

    block_m: int
    block_n: int
    stages: int
    parts: int
    pingpong: int


class GluonBwdTiles(NamedTuple):
    """Tiles of the Gluon backward: ``block_m`` query rows per step, ``block_n`` keys per program
    (two warpgroups of ``block_n/2``), ``stages`` Q/dO ring slots."""

    block_m: int
    block_n: int
    stages: int


# Measured per head dim (tile sweeps, bench/sweep_tiles.py). The Triton backward's dK/dV
# tiles: block_n keys per program, block_m query rows per step.
TUNED_TRITON_FWD: dict[int, TritonTiles] = {64: TritonTiles(128, 64, 4, 3), 128: TritonTiles(128, 64, 8, 3),
                                            256: TritonTiles(64, 32, 4, 3)}
TUNED_TRITON_FWD_TMA: dict[int, TritonTiles] = {128: TritonTiles(128, 128, 8, 3)}
TUNED_TRITON_DKDV: dict[int, TritonTiles] = {64: TritonTiles(64, 128, 4, 3), 128: TritonTiles(64, 128, 8, 3),
                                             256: TritonTiles(32, 64, 8, 2)}
TUNED_TRITON_DQ: dict[int, TritonTiles] = {64: TritonTiles(128, 64, 4, 3), 128: TritonTiles(128, 64, 8, 3),
                                           256: TritonTiles(64, 32, 8, 2)}
# the Gluon kernels exist for these head dims (d=64 of the forward compiled and timed faster but
# its correctness run did not finish on the device, so it is not offered)
TUNED_GLUON_FWD: dict[int, GluonFwdTiles] = {128: GluonFwdTiles(128, 128, 3, 2, 1)}
# STAGES 3: 231424 of the 232448 bytes of an H100's shared memory
TUNED_GLUON_BWD: dict[int, GluonBwdTiles] = {128: GluonBwdTiles(64, 128, 3)}

DQ_MODES = ("auto", "split", "atomic", "tma")
PIECE_ADDS = ("auto", "atomic", "tma")
ORDERS = ("auto", "head", "tile")
_WARPS = (1, 2, 4, 8, 16)

Order = Union[str, int]


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _tiles(name: str, value, kind: type, env: str):
    """``value`` as ``kind`` (a tiles NamedTuple), validated; None stays None."""
    if value is None:
        return None
    fields = ", ".join(kind._fields)
    if not isinstance(value, (tuple, list)) or len(value) != len(kind._fields) or not all(_is_int(x) for x in value):
        raise ValueError(f"KernelConfig.{name} must be None (tuned per head dim) or {len(kind._fields)} ints "
                         f"({fields}), got {value!r}")
    t = kind(*value)
    for f in ("block_m", "block_n"):
        b = getattr(t, f)
        if not _pow2(b) or b < 16:
            raise ValueError(f"KernelConfig.{name}.{f} must be a power of two >= 16 (the matmul tile), got {b}; "
                             f"e.g. {f}=64 (env {env})")
    if kind is TritonTiles:
        if t.num_warps not in _WARPS:
            raise ValueError(f"KernelConfig.{name}.num_warps must be one of {_WARPS}, got {t.num_warps}")
        if t.num_stages < 1:
            raise ValueError(f"KernelConfig.{name}.num_stages must be >= 1, got {t.num_stages}")
    else:
        if t.stages < 1:
            raise ValueError(f"KernelConfig.{name}.stages must be >= 1, got {t.stages}")
    if kind is GluonFwdTiles:
        if t.parts not in (1, 2):
            raise ValueError(f"KernelConfig.{name}.parts must be 1 or 2 (consumer partitions), got {t.parts}")
        if t.pingpong not in (0, 1):
            raise ValueError(f"KernelConfig.{name}.pingpong must be 0 or 1, got {t.pingpong}")
    return t


def _tristate(name: str, value) -> None:
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"KernelConfig.{name} must be None (the backend chooses), True or False, got {value!r}")


@dataclass(frozen=True)
class KernelConfig:
    """Tile sizes and pipeline choices of the GPU kernels (the torch backend ignores them).

    Defaults are the measured fastest settings; ``None`` / ``"auto"`` leave the choice to the
    backend per head dim and GPU. Tile fields apply to every head dim when set (``None``: the
    tuned table, ``TUNED_*``). Environment overrides: see the module docstring.

    Args:
        triton_fwd_tiles: Triton forward tiles (``TritonTiles``).
        triton_dkdv_tiles: Triton backward dK/dV tiles (``block_n`` keys per program).
        triton_dq_tiles: Triton backward dQ tiles (split dQ mode).
        triton_tma: the Triton forward loads full K/V blocks through TMA descriptors (None:
            on sm90+ at head dim 128).
        dq_mode: how the Triton backward computes dQ: ``"split"`` (dQ programs of their own,
            deterministic), ``"atomic"`` (fp32 pointer atomics from the dK/dV programs),
            ``"tma"`` (TMA reduce-adds, sm90+), ``"auto"`` (split). Any value other than auto
            selects the Triton backward (the Gluon backward has one dQ path of its own).
        gluon_fwd: the warp-specialised Gluon forward (sm90) where it supports the inputs
            (None: at the head dims of ``TUNED_GLUON_FWD``; True: wherever it runs).
        gluon_fwd_tiles: Gluon forward tiles (``GluonFwdTiles``).
        gluon_bwd: the Gluon backward (as ``gluon_fwd``; ``torch.use_deterministic_algorithms``
            selects the Triton backward).
        gluon_bwd_tiles: Gluon backward tiles (``GluonBwdTiles``).
        bwd_rotate: each key tile of the Gluon backward starts its query walk at its diagonal.
        bwd_split_tail: the Gluon backward's last programs may run as pieces of fewer query
            heads (``program_order.split_tail``).
        bwd_piece_heads: query heads per piece when every Gluon backward program runs as pieces
            (0: whole programs; None: pieces where the key tiles of causal slices differ in
            length, or any tiles differ very much, ``program_order.auto_piece_heads``). Must
            divide the GQA group.
        bwd_piece_add: how pieces add their dK/dV: ``"atomic"``, ``"tma"`` (needs
            ``block_n == 2 * block_m``), ``"auto"`` (TMA when every program runs as pieces).
        bwd_order: launch order of the Gluon backward's programs: ``"head"``, ``"tile"``, a
            positive band of last heads run tile-major, or ``"auto"``
            (``program_order.choose_band``).
    """

    triton_fwd_tiles: TritonTiles | None = None
    triton_dkdv_tiles: TritonTiles | None = None
    triton_dq_tiles: TritonTiles | None = None
    triton_tma: bool | None = None
    dq_mode: str = "auto"
    gluon_fwd: bool | None = None
    gluon_fwd_tiles: GluonFwdTiles | None = None
    gluon_bwd: bool | None = None
    gluon_bwd_tiles: GluonBwdTiles | None = None
    bwd_rotate: bool = True
    bwd_split_tail: bool = True
    bwd_piece_heads: int | None = None
    bwd_piece_add: str = "auto"
    bwd_order: Order = "auto"

    def __post_init__(self) -> None:
        for name, kind, env in (("triton_fwd_tiles", TritonTiles, "MAGI_TRITON_FWD_CFG"),
                                ("triton_dkdv_tiles", TritonTiles, "MAGI_TRITON_BWD_CFG"),
                                ("triton_dq_tiles", TritonTiles, "MAGI_TRITON_DQ_CFG"),
                                ("gluon_fwd_tiles", GluonFwdTiles, "MAGI_GLUON_FWD_CFG"),
                                ("gluon_bwd_tiles", GluonBwdTiles, "MAGI_GLUON_BWD_CFG")):
            object.__setattr__(self, name, _tiles(name, getattr(self, name), kind, env))
        for name in ("triton_tma", "gluon_fwd", "gluon_bwd"):
            _tristate(name, getattr(self, name))
        for name in ("bwd_rotate", "bwd_split_tail"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"KernelConfig.{name} must be True or False, got {getattr(self, name)!r}")
        if self.dq_mode not in DQ_MODES:
            raise ValueError(f"KernelConfig.dq_mode must be one of {DQ_MODES}, got {self.dq_mode!r}")
        if self.bwd_piece_add not in PIECE_ADDS:
            raise ValueError(f"KernelConfig.bwd_piece_add must be one of {PIECE_ADDS}, got {self.bwd_piece_add!r}")
        p = self.bwd_piece_heads
        if p is not None and (not _is_int(p) or p < 0):
            raise ValueError(f"KernelConfig.bwd_piece_heads must be None (auto), 0 (whole programs) or a positive "
                             f"divisor of the GQA group, got {p!r}")
        o = self.bwd_order
        if not (o in ORDERS or (_is_int(o) and o >= 1)):
            raise ValueError(f"KernelConfig.bwd_order must be 'auto', 'head', 'tile' or a positive band of heads, "
                             f"got {o!r}")
        if self.gluon_bwd is True and self.dq_mode != "auto":
            raise ValueError(f"KernelConfig: gluon_bwd=True conflicts with dq_mode={self.dq_mode!r} (a dQ mode "
                             "selects the Triton backward); set dq_mode='auto' or gluon_bwd=None")
        tiles = self.gluon_bwd_tiles
        if self.bwd_piece_add == "tma" and tiles is not None and tiles.block_n != 2 * tiles.block_m:
            raise ValueError(f"KernelConfig.bwd_piece_add='tma' stages a warpgroup's {tiles.block_n // 2} key rows in "
                             f"the {tiles.block_m}-row dQ buffer: it needs gluon_bwd_tiles.block_n = 2 * block_m, got "
                             f"{tiles}; use bwd_piece_add='atomic' or other tiles")
        # the JSON form, computed once: torch.compile reads it as a constant attribute
        object.__setattr__(self, "_json", json.dumps({f.name: getattr(self, f.name) for f in dataclasses.fields(self)},
                                                     sort_keys=True))

    def __hash__(self) -> int:  # plans are looked up by their config on every call: a cached string's hash
        return hash(self._json)  # type: ignore[attr-defined]

    # resolved per head dim ------------------------------------------------------------------

    def triton_fwd_for(self, d: int, tma: bool) -> TritonTiles:
        """Triton forward tiles at head dim ``d`` (``tma``: whether full blocks load through TMA)."""
        if self.triton_fwd_tiles is not None:
            return self.triton_fwd_tiles
        return (TUNED_TRITON_FWD_TMA if tma else TUNED_TRITON_FWD).get(d, TUNED_TRITON_FWD[d])

    def triton_dkdv_for(self, d: int) -> TritonTiles:
        """Triton dK/dV tiles at head dim ``d``."""
        return self.triton_dkdv_tiles or TUNED_TRITON_DKDV[d]

    def triton_dq_for(self, d: int) -> TritonTiles:
        """Triton dQ tiles at head dim ``d``."""
        return self.triton_dq_tiles or TUNED_TRITON_DQ[d]

    def gluon_fwd_for(self, d: int) -> GluonFwdTiles:
        """Gluon forward tiles at head dim ``d`` (one of ``TUNED_GLUON_FWD``)."""
        return self.gluon_fwd_tiles or TUNED_GLUON_FWD[d]

    def gluon_bwd_for(self, d: int) -> GluonBwdTiles:
        """Gluon backward tiles at head dim ``d`` (one of ``TUNED_GLUON_BWD``)."""
        return self.gluon_bwd_tiles or TUNED_GLUON_BWD[d]

    # serialisation (the torch.library ops take strings) -------------------------------------

    def to_json(self) -> str:
        """The config as a JSON string (the form the ``torch.library`` ops carry)."""
        return self._json  # type: ignore[attr-defined]

    @staticmethod
    def from_json(text: str) -> "KernelConfig":
        """The config ``to_json`` wrote ("" = the process default, ``default_kernel_config``)."""
        return _from_json(text)

    def describe(self) -> str:
        """The fields that differ from the defaults, one per line (``"defaults"`` if none)."""
        base = KernelConfig()
        diff = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(base, f.name)]
        return ", ".join(diff) if diff else "defaults"

    # the developer override -----------------------------------------------------------------

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "KernelConfig":
        """The defaults with the ``MAGI_TRITON_*`` / ``MAGI_GLUON_*`` overrides of ``environ``
        (``os.environ``) applied; a bad value is an error naming the variable and its values.
        Warns once about set switches of removed variants (``REMOVED_SWITCHES``)."""
        env = os.environ if environ is None else environ
        warn_removed_switches(env)
        kw: dict = {}
        for var, (name, kind) in _TILE_VARS.items():
            raw = env.get(var)
            if raw:
                try:
                    vals = tuple(int(x) for x in raw.split(","))
                except ValueError:
                    vals = ()
                if len(vals) != len(kind._fields):
                    raise ValueError(f"{var} must be '{_ENV_FIELDS[kind]}' ({len(kind._fields)} ints), got {raw!r}")
                kw[name] = vals
        for var, name in (("MAGI_TRITON_TMA", "triton_tma"), ("MAGI_GLUON_FWD", "gluon_fwd"),
                          ("MAGI_GLUON_BWD", "gluon_bwd")):
            kw[name] = {"auto": None, "1": True, "0": False}[_choice(env, var, "auto", ("auto", "0", "1"))]
        for var, name in (("MAGI_GLUON_BWD_ROTATE", "bwd_rotate"), ("MAGI_GLUON_BWD_SPLIT", "bwd_split_tail")):
            kw[name] = _choice(env, var, "1", ("0", "1")) == "1"
        kw["dq_mode"] = _choice(env, "MAGI_TRITON_DQ", "auto", DQ_MODES)
        kw["bwd_piece_add"] = _choice(env, "MAGI_GLUON_BWD_PIECE_ADD", "auto", PIECE_ADDS)
        raw = env.get("MAGI_GLUON_BWD_PIECES") or "auto"
        if raw != "auto" and not raw.isdigit():
            raise ValueError(f"MAGI_GLUON_BWD_PIECES must be 'auto', 0 or a divisor of the GQA group size, got {raw!r}")
        kw["bwd_piece_heads"] = None if raw == "auto" else int(raw)
        raw = env.get("MAGI_GLUON_BWD_ORDER") or "auto"
        if raw not in ORDERS and not (raw.isdigit() and int(raw) >= 1):
            raise ValueError(f"MAGI_GLUON_BWD_ORDER must be 'auto', 'head', 'tile' or a positive band size, got {raw!r}")
        kw["bwd_order"] = raw if raw in ORDERS else int(raw)
        try:
            return cls(**kw)
        except ValueError as e:
            raise ValueError(f"the MAGI_TRITON_* / MAGI_GLUON_* environment overrides are invalid: {e}") from None


_TILE_VARS: dict[str, tuple[str, type]] = {
    "MAGI_TRITON_FWD_CFG": ("triton_fwd_tiles", TritonTiles),
    "MAGI_TRITON_BWD_CFG": ("triton_dkdv_tiles", TritonTiles),
    "MAGI_TRITON_DQ_CFG": ("triton_dq_tiles", TritonTiles),
    "MAGI_GLUON_FWD_CFG": ("gluon_fwd_tiles", GluonFwdTiles),
    "MAGI_GLUON_BWD_CFG": ("gluon_bwd_tiles", GluonBwdTiles),
}
_ENV_FIELDS = {TritonTiles: "BM,BN,num_warps,num_stages", GluonFwdTiles: "BM,BN,STAGES,PARTS,PING",
               GluonBwdTiles: "BM,BN,STAGES"}
ENV_VARS: tuple[str, ...] = (*_TILE_VARS, "MAGI_TRITON_TMA", "MAGI_TRITON_DQ", "MAGI_GLUON_FWD", "MAGI_GLUON_BWD",
                             "MAGI_GLUON_BWD_ROTATE", "MAGI_GLUON_BWD_SPLIT", "MAGI_GLUON_BWD_PIECES",
                             "MAGI_GLUON_BWD_PIECE_ADD", "MAGI_GLUON_BWD_ORDER")


def _choice(env: Mapping[str, str], var: str, default: str, choices: tuple[str, ...]) -> str:
    raw = env.get(var) or default
    if raw not in choices:
        raise ValueError(f"{var} must be one of {', '.join(repr(c) for c in choices)}, got {raw!r}")
    return raw


# Switches of kernel variants that lost their A/B and were removed (issue 41; docs/design.md,
# "Variants measured and removed"): what the kernels do now, whatever the switch says.
REMOVED_SWITCHES: dict[str, str] = {
    "MAGI_GLUON_BWD_SCORES": "always key-major scores, S^T = K Q^T",
    "MAGI_GLUON_BWD_DQ_FIRST": "always dK issued before dQ",
    "MAGI_GLUON_BWD_DS_SYNC": "always the dS exchange without a release barrier, 'implied'",
    "MAGI_GLUON_BWD_WALK": "always the head walk, 'head'",
    "MAGI_GLUON_BWD_TRACE": "the per-program trace was removed",
    "MAGI_GLUON_FWD_JOIN": "always the softmax in both branches of the partial-block test",
    "MAGI_GLUON_FWD_ORDER": "always the KV-major order, 'kv'",
    "MAGI_GLUON_FWD_PERSIST": "always the persistent forward",
    "MAGI_TRITON_WS": "never a warp-specialised forward loop",
    "MAGI_TRITON_BWD_WS": "never warp-specialised backward loops",
    "MAGI_TRITON_BWD_FUSE": "always dK/dV and dQ in one launch where the layers allow it",
}


def warn_removed_switches(environ: Mapping[str, str] = os.environ) -> list[str]:
    """The ``REMOVED_SWITCHES`` set in ``environ``, with one warning naming them (none if none is
    set). They change nothing any more; the warning says so instead of ignoring them silently.
    Called when the environment is read (``KernelConfig.from_env``), never per launch."""
    found = [var for var in REMOVED_SWITCHES if environ.get(var)]
    if found:
        lines = "; ".join(f"{var} ({REMOVED_SWITCHES[var]})" for var in found)
        warnings.warn(f"these kernel switches no longer exist and are ignored: {lines}", UserWarning, stacklevel=3)
    return found


@functools.lru_cache(maxsize=1)
def default_kernel_config() -> KernelConfig:
    """The process-wide default: ``KernelConfig.from_env()``, read once at the first call (the
    kernels call it when a caller passes no config); later changes of the environment have no
    effect. Tests and sweeps that change the environment call ``default_kernel_config.cache_clear()``
    or, better, pass a ``KernelConfig``."""
    return KernelConfig.from_env()


@functools.lru_cache(maxsize=64)
def _from_json(text: str) -> KernelConfig:
    if not text:
        return default_kernel_config()
    return KernelConfig(**json.loads(text))


def _check_type(config) -> None:
    if not isinstance(config, KernelConfig):
        raise TypeError(f"kernel_config must be a magi_kernels.KernelConfig or None, got {type(config).__name__}")


def resolve_kernel_config(config: KernelConfig | None) -> KernelConfig:
    """``config``, or the process default for None; anything else is a TypeError naming the argument."""
    if config is None:
        return default_kernel_config()
    _check_type(config)
    return config


def config_json(config: KernelConfig | None) -> str:
    """What the ``torch.library`` ops carry: ``config.to_json()``, or "" for None (the op resolves
    the process default when it runs, outside any ``torch.compile`` trace)."""
    if config is None:
        return ""
    _check_type(config)
    return config.to_json()
