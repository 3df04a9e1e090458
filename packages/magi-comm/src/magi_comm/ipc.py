"""Intra-node GroupCast / GroupReduce over CUDA IPC (peer writes over NVLink), same API.

Every rank of the group registers one device arena; the arenas are mapped into every other
process with CUDA IPC. A cast is one fused launch per destination that gathers the rows it
sends from the local input and writes them straight to their final positions in the peer's
output (no staging copy, no NCCL); a sum-reduce is one launch per destination that atomically
adds fp32 partials into the peer's accumulator. Host barriers order the phases, so every call
synchronises the host with the device and returns finished; a device-side flag handshake would
let it overlap with compute, and is not written.

Needs: all ranks on one host, CUDA tensors, the native extension built with CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import native
from .index_plan import cast_index_plan, reduce_index_plan


def ipc_supported(device: torch.device | None = None) -> tuple[bool, str]:
    """``(ok, why)`` for the IPC path on ``device`` (default: the current CUDA device)."""
    if not native.WITH_CUDA:
        return False, native.REASON or "magi_comm._native was built without CUDA"
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    index = torch.cuda.current_device() if device is None or device.index is None else device.index
    ok, why = native.cuda_usable(index)  # were the kernels compiled for this GPU?
    return (True, "") if ok else (False, why)


class IpcArena:
    """One device buffer per rank, mapped into every rank of ``group`` (same host).

    Every arena has the size of the largest ``nbytes`` any rank asks for: peers write into
    each other's arenas, and with uneven shards one rank's output can outgrow another's need."""

    def __init__(self, group: dist.ProcessGroup, nbytes: int, device: torch.device):
        ok, why = ipc_supported(torch.device(device))
        if not ok:
            raise RuntimeError(f"CUDA IPC group collectives are unavailable: {why}; use the a2a backend")
        from torch.multiprocessing.reductions import reduce_tensor

        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        wanted: list = [None] * self.world
        dist.all_gather_object(wanted, int(nbytes), group=group)
        self.group, self.nbytes = group, max(wanted)
        self.local = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        handles: list = [None] * self.world
        dist.all_gather_object(handles, reduce_tensor(self.local), group=group)
        self.peers = [self.local if r == self.rank else fn(*args) for r, (fn, args) in enumerate(handles)]

    def view(self, rank: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        n = 1
        for s in shape:
            n *= s
        need = n * torch.empty((), dtype=dtype).element_size()
        if need > self.nbytes:
            raise ValueError(f"IPC arena of {self.nbytes} bytes is too small for {need}; create it larger")
        return self.peers[rank][:need].view(dtype).view(shape)

    def barrier(self) -> None:
        torch.cuda.synchronize(self.local.device)
        dist.barrier(group=self.group)


@dataclass(frozen=True)
class _PeerRows:
    """For each destination rank: my source rows and the rows they land on over there."""

    src: tuple[torch.Tensor, ...]
    dst: tuple[torch.Tensor, ...]
    out_rows: tuple[int, ...]  # rows of each rank's output


def _peer_rows(send_rows, send_counts, recv_rows, recv_counts, out_rows, group, device) -> _PeerRows:
    """Exchange every rank's receive layout once, then pair my send segments with it."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    layouts: list = [None] * world
    dist.all_gather_object(layouts, (recv_rows.tolist(), list(recv_counts), out_rows), group=group)
    src, dst = [], []
    s_off = 0
    for r in range(world):
        n = send_counts[r]
        rr, rc, _ = layouts[r]
        off = sum(rc[:rank])
        if rc[rank] != n:
            raise RuntimeError(f"rank {rank} sends {n} rows to rank {r}, which expects {rc[rank]}: plans differ")
        src.append(send_rows[s_off:s_off + n].to(device))
        dst.append(torch.tensor(rr[off:off + n], dtype=torch.int64, device=device))
        s_off += n
    return _PeerRows(tuple(src), tuple(dst), tuple(lay[2] for lay in layouts))


class IpcGroupCollectives:
    """GroupCast / GroupReduce(sum) with the split-level API of :mod:`magi_comm.group_collective`."""

    def __init__(self, group: dist.ProcessGroup, arena_bytes: int, device: torch.device):
        self.arena = IpcArena(group, arena_bytes, device)
        self.group, self.device = group, device
        self._plans: dict = {}

    def _rows(self, kind: str, plan_args: tuple) -> _PeerRows:
        key = (kind, plan_args)
        if key not in self._plans:
            world = self.arena.world
            p = (cast_index_plan if kind == "cast" else reduce_index_plan)(*plan_args, world)
            out_rows = sum(plan_args[2])  # output_split_sizes
            self._plans[key] = _peer_rows(p.send_rows, p.send_counts, p.recv_rows, p.recv_counts, out_rows,
                                          self.group, self.device)
        return self._plans[key]

    def group_cast(self, input, *, input_split_sizes, output_split_sizes, dst_indices, src_index):
        args = (tuple(input_split_sizes), tuple(tuple(d) for d in dst_indices), tuple(output_split_sizes), tuple(src_index))
        rows = self._rows("cast", args)
        x = input.contiguous()
        tail = tuple(x.shape[1:])
        self.arena.barrier()  # every arena is free to be written
        for r in range(self.arena.world):
            if rows.src[r].numel():
                native.copy_rows(x, self.arena.view(r, x.dtype, (rows.out_rows[r], *tail)), rows.src[r], rows.dst[r])
        self.arena.barrier()  # every write has landed
        return self.arena.view(self.arena.rank, x.dtype, (sum(output_split_sizes), *tail)).clone()

    def group_reduce(self, input, output, *, input_split_sizes, output_split_sizes, dst_index, src_indices):
        """Sum-reduce into ``output`` in place (fp32)."""
        if output.dtype != torch.float32:
            raise TypeError(f"IPC group_reduce accumulates in float32, got output dtype {output.dtype}")
        args = (tuple(input_split_sizes), tuple(dst_index), tuple(output_split_sizes), tuple(tuple(s) for s in src_indices))
        rows = self._rows("reduce", args)
        tail = tuple(output.shape[1:])
        acc = self.arena.view(self.arena.rank, torch.float32, tuple(output.shape))
        self.arena.barrier()  # peers are done reading my arena from the last collective
        acc.copy_(output)
        x = input.to(torch.float32).contiguous()
        self.arena.barrier()
        for r in range(self.arena.world):
            if rows.src[r].numel():
                native.add_rows_f32(x, self.arena.view(r, torch.float32, (rows.out_rows[r], *tail)), rows.src[r], rows.dst[r])
        self.arena.barrier()
        output.copy_(acc)
        return output
