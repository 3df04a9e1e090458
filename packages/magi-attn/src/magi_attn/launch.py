"""How magi's apps (``magi-attn run``, ``magi-train``) get their processes.

Two ways, one code path:

* launched: ``torchrun`` (or any launcher that sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
  ``MASTER_PORT``; ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE`` where there are several hosts) started
  this process; it joins the rendezvous from the environment, on one host or several;
* spawned: nothing launched it, so it starts ``nprocs`` local workers on this host itself and gives
  each the same environment a launcher would (loopback address, a free port).

Either way every worker runs ``fn(env, *args)`` and the caller gets rank 0's return value. A
spawned worker leaves through :func:`exit_worker` once its result is delivered.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing.util
import os
import pickle
import socket
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, NoReturn

import torch
import torch.distributed as dist

from magi_comm import DEFAULT_TIMEOUT_S

_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class WorkerEnv:
    """Where this process sits: its global rank, the world size and its place on its host."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    launched: bool  # True under torchrun or another launcher, False for a self-spawned worker

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _int_var(name: str, default: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None:
        if default is None:
            raise RuntimeError(f"environment variable {name} is not set; launch with torchrun or unset RANK")
        return default
    try:
        return int(raw)
    except ValueError:
        raise RuntimeError(f"environment variable {name}={raw!r} must be an integer (set by torchrun)") from None


def launched_env() -> WorkerEnv | None:
    """The layout a launcher gave this process, or None when nothing launched it (no ``RANK``)."""
    if "RANK" not in os.environ:
        return None
    missing = [v for v in _LAUNCH_VARS if v not in os.environ]
    if missing:
        raise RuntimeError(f"RANK is set but {', '.join(missing)} is not: launch with torchrun "
                           "(it sets all of them) or unset RANK to let the app start its own workers")
    world = _int_var("WORLD_SIZE")
    rank = _int_var("RANK")
    if not 0 <= rank < world:
        raise RuntimeError(f"RANK={rank} is outside WORLD_SIZE={world}")
    return WorkerEnv(rank, world, _int_var("LOCAL_RANK", rank), _int_var("LOCAL_WORLD_SIZE", world), launched=True)


def free_port() -> int:
    """A free TCP port on the loopback interface for MASTER_PORT."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_worker(env: WorkerEnv, use_cuda: bool, timeout_s: float | None = DEFAULT_TIMEOUT_S) -> torch.device:
    """Join the process group from the environment (NCCL with one GPU per local rank, else gloo)
    and return this worker's device. ``timeout_s`` becomes the group's own timeout, which is what
    ends a hang on NCCL (see :mod:`magi_comm.waiting`)."""
    if use_cuda:
        if torch.cuda.device_count() <= env.local_rank:
            raise RuntimeError(f"local rank {env.local_rank} needs GPU {env.local_rank}, but this host has "
                               f"{torch.cuda.device_count()}; start at most that many processes per host or use --cpu")
        torch.cuda.set_device(env.local_rank)
    else:  # share the host's cores between its workers
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // env.local_world_size))
    kw = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
    dist.init_process_group("nccl" if use_cuda else "gloo", rank=env.rank, world_size=env.world_size, **kw)
    return torch.device("cuda", env.local_rank) if use_cuda else torch.device("cpu")


def exit_worker(code: int = 0) -> NoReturn:
    """Leave a worker process whose work is delivered, skipping the interpreter's teardown.

    gloo's C++ threads can abort that teardown ("terminate called without an active exception",
    SIGABRT) after all work is done, so the process leaves with ``os._exit``. multiprocessing's
    exit hooks run first: they release the semaphores the process created (tqdm's write lock,
    for one), which ``os._exit`` alone would leave to a "leaked semaphore" warning.
    """
    if dist.is_initialized():
        dist.destroy_process_group()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    multiprocessing.util._exit_function()  # the atexit hook of multiprocessing: runs its finalizers
    os._exit(code)


def _spawned_worker(local_rank: int, nprocs: int, port: int, result_path: str, fn: Callable, args: tuple) -> None:
    # the environment torchrun would give a worker on one host; nothing of an outer launcher leaks in
    for var in [v for v in os.environ if v.startswith("TORCHELASTIC_")]:
        del os.environ[var]
    os.environ.update(RANK=str(local_rank), WORLD_SIZE=str(nprocs), LOCAL_RANK=str(local_rank),
                      LOCAL_WORLD_SIZE=str(nprocs), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    env = WorkerEnv(local_rank, nprocs, local_rank, nprocs, launched=False)
    try:
        result = fn(env, *args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if env.is_main:
        with open(result_path, "wb") as f:
            pickle.dump(result, f)
    exit_worker(0)


def run_workers(fn: Callable[..., Any], nprocs: int, *args: Any) -> Any:
    """Run ``fn(env, *args)`` on every rank and return rank 0's result (None on other ranks).

    Under a launcher this process is one rank and ``nprocs`` is ignored (the launcher decided the
    world size); otherwise ``nprocs`` local workers are spawned and joined, and a worker that
    raises makes this call raise (the others are terminated). ``fn`` must be importable (spawn)
    and calls :func:`init_worker` itself; its result must pickle.
    """
    env = launched_env()
    if env is not None:
        try:
            result = fn(env, *args)
            return result if env.is_main else None
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    import torch.multiprocessing as mp

    fd, result_path = tempfile.mkstemp(prefix="magi-result-", suffix=".pkl")
    os.close(fd)
    try:
        mp.start_processes(_spawned_worker, args=(nprocs, free_port(), result_path, fn, args), nprocs=nprocs,
                           start_method="spawn")
        with open(result_path, "rb") as f:
            return pickle.load(f)
    finally:
        os.unlink(result_path)
