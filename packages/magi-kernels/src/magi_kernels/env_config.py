"""Kernel switches from the environment (tuning and A/B runs): tile-config overrides
(``MAGI_TRITON_*_CFG``, ``MAGI_GLUON_*_CFG``) and named choices (``MAGI_GLUON_FWD_ORDER``, ...)."""

from __future__ import annotations

import os
from collections.abc import Callable


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
