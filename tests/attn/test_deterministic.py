"""Deterministic mode: DistAttnConfig(deterministic=True), whose GroupReduce of dK/dV sums in a
fixed order (magi_comm.add_rows, tested in tests/comm/test_ordered_add.py), still equals float64
dense on gloo ranks, with the all-to-all and the node-aware backend."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from cases import mask_cases
from dist_cases import CONFIGS, check_case
from dist_harness import run_distributed


DETERMINISTIC = {
    "deterministic_a2a": dict(overlap=dict(degree=3, min_chunk_size=4), comm=dict(deterministic=True)),
    "deterministic_hier": dict(overlap=dict(degree=2, min_chunk_size=4),
                               comm=dict(comm_backend="hier", ranks_per_node=2, deterministic=True)),
}


def _worker(rank, world):
    CONFIGS.update(DETERMINISTIC)  # check_case looks its config up by name
    cases = mask_cases()
    for cfg in DETERMINISTIC:
        if "hier" in cfg and world % 2:
            continue  # 2 ranks a node: whole nodes only (3 ranks run the a2a config)
        for name in ("varlen_block_causal", "mixed_overlapping"):
            check_case(name, *cases[name], cfg, dist.group.WORLD, rank)


@pytest.mark.parametrize("world", [3, 4])
def test_deterministic_mode_matches_dense(world):
    run_distributed(_worker, world)
