"""Node-aware GroupCast / GroupReduce: every row crosses the inter-node network once per
destination *node*, then is forwarded inside the node (RDMA dedup, as DeepEP does).

The routes and per-hop row plans are computed by :mod:`magi_comm.two_hop_plan`; this module
creates the intra- and inter-node process groups (once per group and node size, cached),
exchanges the small routing metadata a plan needs, and moves the rows. A reduce pre-reduces
partials at the proxy of their node (sum, or the LSE merge of partial attention outputs), then
each reduced row crosses the network once. The transport of each hop is
``torch.distributed.all_to_all_single`` (NCCL over NVLink / InfiniBand on GPUs, gloo on CPUs), so
the path runs and is tested anywhere; a native NVSHMEM transport would replace hop 1 with
device-initiated puts.

Hop 2 of a proxy needs to know, for every split it receives in hop 1, which local ranks want it.
That metadata is exchanged with two small all-to-alls when a plan is built; a caller that passes
the same ``plan_key`` on every rank for the same collective gets the plan cached.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable

import torch
import torch.distributed as dist

from magi_kernels import on_device, per_tensor

from .group_collective import COMM_STATS, REDUCE_OPS, PendingCollective, exchange_rows, lse_scatter_merge
from .index_plan import A2AIndexPlan, check_ranks
from .ordered_add import add_rows
from .two_hop_plan import Meta, NodeTopology, TwoHopPlan, default_ranks_per_node, outgoing_meta, two_hop_cast_plan
from .waiting import DEFAULT_TIMEOUT_S, wait_works

_SHARED: dict[tuple, "HierarchicalCollectives"] = {}


def clear_shared_collectives() -> None:
    """Drop the cached two-hop collectives (and the process groups they hold)."""
    _SHARED.clear()


def shared_collectives(group: dist.ProcessGroup | None, ranks_per_node: int | None,
                       node_groups: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None) -> "HierarchicalCollectives":
    """One instance (one pair of subgroups) per (group, ranks_per_node, node_groups) in this
    process; the first call is collective."""
    key = (id(group) if group is not None else None, ranks_per_node,
           None if node_groups is None else tuple(id(g) for g in node_groups))
    if key not in _SHARED:
        _SHARED[key] = HierarchicalCollectives(group, ranks_per_node, node_groups=node_groups)
    return _SHARED[key]


class HierarchicalCollectives:
    """GroupCast / GroupReduce over the two-hop path, same arguments as
    :func:`magi_comm.group_cast` / :func:`magi_comm.group_reduce` (plus ``plan_key``).

    Building it creates the intra-node and inter-node process groups: every rank of ``group``
    must construct it at the same time. ``node_groups``: ``(intra, inter)`` groups that exist
    already (e.g. the two dims of a ``DeviceMesh``), used instead: ``intra`` holds this rank's
    node, ``inter`` the ranks with its local index on every node, both as the topology places
    them (group rank ``r`` on node ``r // ranks_per_node``).
    """

    def __init__(self, group: dist.ProcessGroup | None = None, ranks_per_node: int | None = None, cache_size: int = 64,
                 *, node_groups: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None):
        if not dist.is_initialized():
            raise RuntimeError("HierarchicalCollectives needs an initialised torch.distributed process group")
        world = dist.get_world_size(group)
        self.topo = NodeTopology(world, ranks_per_node or default_ranks_per_node(world))
        self.me = dist.get_rank(group)
        ranks = [dist.get_global_rank(group, r) for r in range(world)] if group is not None else list(range(world))
        t = self.topo
        intra_ranks = [ranks[t.rank(t.node(self.me), l)] for l in range(t.ranks_per_node)]
        inter_ranks = [ranks[t.rank(n, t.local(self.me))] for n in range(t.nodes)]
        if node_groups is not None:
            self.intra, self.inter = node_groups
            for name, g, want in (("intra", self.intra, intra_ranks), ("inter", self.inter, inter_ranks)):
                if dist.get_process_group_ranks(g) != want:
                    raise ValueError(f"node_groups: the {name}-node group holds global ranks "
                                     f"{dist.get_process_group_ranks(g)}, but with ranks_per_node={t.ranks_per_node} "
                                     f"this rank's {name}-node ranks are {want}")
        else:
            self.intra = self.inter = None
            for n in range(t.nodes):  # every rank creates every group, in the same order
                g = dist.new_group([ranks[t.rank(n, l)] for l in range(t.ranks_per_node)])
                if n == t.node(self.me):
                    self.intra = g
            for l in range(t.ranks_per_node):
                g = dist.new_group([ranks[t.rank(n, l)] for n in range(t.nodes)])
                if l == t.local(self.me):
                    self.inter = g
        self._cache: OrderedDict[Hashable, tuple] = OrderedDict()
        self._cache_size = cache_size

    # -- planning -------------------------------------------------------------------------
    def _exchange_meta(self, out_meta: list[Meta], device: torch.device) -> list[Meta]:
        """Send each node's proxy the (rows, mask) list of the splits it will receive."""
        n = self.topo.nodes
        if n == 1:
            return [[]]
        dev = device if dist.get_backend(self.inter) == "nccl" else torch.device("cpu")
        counts = torch.tensor([2 * len(m) for m in out_meta], dtype=torch.long, device=dev)
        rcounts = torch.empty_like(counts)
        dist.all_to_all_single(rcounts, counts, group=self.inter)
        flat = torch.tensor([v for m in out_meta for pair in m for v in pair], dtype=torch.long, device=dev)
        rc = rcounts.tolist()
        rflat = torch.empty(sum(rc), dtype=torch.long, device=dev)
        dist.all_to_all_single(rflat, flat, output_split_sizes=rc, input_split_sizes=counts.tolist(), group=self.inter)
        vals, res, pos = rflat.tolist(), [], 0
        for c in rc:
            res.append([(vals[pos + i], vals[pos + i + 1]) for i in range(0, c, 2)])
            pos += c
        return res

    def cast_plan(self, input_split_sizes, dst_indices, output_split_sizes, src_index, device,
                  plan_key: Hashable | None = None) -> TwoHopPlan:
        """The two-hop plan of this rank (collective when not cached: all ranks call it)."""
        args = (tuple(int(x) for x in input_split_sizes), tuple(tuple(int(r) for r in d) for d in dst_indices),
                tuple(int(x) for x in output_split_sizes), tuple(int(x) for x in src_index))
        for d in args[1]:
            check_ranks(d, self.topo.world, "dst_indices")
        check_ranks(args[3], self.topo.world, "src_index")
        if plan_key is not None and plan_key in self._cache:
            cached_args, plan = self._cache[plan_key]
            if cached_args != args:
                raise ValueError(f"plan_key {plan_key!r} was used before with other split arguments")
            self._cache.move_to_end(plan_key)
            return plan
        incoming = self._exchange_meta(outgoing_meta(self.topo, self.me, args[0], args[1]), device)
        plan = two_hop_cast_plan(self.topo, self.me, *args, incoming)
        if plan_key is not None:
            self._cache[plan_key] = (args, plan)
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return plan

    # -- collectives ----------------------------------------------------------------------
    def _hop(self, tensors, plan: A2AIndexPlan, inter: bool):
        group = self.inter if inter else self.intra
        size = self.topo.nodes if inter else self.topo.ranks_per_node
        if inter:
            for t in tensors:
                row = t[0].numel() * t.element_size() if t.shape[0] else 0
                COMM_STATS["inter_node_sent"] += sum(plan.send_counts) * row
        return exchange_rows(tensors, plan, group, size)

    def group_cast(self, input: torch.Tensor, *, input_split_sizes, output_split_sizes, dst_indices, src_index,
                   output: torch.Tensor | None = None, async_op: bool = False, plan_key: Hashable | None = None,
                   plan: TwoHopPlan | None = None, timeout_s: float | None = DEFAULT_TIMEOUT_S):
        """As :func:`magi_comm.group_cast`; hop 2 runs inside ``wait()`` of an async call.
        ``plan``: this call's :meth:`cast_plan`, built beforehand (no metadata exchange)."""
        if sum(input_split_sizes) != input.shape[0]:
            raise ValueError(f"input_split_sizes sum to {sum(input_split_sizes)} but input has {input.shape[0]} rows")
        if plan is None:
            plan = self.cast_plan(input_split_sizes, dst_indices, output_split_sizes, src_index, input.device, plan_key)
        n_out = sum(output_split_sizes)
        if output is None:
            output = input.new_zeros((n_out, *input.shape[1:]))
        elif output.shape != (n_out, *input.shape[1:]):
            raise ValueError(f"output must have shape {(n_out, *input.shape[1:])}, got {tuple(output.shape)}")
        (hop1,), works = self._hop([input], plan.inter, inter=True)

        def finish():
            wait_works(works, self.inter, timeout_s, "GroupCast (inter-node hop)")
            (hop2,), works2 = self._hop([torch.cat([input, hop1])], plan.intra, inter=False)
            wait_works(works2, self.intra, timeout_s, "GroupCast (intra-node hop)")
            output.index_copy_(0, on_device(plan.intra.recv_rows, output.device), hop2)
            return output

        pending = PendingCollective([], finish)
        return pending if async_op else pending.wait()

    def group_reduce(self, input: torch.Tensor, output: torch.Tensor, *, input_split_sizes, output_split_sizes,
                     dst_index, src_indices, op: str = "sum", input_lse: torch.Tensor | None = None,
                     output_lse: torch.Tensor | None = None, async_op: bool = False,
                     plan_key: Hashable | None = None, plan: TwoHopPlan | None = None,
                     timeout_s: float | None = DEFAULT_TIMEOUT_S, ordered: bool = False):
        """As :func:`magi_comm.group_reduce`: partials are pre-reduced on their node's proxy, so
        each reduced row crosses the network once. Sums run in another order than the flat
        reduce (equal up to rounding); ``op="lse"`` merges with the same rule. ``plan``: the
        :meth:`cast_plan` of the transposed arguments, built beforehand. ``ordered``: sums in a
        fixed order (:func:`magi_comm.add_rows`), bitwise reproducible."""
        if op not in REDUCE_OPS:
            raise ValueError(f"op must be one of {REDUCE_OPS}, got {op!r}")
        if op == "lse" and (input_lse is None or output_lse is None):
            raise ValueError("op='lse' needs input_lse and output_lse")
        if sum(input_split_sizes) != input.shape[0]:
            raise ValueError(f"input_split_sizes sum to {sum(input_split_sizes)} but input has {input.shape[0]} rows")
        if sum(output_split_sizes) != output.shape[0]:
            raise ValueError(f"output_split_sizes sum to {sum(output_split_sizes)} but output has {output.shape[0]} rows")
        if plan is None:  # the transpose of the cast that brought the rows here
            plan = self.cast_plan(output_split_sizes, src_indices, input_split_sizes, dst_index, output.device, plan_key)
        n_out, n1 = output.shape[0], plan.hop1_rows
        tensors = [input] if op == "sum" else [input, input_lse]
        bufs, works = self._hop(tensors, plan.intra.transposed(), inter=False)

        def reduce_into(out, out_lse, rows_host, parts):
            rows = on_device(rows_host, out.device)
            if op == "sum":
                add_rows(out, rows, parts[0], ordered=ordered, rows_host=rows_host)
            else:
                lse_scatter_merge(out, out_lse, rows, parts[0], parts[1])

        def finish():
            wait_works(works, self.intra, timeout_s, "GroupReduce (intra-node hop)")
            # positions in cat(output, proxy buffer), split once per plan into own rows and proxy rows
            own_pos, own_rows, proxy_pos, proxy_rows = per_tensor(
                plan.intra.send_rows, f"own rows {n_out}", lambda: _split_own(plan.intra.send_rows, n_out))
            own_d, proxy_d = on_device(own_pos, output.device), on_device(proxy_pos, output.device)
            reduce_into(output, output_lse, own_rows, [b.index_select(0, own_d) for b in bufs])
            tmp = output.new_zeros((n1, *output.shape[1:]))
            tmp_lse = output_lse.new_full((n1, *output_lse.shape[1:]), float("-inf")) if op == "lse" else None
            reduce_into(tmp, tmp_lse, proxy_rows, [b.index_select(0, proxy_d) for b in bufs])
            back, works2 = self._hop([tmp] if op == "sum" else [tmp, tmp_lse], plan.inter.transposed(), inter=True)
            wait_works(works2, self.inter, timeout_s, "GroupReduce (inter-node hop)")
            reduce_into(output, output_lse, plan.inter.send_rows, back)
            return output

        pending = PendingCollective([], finish)
        return pending if async_op else pending.wait()


def _split_own(rows: torch.Tensor, n_out: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(positions of the host ``rows`` below ``n_out``, those rows, positions of the others, those
    rows minus ``n_out``): index tensors, so the device gathers without a boolean mask's sync."""
    own = rows < n_out
    own_pos, proxy_pos = torch.nonzero(own).flatten(), torch.nonzero(~own).flatten()
    return own_pos, rows[own_pos], proxy_pos, rows[proxy_pos] - n_out
