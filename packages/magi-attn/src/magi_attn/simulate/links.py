"""Link model: how long a collective takes from the bytes each rank sends to and receives from each peer.

Two link classes: NVLink between the GPUs of one node, InfiniBand between nodes. A collective
over the group is one step (NCCL's grouped send/recv of ``all_to_all_single``): it starts when
every rank has issued it, and rank r is done after

    latency + max over link classes of max(r's bytes out, r's bytes in, each source's bytes out) / bandwidth

(links are full duplex, NVLink and InfiniBand run at once, a rank cannot receive a source's rows
faster than that source puts all of its rows on the wire). Peer counts, congestion in the fabric
and NCCL's protocol switches are left out; the parameters are the effective rates below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class LinkModel:
    """Per-GPU link bandwidths (bytes/s, one direction) and per-collective latencies.

    Defaults, H100 SXM in 8-GPU nodes (DGX/HGX H100):
      * NVLink 4: 18 links x 25 GB/s = 450 GB/s per direction (900 GB/s bidirectional, NVIDIA H100
        datasheet); NCCL's all-to-all reaches about 80 % of it (assumed): 360 GB/s.
      * InfiniBand: one ConnectX-7 NDR 400 Gb/s = 50 GB/s per GPU per direction (DGX H100 user
        guide: eight 400 Gb/s ports for eight GPUs); about 80 % effective (assumed): 40 GB/s.
      * latency: 10 us for a collective inside one node, 25 us once it spans nodes (the order of
        nccl-tests small-message all-to-all times; assumed).
    """

    ranks_per_node: int = 8
    nvlink_bytes_per_s: float = 0.8 * 450e9
    ib_bytes_per_s: float = 0.8 * 50e9
    nvlink_latency_s: float = 10e-6
    ib_latency_s: float = 25e-6

    def __post_init__(self) -> None:
        if not isinstance(self.ranks_per_node, int) or self.ranks_per_node < 1:
            raise ValueError(f"LinkModel.ranks_per_node must be a positive int, got {self.ranks_per_node!r}")
        for name in ("nvlink_bytes_per_s", "ib_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"LinkModel.{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("nvlink_latency_s", "ib_latency_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"LinkModel.{name} must be >= 0, got {getattr(self, name)!r}")

    def node(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def collective_s(self, traffic: Sequence[dict[int, float]]) -> list[float]:
        """Per rank, the seconds of one collective; ``traffic[r][p]``: bytes rank r sends to p.

        A rank with no bytes in or out still takes part (calc_attn issues every stage's
        collective on every rank) and pays the latency."""
        n = len(traffic)
        out_b = [[0.0, 0.0] for _ in range(n)]  # [nvlink, ib] bytes sent
        in_b = [[0.0, 0.0] for _ in range(n)]
        sources: list[set[int]] = [set() for _ in range(n)]
        for src, row in enumerate(traffic):
            for dst, nbytes in row.items():
                if dst == src or nbytes <= 0:
                    continue
                cls = int(self.node(src) != self.node(dst))
                out_b[src][cls] += nbytes
                in_b[dst][cls] += nbytes
                sources[dst].add(src)
        bw = (self.nvlink_bytes_per_s, self.ib_bytes_per_s)
        send_s = [max(o[c] / bw[c] for c in (0, 1)) for o in out_b]
        spans_nodes = self.node(n - 1) != self.node(0)
        latency = self.ib_latency_s if spans_nodes else self.nvlink_latency_s
        times = []
        for r in range(n):
            own = max(max(out_b[r][c], in_b[r][c]) / bw[c] for c in (0, 1))
            wait_src = max((send_s[s] for s in sources[r]), default=0.0)
            times.append(latency + max(own, wait_src))
        return times
