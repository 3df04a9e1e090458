"""Helpers for jobs that spawn one process per rank on this host."""

from __future__ import annotations

import os
import socket
import sys

import torch.distributed as dist


def free_port() -> int:
    """A free TCP port on the loopback interface for MASTER_PORT."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def finish_worker() -> None:
    """Tear down the process group and leave the worker process right away.

    gloo's (and DeviceMesh's) C++ threads can abort the interpreter's teardown with
    "terminate called without an active exception" after all work is done; a spawned worker
    whose results are already delivered exits with 0 instead.
    """
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
