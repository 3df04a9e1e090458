"""Row accumulation in a fixed order: the deterministic form of ``out.index_add_(0, rows, src)``.

A GroupReduce adds the partials it receives (dK/dV of the ranks that used this rank's K/V) into
the output rows they belong to; a row appears once per rank that sent it. On CUDA,
``index_add_`` adds repeated rows with atomics, so the order of the fp32 additions (and the last
bits of the result) changes from run to run. The ordered form splits the received rows into
*layers* of distinct rows, layer j holding every row's j-th contribution in buffer order (the
buffer is grouped by source rank, in rank order), and adds layer 0, then layer 1, ...: each
element is added once per layer, so no two additions race and the sum order is fixed. It costs
one gather and one add per layer (at most the number of source ranks); the layers are computed
once per plan on the host.

``torch.use_deterministic_algorithms(True)`` makes torch's own ``index_add_`` deterministic too;
``ordered=True`` asks for it without changing the global mode (``DistAttnConfig.deterministic``).
"""

from __future__ import annotations

import torch
from magi_kernels import on_device, per_tensor

__all__ = ["add_rows", "row_layers"]


def row_layers(rows: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``[(positions, rows[positions]), ...]`` per layer of a host index tensor ``rows``: layer
    j holds the j-th occurrence of each row (positions ascending), so every layer's rows are
    distinct and every position is in exactly one layer."""
    rows = rows.to("cpu", torch.long)
    n = rows.numel()
    if n == 0:
        return []
    order = torch.argsort(rows, stable=True)  # equal rows keep their buffer order
    srt = rows[order]
    starts = torch.ones(n, dtype=torch.bool)
    starts[1:] = srt[1:] != srt[:-1]
    idx = torch.arange(n)
    run_start = torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), 0).values
    occurrence = torch.empty(n, dtype=torch.long)
    occurrence[order] = idx - run_start
    layers = []
    for j in range(int(occurrence.max()) + 1):
        pos = torch.nonzero(occurrence == j).flatten()
        layers.append((pos, rows[pos]))
    return layers


def add_rows(out: torch.Tensor, rows: torch.Tensor, src: torch.Tensor, *, ordered: bool = False,
             rows_host: torch.Tensor | None = None) -> torch.Tensor:
    """``out[rows[i]] += src[i]`` for every i, in place; returns ``out``.

    ``ordered``: add repeated rows in a fixed order (bitwise reproducible on GPU); needs the
    host copy of the indices, ``rows_host`` (plans keep theirs on the CPU), whose layers are
    computed once per tensor."""
    src = src.to(out.dtype)
    if not ordered:
        return out.index_add_(0, rows, src)
    if rows_host is None:
        raise ValueError("add_rows(ordered=True) needs rows_host, the indices on the host")
    layers = per_tensor(rows_host, "row layers", lambda: row_layers(rows_host))
    for pos, layer_rows in layers:
        pos_d, rows_d = on_device(pos, out.device), on_device(layer_rows, out.device)
        out.index_add_(0, rows_d, src.index_select(0, pos_d))  # distinct rows: one add per element
    return out
