"""Cross-rank agreement: before ranks exchange data under a plan, check that they hold the same one.

Every rank of a CP group must build its key from the same mask, sizes, heads, head dim and
config, and call :func:`calc_attn` with the same dtype, scale and softcap. If they do not, the
group collectives either crash inside the backend ("Received data size doesn't match") or, when
the transfer sizes happen to agree, silently mix rows of different plans. A fingerprint of a few
int64 fields, all-gathered once, turns that into one clear error, identical on every rank, that
names each field that differs.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from magi_comm import all_gather_rows


class PlanMismatchError(ValueError):
    """Ranks of one CP group disagree on a key or on the arguments of a call."""


@dataclass(frozen=True)
class Field:
    """One entry of a fingerprint: ``value`` is shown as it is, through ``labels``, or (for a
    digest of something large) only as agreeing / differing groups of ranks."""

    name: str
    value: int
    labels: tuple[str, ...] | None = None
    digest: bool = False


def digest(obj: Any) -> int:
    """A stable 56-bit digest of ``repr(obj)`` (fits an int64 on every backend)."""
    return int.from_bytes(hashlib.blake2b(repr(obj).encode(), digest_size=7).digest(), "little")


def labelled(name: str, value: str, labels: Sequence[str]) -> Field:
    """A field whose value is one of ``labels`` (shown by name in the error)."""
    labels = tuple(labels)
    return Field(name, labels.index(value) if value in labels else len(labels), labels + ("<other>",))


def config_fields(prefix: str, config: Any) -> list[Field]:
    """One digest field per dataclass field of ``config``, named ``prefix.field``."""
    return [Field(f"{prefix}.{f.name}", digest(getattr(config, f.name)), digest=True)
            for f in dataclasses.fields(config)]


def group_field(group: dist.ProcessGroup) -> Field:
    """The global ranks of ``group``: ranks that pass different groups of one size disagree here."""
    return Field("cp_group (global ranks)", digest(tuple(dist.get_process_group_ranks(group))), digest=True)


def _show(field: Field, value: int) -> str:
    if field.labels is not None:
        return field.labels[min(value, len(field.labels) - 1)]
    return str(value)


def _describe(field: Field, column: list[int]) -> str:
    if not field.digest:
        return f"{field.name}: " + ", ".join(f"rank {r}: {_show(field, v)}" for r, v in enumerate(column))
    groups: dict[int, list[int]] = {}
    for r, v in enumerate(column):
        groups.setdefault(v, []).append(r)
    parts = [f"ranks {rs}" if len(rs) > 1 else f"rank {rs[0]}" for rs in groups.values()]
    return f"{field.name}: differs ({' / '.join(parts)} hold different values)"


def check_agreement(fields: Sequence[Field], group: dist.ProcessGroup, timeout_s: float | None, what: str) -> None:
    """All-gather ``fields`` over ``group`` and raise :class:`PlanMismatchError` on every rank,
    with the same message, when any field differs between ranks. ``what`` names the check."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None
    mine = torch.tensor([[f.value for f in fields]], dtype=torch.int64, device=device)
    table = all_gather_rows(mine, group, timeout_s, f"check of the {what}").cpu().tolist()  # [world, fields]
    diffs = [_describe(f, [row[i] for row in table]) for i, f in enumerate(fields)
             if any(row[i] != table[0][i] for row in table)]
    if diffs:
        raise PlanMismatchError(
            f"magi: the ranks of the CP group disagree on the {what}; every rank must pass the same values.\n  "
            + "\n  ".join(diffs))
