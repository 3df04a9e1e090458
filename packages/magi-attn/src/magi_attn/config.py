"""Typed, validated configuration of distributed attention."""

from __future__ import annotations

from dataclasses import dataclass, field

from magi_comm import COLLECTIVE_KINDS, DEFAULT_TIMEOUT_S
from magi_kernels import BACKENDS
from magi_solver import DispatchConfig, OverlapConfig

__all__ = ["COMM_BACKENDS", "DistAttnConfig", "DispatchConfig", "OverlapConfig"]

COMM_BACKENDS = COLLECTIVE_KINDS  # the transports magi_comm.make_group_collective builds


@dataclass(frozen=True)
class DistAttnConfig:
    """Everything that shapes a distributed attention plan and its execution.

    Args:
        dispatch: chunking and load balancing (:class:`magi_solver.DispatchConfig`).
        overlap: multi-stage overlap of GroupCast with attention (:class:`magi_solver.OverlapConfig`).
        kernel_backend: ``"auto"``, ``"torch"`` or ``"triton"`` (see ``magi_kernels``).
        comm_backend: ``"a2a"`` (torch.distributed all_to_all_single: gloo or NCCL, any
            topology), ``"ipc"`` (CUDA IPC peer writes inside one host; needs the native
            extension built with CUDA) or ``"hier"`` (node-aware two hops: each KV row crosses
            the inter-node network once per destination node, then is forwarded inside it;
            dK/dV partials are pre-reduced per node).
        ranks_per_node: ranks on each node for ``"hier"``; None = ``LOCAL_WORLD_SIZE`` (torchrun)
            or one node.
        comm_timeout_s: seconds a rank waits in one of magi's collectives (the plan agreement
            check, GroupCast/GroupReduce, dispatch's all-gathers) before it raises
            :class:`magi_comm.PeerFailureError` saying that a peer failed or did not join. gloo
            enforces it on the host; on NCCL the process group's own timeout
            (``init_process_group(timeout=...)``) ends a hang, and magi's launchers set that to
            this value. None waits forever.
        deterministic: bitwise-identical outputs and gradients from run to run on the GPU: the
            backward's dK/dV GroupReduce sums the ranks' partials in a fixed order
            (:func:`magi_comm.add_rows`; with ``comm_backend="ipc"`` the reduce runs over
            all-to-all) and the kernels take their deterministic backward (the Triton backward
            with separate dQ programs, as under ``torch.use_deterministic_algorithms(True)``,
            which also turns this on). Costs are measured in the README's deterministic section.
    """

    dispatch: DispatchConfig = field(default_factory=DispatchConfig)
    overlap: OverlapConfig = field(default_factory=OverlapConfig)
    kernel_backend: str = "auto"
    comm_backend: str = "a2a"
    ranks_per_node: int | None = None
    comm_timeout_s: float | None = DEFAULT_TIMEOUT_S
    deterministic: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.deterministic, bool):
            raise TypeError(f"DistAttnConfig.deterministic must be a bool, got {self.deterministic!r}")
        if not isinstance(self.dispatch, DispatchConfig):
            raise TypeError(f"DistAttnConfig.dispatch must be a DispatchConfig, got {type(self.dispatch).__name__}")
        if not isinstance(self.overlap, OverlapConfig):
            raise TypeError(f"DistAttnConfig.overlap must be an OverlapConfig, got {type(self.overlap).__name__}")
        if self.kernel_backend not in BACKENDS:
            raise ValueError(f"DistAttnConfig.kernel_backend must be one of {BACKENDS}, got {self.kernel_backend!r}")
        if self.comm_backend not in COMM_BACKENDS:
            raise ValueError(f"DistAttnConfig.comm_backend must be one of {COMM_BACKENDS}, got {self.comm_backend!r}")
        if self.ranks_per_node is not None and (not isinstance(self.ranks_per_node, int) or self.ranks_per_node < 1):
            raise ValueError(f"DistAttnConfig.ranks_per_node must be a positive int or None, got {self.ranks_per_node!r}")
        t = self.comm_timeout_s
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf")):
            raise ValueError(f"DistAttnConfig.comm_timeout_s must be a finite number of seconds > 0 or None, got {t!r}")
