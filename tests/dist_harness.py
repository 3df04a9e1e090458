"""Run a function on N CPU processes with gloo and surface every worker's exception."""

from __future__ import annotations

import os
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp

from magi_attn.launch import exit_worker, free_port


def _worker(rank: int, world: int, port: int, fn, args, errors) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        fn(rank, world, *args)
    except BaseException:  # noqa: BLE001 - forwarded to the parent
        errors.put((rank, traceback.format_exc()))
    finally:  # failures were reported above
        exit_worker(0)


def run_distributed(fn, world: int, *args, timeout: float = 600.0) -> None:
    """Spawn ``world`` processes running ``fn(rank, world, *args)`` (fn must be importable)."""
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    pc = mp.start_processes(_worker, args=(world, free_port(), fn, args, errors), nprocs=world,
                            join=False, start_method="spawn")
    import time

    deadline = time.monotonic() + timeout
    while not pc.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in pc.processes:
                p.kill()
            raise TimeoutError(f"distributed run with {world} ranks did not finish in {timeout}s (hang?)")
    msgs = []
    while not errors.empty():
        msgs.append(errors.get())
    if msgs:
        # every rank's traceback: the first rank's error is often only "peer closed", a
        # consequence of another rank's failure
        msgs.sort()
        detail = "\n".join(f"--- rank {rank} ---\n{tb}" for rank, tb in msgs)
        raise AssertionError(f"rank {msgs[0][0]} failed ({len(msgs)} rank(s) failed):\n{detail}")
