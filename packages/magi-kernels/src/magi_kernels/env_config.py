"""Kernel switches from the environment (tuning and A/B runs): tile-config overrides
(``MAGI_TRITON_*_CFG``, ``MAGI_GLUON_*_CFG``) and named choices (``MAGI_GLUON_BWD_PIECES``, ...),
and a warning for the switches of removed kernel variants."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping

# Switches of kernel variants that lost their A/B and were removed (the decisions are in
# docs/design.md): what the kernels do now, whatever the switch says.
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


def env_config(var: str, default: tuple[int, ...], fields: str,
               valid: Callable[[tuple[int, ...]], bool] = lambda vals: True, rule: str = "") -> tuple[int, ...]:
    """``default``, or the comma-separated ints of environment variable ``var`` (tuning runs);
    ``fields`` names them ("BM,BN,STAGES"), ``valid``/``rule`` add a check and its wording."""
    raw = os.environ.get(var)
    if not raw:
        return default
    try:
        vals = tuple(int(x) for x in raw.split(","))
    except ValueError:
        vals = ()
    if len(vals) != len(fields.split(",")) or not valid(vals):
        raise ValueError(f"{var} must be '{fields}'{rule}, got {raw!r}")
    return vals


def env_choice(var: str, default: str, choices: tuple[str, ...]) -> str:
    """The value of environment variable ``var`` (``default`` when unset or empty), which must
    be one of ``choices``; anything else is an error naming the variable and the choices."""
    raw = os.environ.get(var) or default
    if raw not in choices:
        raise ValueError(f"{var} must be one of {', '.join(repr(c) for c in choices)}, got {raw!r}")
    return raw


def warn_removed_switches(environ: Mapping[str, str] = os.environ) -> list[str]:
    """The ``REMOVED_SWITCHES`` set in ``environ``, with one warning naming them (none if none is
    set). They change nothing any more; the warning says so instead of ignoring them silently.
    Called once, when the Triton backend is imported, never per launch."""
    found = [var for var in REMOVED_SWITCHES if environ.get(var)]
    if found:
        lines = "; ".join(f"{var} ({REMOVED_SWITCHES[var]})" for var in found)
        warnings.warn(f"these kernel switches no longer exist and are ignored: {lines}", UserWarning, stacklevel=2)
    return found
