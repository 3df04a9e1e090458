"""Waiting on collectives with a deadline, so a failed or missing peer raises instead of hanging.

gloo honours ``Work.wait(timeout)`` on the host, so a CPU group raises once ``timeout_s`` has
passed. On NCCL a timed wait would block the host until the transfer finishes (and lose the
overlap with compute), so NCCL works are waited on the stream as usual and the process group's
own watchdog timeout (``init_process_group(timeout=...)``, which magi's launchers set from the
same value) ends a hang. Either way the error names the collective and says that a peer failed.
"""

from __future__ import annotations

import datetime
from typing import Iterable

import torch.distributed as dist

# Long enough for a slow rank's compute between two collectives (a 1M-token stage on a CPU), short
# enough that a dead peer is reported within minutes instead of torch's 30-minute default.
DEFAULT_TIMEOUT_S = 300.0


class PeerFailureError(RuntimeError):
    """A collective did not complete: a peer rank failed, exited, or did not join in time."""


def host_waits(group: dist.ProcessGroup | None) -> bool:
    """Whether waits on ``group`` block the host (gloo), so a deadline can be enforced there."""
    return dist.get_backend(group) == "gloo"


def describe_failure(what: str, group: dist.ProcessGroup | None, timeout_s: float | None, cause: BaseException) -> str:
    """The message every rank raises when a collective breaks."""
    try:
        where = f"rank {dist.get_rank(group)} of {dist.get_world_size(group)}"
    except Exception:  # noqa: BLE001 - the group may be gone; the message must still be built
        where = "this rank"
    deadline = f"within {timeout_s:g} s (DistAttnConfig.comm_timeout_s)" if timeout_s is not None else "in time"
    return (f"magi {what} failed on {where}: a peer rank failed, exited, or did not reach this collective "
            f"{deadline}. Look for the first error in the other ranks' logs. Cause: {cause}")


def wait_works(works: Iterable, group: dist.ProcessGroup | None, timeout_s: float | None, what: str) -> None:
    """Wait for ``works`` (async collective handles); raise :class:`PeerFailureError` when one breaks."""
    works = list(works)
    if not works:
        return
    timed = timeout_s is not None and host_waits(group)
    try:
        for w in works:
            if timed:
                w.wait(timeout=datetime.timedelta(seconds=timeout_s))
            else:
                w.wait()
    except PeerFailureError:
        raise
    except RuntimeError as e:  # gloo: "Operation timed out!", "Connection closed by peer", ...
        raise PeerFailureError(describe_failure(what, group, timeout_s, e)) from e
