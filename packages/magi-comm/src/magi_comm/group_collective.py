"""GroupCast and GroupReduce over ``torch.distributed.all_to_all_single``.

Works on gloo (CPU) and NCCL (GPU). The split-level arguments are turned once into row index
tensors (:mod:`magi_comm.index_plan`: a gather before the all-to-all, a scatter or
scatter-reduce after it), cached per argument set; this module moves the rows.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from magi_kernels import on_device

from . import native
from .index_plan import A2AIndexPlan, cast_index_plan, reduce_index_plan
from .ordered_add import add_rows
from .waiting import DEFAULT_TIMEOUT_S, wait_works

REDUCE_OPS = ("sum", "lse")

# Bytes this process put on / took off the wire in group collectives (self-copies excluded), and
# of those, what the two-hop path sent between nodes; benchmarks compare them with the plan.
# Reset with ``COMM_STATS.update(sent=0, received=0, inter_node_sent=0)``.
COMM_STATS = {"sent": 0, "received": 0, "inter_node_sent": 0}


def _world_and_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _wire_view(t: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """gloo rejects bf16 in all-to-all: ship 16-bit floats as raw bytes (exact; no arithmetic
    happens on the wire, reductions run after the exchange)."""
    if t.dtype in (torch.float16, torch.bfloat16) and dist.get_backend(group) == "gloo":
        return t.view(torch.uint8)
    return t


class PendingCollective:
    """Handle of an asynchronous group collective; ``wait()`` finishes it and returns the output.

    ``wait()`` raises :class:`magi_comm.PeerFailureError` when a peer fails or does not join
    within ``timeout_s`` (see :mod:`magi_comm.waiting`)."""

    def __init__(self, works: list, finish, group: dist.ProcessGroup | None = None,
                 timeout_s: float | None = DEFAULT_TIMEOUT_S, what: str = "collective"):
        self._works, self._finish, self._result = works, finish, None
        self._group, self._timeout_s, self._what = group, timeout_s, what

    @classmethod
    def finished(cls, result) -> "PendingCollective":
        """A handle of a collective that already ran (synchronous transports); ``wait()`` returns ``result``."""
        return cls([], lambda: result)

    def wait(self):
        if self._finish is not None:
            wait_works(self._works, self._group, self._timeout_s, self._what)
            self._result = self._finish()
            self._finish = None
        return self._result


def exchange_rows(
    tensors: list[torch.Tensor], plan: A2AIndexPlan, group: dist.ProcessGroup | None, world: int
) -> tuple[list[torch.Tensor], list]:
    """Gather send rows of each tensor and start the all-to-alls; returns receive buffers."""
    recv_total = sum(plan.recv_counts)
    bufs, works = [], []
    me = dist.get_rank(group) if world > 1 else 0
    for t in tensors:
        row_bytes = t[0].numel() * t.element_size() if t.shape[0] else 0
        COMM_STATS["sent"] += (sum(plan.send_counts) - plan.send_counts[me]) * row_bytes
        COMM_STATS["received"] += (recv_total - plan.recv_counts[me]) * row_bytes
        send = native.range_gather(t, plan.send_rows)
        recv = t.new_empty((recv_total, *t.shape[1:]))
        if world == 1:
            recv.copy_(send)
        else:
            w = dist.all_to_all_single(
                _wire_view(recv, group), _wire_view(send.contiguous(), group),
                output_split_sizes=list(plan.recv_counts), input_split_sizes=list(plan.send_counts),
                group=group, async_op=True,
            )
            works.append(w)
        bufs.append(recv)
    return bufs, works


def group_cast(
    input: torch.Tensor,
    *,
    input_split_sizes: Sequence[int],
    output_split_sizes: Sequence[int],
    dst_indices: Sequence[Sequence[int]],
    src_index: Sequence[int],
    group: dist.ProcessGroup | None = None,
    output: torch.Tensor | None = None,
    async_op: bool = False,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
):
    """Copy input split ``i`` to every rank in ``dst_indices[i]``; output split ``j`` comes from
    rank ``src_index[j]`` (stable order per source). Dim 0 is split; other dims must match.

    Returns the output tensor (written in place when ``output`` is given), or a
    :class:`PendingCollective` with ``async_op=True``. A peer that fails or does not join within
    ``timeout_s`` raises :class:`magi_comm.PeerFailureError` (None: wait forever).
    """
    world, _ = _world_and_rank(group)
    if sum(input_split_sizes) != input.shape[0]:
        raise ValueError(f"input_split_sizes sum to {sum(input_split_sizes)} but input has {input.shape[0]} rows")
    plan = cast_index_plan(
        tuple(int(x) for x in input_split_sizes), tuple(tuple(int(r) for r in d) for d in dst_indices),
        tuple(int(x) for x in output_split_sizes), tuple(int(x) for x in src_index), world,
    )
    n_out = sum(output_split_sizes)
    if output is None:
        output = input.new_zeros((n_out, *input.shape[1:]))
    elif output.shape != (n_out, *input.shape[1:]):
        raise ValueError(f"output must have shape {(n_out, *input.shape[1:])}, got {tuple(output.shape)}")
    (recv,), works = exchange_rows([input], plan, group, world)

    def finish():
        output.index_copy_(0, on_device(plan.recv_rows, output.device), recv)
        return output

    pending = PendingCollective(works, finish, group, timeout_s, "GroupCast")
    return pending if async_op else pending.wait()


def lse_scatter_merge(
    out: torch.Tensor, lse: torch.Tensor, rows: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor
) -> None:
    """In place: merge partial results ``part_*`` into rows ``rows`` of ``out``/``lse`` with the
    online-softmax rule; a row may receive several partials."""
    acc = torch.float64 if out.dtype == torch.float64 else torch.float32
    lse_acc, part_lse = lse.to(acc), part_lse.to(acc)
    m = lse_acc.clone().index_reduce_(0, rows, part_lse, "amax", include_self=True)
    safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w_self = torch.exp(lse_acc - safe)
    w_part = torch.exp(part_lse - safe.index_select(0, rows))
    den = w_self.clone().index_add_(0, rows, w_part)
    num = (out.to(acc) * w_self.unsqueeze(-1)).index_add_(0, rows, part_out.to(acc) * w_part.unsqueeze(-1))
    ok = den > 0
    out.copy_(torch.where(ok.unsqueeze(-1), num / torch.where(ok, den, 1).unsqueeze(-1), 0).to(out.dtype))
    lse.copy_(torch.where(ok, safe + torch.log(torch.where(ok, den, 1)), float("-inf")).to(lse.dtype))


def group_reduce(
    input: torch.Tensor,
    output: torch.Tensor,
    *,
    input_split_sizes: Sequence[int],
    output_split_sizes: Sequence[int],
    dst_index: Sequence[int],
    src_indices: Sequence[Sequence[int]],
    group: dist.ProcessGroup | None = None,
    op: str = "sum",
    input_lse: torch.Tensor | None = None,
    output_lse: torch.Tensor | None = None,
    async_op: bool = False,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
    ordered: bool = False,
):
    """Send input split ``i`` to rank ``dst_index[i]``; output split ``j`` is reduced *in place*
    (accumulated onto ``output``) from the partials of every rank in ``src_indices[j]``.

    ``op="sum"`` adds; ``op="lse"`` merges partial attention outputs with their LSEs
    (``input_lse``/``output_lse`` ``[rows, heads]``; ``output_lse`` is updated in place too).
    Returns ``output`` or a :class:`PendingCollective`; ``timeout_s`` as in :func:`group_cast`.
    ``ordered``: sums in a fixed order (:func:`magi_comm.add_rows`), bitwise reproducible on GPU.
    """
    if op not in REDUCE_OPS:
        raise ValueError(f"op must be one of {REDUCE_OPS}, got {op!r}")
    if op == "lse" and (input_lse is None or output_lse is None):
        raise ValueError("op='lse' needs input_lse and output_lse")
    world, _ = _world_and_rank(group)
    if sum(input_split_sizes) != input.shape[0]:
        raise ValueError(f"input_split_sizes sum to {sum(input_split_sizes)} but input has {input.shape[0]} rows")
    if sum(output_split_sizes) != output.shape[0]:
        raise ValueError(f"output_split_sizes sum to {sum(output_split_sizes)} but output has {output.shape[0]} rows")
    plan = reduce_index_plan(
        tuple(int(x) for x in input_split_sizes), tuple(int(x) for x in dst_index),
        tuple(int(x) for x in output_split_sizes), tuple(tuple(int(r) for r in s) for s in src_indices), world,
    )
    tensors = [input] if op == "sum" else [input, input_lse]
    bufs, works = exchange_rows(tensors, plan, group, world)

    def finish():
        rows = on_device(plan.recv_rows, output.device)
        if op == "sum":
            add_rows(output, rows, bufs[0], ordered=ordered, rows_host=plan.recv_rows)
        else:
            lse_scatter_merge(output, output_lse, rows, bufs[0], bufs[1])
        return output

    pending = PendingCollective(works, finish, group, timeout_s, "GroupReduce")
    return pending if async_op else pending.wait()


def all_gather_rows(x: torch.Tensor, group: dist.ProcessGroup | None = None,
                    timeout_s: float | None = DEFAULT_TIMEOUT_S, what: str = "all-gather") -> torch.Tensor:
    """Concatenate equally sized ``x`` of every rank along dim 0, in rank order (``timeout_s`` as
    in :func:`group_cast`; ``what`` names the collective in its error)."""
    world, _ = _world_and_rank(group)
    if world == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    work = dist.all_gather([_wire_view(p, group) for p in parts], _wire_view(x, group), group=group, async_op=True)
    wait_works([work], group, timeout_s, what)
    return torch.cat(parts, dim=0)
