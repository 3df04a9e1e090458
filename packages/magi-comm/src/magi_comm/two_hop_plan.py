"""Planning of the node-aware (two-hop) GroupCast / GroupReduce: pure host work.

Ranks are grouped into nodes of ``ranks_per_node`` consecutive ranks (:class:`NodeTopology`).
A cast takes two hops:

1. inter-node, among the ranks with the same local index (one per node): a split goes once to
   the *proxy* on each node that has any of its destinations (the proxy has the sender's local
   index);
2. intra-node, among the ranks of a node: each proxy forwards what it received (and its own
   rows) to the final destinations on its node.

A reduce is the exact transpose of the cast's plan. Here a rank's split-level arguments, plus
what its proxy peers send it in hop 1 (:func:`outgoing_meta` of theirs, exchanged by
:mod:`magi_comm.hierarchical`), become the row plans of both hops (:func:`two_hop_cast_plan`).
Nothing here communicates, so every rank's plan can be simulated in one process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import torch

from .index_plan import A2AIndexPlan, rows_of, split_offsets

MAX_RANKS_PER_NODE = 62  # local destinations of a split travel as bits of one int64


@dataclass(frozen=True)
class NodeTopology:
    """``world`` ranks in nodes of ``ranks_per_node`` consecutive ranks."""

    world: int
    ranks_per_node: int

    def __post_init__(self) -> None:
        if not 1 <= self.ranks_per_node <= MAX_RANKS_PER_NODE:
            raise ValueError(f"ranks_per_node must be in [1, {MAX_RANKS_PER_NODE}], got {self.ranks_per_node}")
        if self.world % self.ranks_per_node:
            raise ValueError(
                f"world size {self.world} is not a multiple of ranks_per_node={self.ranks_per_node}; "
                "pass the number of ranks on each node (every node must hold the same number)")

    @property
    def nodes(self) -> int:
        return self.world // self.ranks_per_node

    def node(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def local(self, rank: int) -> int:
        return rank % self.ranks_per_node

    def rank(self, node: int, local: int) -> int:
        return node * self.ranks_per_node + local


def default_ranks_per_node(world: int) -> int:
    """``LOCAL_WORLD_SIZE`` (set by torchrun) when it divides the world, else one node."""
    env = os.environ.get("LOCAL_WORLD_SIZE")
    if env and int(env) > 0 and world % int(env) == 0:
        return int(env)
    return world


Meta = list[tuple[int, int]]  # (rows, bitmask of local destinations) per split, in split order


def outgoing_meta(topo: NodeTopology, me: int, input_split_sizes: Sequence[int],
                  dst_indices: Sequence[Sequence[int]]) -> list[Meta]:
    """Per destination node: the splits this rank sends there in hop 1 (none to its own node)."""
    out: list[Meta] = [[] for _ in range(topo.nodes)]
    for size, dsts in zip(input_split_sizes, dst_indices):
        if not size:
            continue
        masks: dict[int, int] = {}
        for d in set(dsts):
            masks[topo.node(d)] = masks.get(topo.node(d), 0) | (1 << topo.local(d))
        for n, mask in sorted(masks.items()):
            if n != topo.node(me):
                out[n].append((size, mask))
    return out


@dataclass(frozen=True)
class TwoHopPlan:
    """Hop 1 gathers from the input; hop 2 gathers from ``cat(input, hop-1 rows)`` and lands at
    ``intra.recv_rows`` of the output."""

    inter: A2AIndexPlan
    intra: A2AIndexPlan

    @property
    def hop1_rows(self) -> int:
        return sum(self.inter.recv_counts)


def two_hop_cast_plan(
    topo: NodeTopology, me: int,
    input_split_sizes: Sequence[int], dst_indices: Sequence[Sequence[int]],
    output_split_sizes: Sequence[int], src_index: Sequence[int],
    incoming: Sequence[Meta],
) -> TwoHopPlan:
    """Row plan of one rank; ``incoming[n]`` is what the proxy-peer on node ``n`` sends here in
    hop 1 (its ``outgoing_meta`` for this rank's node). Pure: no communication."""
    my_node, L = topo.node(me), topo.ranks_per_node
    in_off = split_offsets(input_split_sizes)
    n_input = sum(input_split_sizes)
    # hop 1: each split once per remote node that holds any of its destinations
    send1, counts1 = [], []
    for n in range(topo.nodes):
        pairs = []
        if n != my_node:
            for o, size, dsts in zip(in_off, input_split_sizes, dst_indices):
                if size and any(topo.node(d) == n for d in dsts):
                    pairs.append((o, size))
        send1.extend(pairs)
        counts1.append(sum(s for _, s in pairs))
    recv_counts1 = [sum(s for s, _ in incoming[n]) if n != my_node else 0 for n in range(topo.nodes)]
    n1 = sum(recv_counts1)
    inter = A2AIndexPlan(rows_of(send1), tuple(counts1), torch.arange(n1, dtype=torch.long), tuple(recv_counts1))
    # hop 1 rows of every source node, with their local destination masks, at cat() positions
    hop1: dict[int, list[tuple[int, int, int]]] = {}
    pos = n_input
    for n in range(topo.nodes):
        if n == my_node:
            continue
        hop1[n] = []
        for size, mask in incoming[n]:
            hop1[n].append((pos, size, mask))
            pos += size
    # hop 2 to local q: for every source s with my local index (ascending), its rows for q
    send2, counts2 = [], []
    for q in range(L):
        dst = topo.rank(my_node, q)
        pairs = []
        for n in range(topo.nodes):
            if n == my_node:
                pairs += [(o, size) for o, size, dsts in zip(in_off, input_split_sizes, dst_indices)
                          if size and dst in dsts]
            else:
                pairs += [(p, size) for p, size, mask in hop1[n] if mask >> q & 1]
        send2.extend(pairs)
        counts2.append(sum(s for _, s in pairs))
    # a receiver gets from local p the rows of the sources (n, p), ascending, each in split order
    out_off = split_offsets(output_split_sizes)
    recv2, recv_counts2 = [], []
    for p in range(L):
        pairs = []
        for n in range(topo.nodes):
            src = topo.rank(n, p)
            pairs += [(o, size) for o, size, s in zip(out_off, output_split_sizes, src_index) if s == src and size]
        recv2.extend(pairs)
        recv_counts2.append(sum(s for _, s in pairs))
    intra = A2AIndexPlan(rows_of(send2), tuple(counts2), rows_of(recv2), tuple(recv_counts2))
    return TwoHopPlan(inter, intra)


def inter_node_rows(topo: NodeTopology, me: int, input_split_sizes: Sequence[int],
                    dst_indices: Sequence[Sequence[int]], dedup: bool) -> int:
    """Rows this rank puts on the inter-node network: once per remote destination *rank* for a
    flat all-to-all, once per remote destination *node* with the two-hop path."""
    total = 0
    for size, dsts in zip(input_split_sizes, dst_indices):
        remote = {d for d in dsts if topo.node(d) != topo.node(me)}
        total += size * (len({topo.node(d) for d in remote}) if dedup else len(remote))
    return total
