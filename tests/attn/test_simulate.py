"""The distributed-speed simulator (magi_attn.simulate): cost model fit, link model, timeline
invariants, magi's overlap as calc_attn runs it, the CLI, and the overlap planner's automatic
degree against every fixed degree (all pure CPU, seconds)."""

from __future__ import annotations

import json
import math

import pytest

from magi_attn import DistAttnConfig, OverlapConfig
from magi_attn.cli import main
from magi_attn.masks import make_mask
from magi_attn.simulate import (
    Case, Compute, Issue, KernelCostModel, LinkModel, Shape, Simulator, Wait, build_plan, degree_check, simulate,
    simulate_magi, simulate_ring, simulate_ulysses, simulate_usp,
)
from magi_attn.simulate.cost_model import slice_features
from magi_attn.simulate.magi_sim import merge_s


@pytest.fixture(scope="module")
def cost() -> KernelCostModel:
    return KernelCostModel("H100")


# the fit errors the cost model's docstring and the README state
@pytest.mark.parametrize("device, fwd_err, bwd_err", [("H100", 0.029, 0.033), ("H200", 0.050, 0.085)])
def test_cost_model_reproduces_its_fit_data(device, fwd_err, bwd_err):
    err = KernelCostModel(device).fit_error()
    assert err["fwd_max_rel_err"] <= fwd_err and err["bwd_max_rel_err"] <= bwd_err, err


def test_slice_features_count_tiles_and_area():
    assert slice_features([(0, 256, 0, 256, 0)]) == (65536, 65536, 256)
    # causal 128x128: one tile, half (plus diagonal) of it unmasked
    assert slice_features([(0, 128, 0, 128, 1)]) == (128 * 129 // 2, 128 * 128, 128)
    # a 1-row slice still costs a whole tile row; an empty one costs nothing
    assert slice_features([(5, 6, 0, 300, 0), (7, 7, 0, 10, 0)]) == (300, 3 * 128 * 128, 1)
    # inverse causal (bit 1) and bi-causal (both bits) agree with magi_solver's area
    from magi_solver import AttnMaskType, slice_area
    for t in (2, 3):
        assert slice_features([(0, 200, 0, 300, t)])[0] == slice_area(200, 300, AttnMaskType(t))


def test_cost_scales_with_heads_and_skips_empty(cost):
    sl = [(0, 4096, 0, 4096, 1)]
    one, two = cost.forward_s(sl, 48), cost.forward_s(sl, 96)
    launch = cost.fwd.per_launch_s
    assert math.isclose(two - launch, 2 * (one - launch))
    assert cost.forward_s([], 48) == 0.0


def test_link_model_nvlink_inside_a_node_infiniband_across():
    links = LinkModel(ranks_per_node=2, nvlink_bytes_per_s=100.0, ib_bytes_per_s=10.0, nvlink_latency_s=1.0,
                      ib_latency_s=2.0)
    # 4 ranks = 2 nodes (latency of a collective spanning nodes): 0 -> 1 inside, 0 -> 2 across
    t = links.collective_s([{1: 100.0}, {}, {}, {}])
    assert t == [2.0 + 1.0, 2.0 + 1.0, 2.0, 2.0]
    t = links.collective_s([{2: 100.0}, {}, {}, {}])
    assert t == [2.0 + 10.0, 2.0, 2.0 + 10.0, 2.0]
    # a receiver waits for its source's whole send (the source also feeds another rank)
    t = links.collective_s([{1: 100.0, 3: 100.0}, {}, {}, {}])
    assert t[1] == 2.0 + 10.0
    with pytest.raises(ValueError, match="ranks_per_node"):
        LinkModel(ranks_per_node=0)


def test_timeline_overlap_and_serial_cases():
    # one rank: the cast runs during the host stage; the stage waits for it
    tl = simulate([[Issue("c"), Compute(2.0), Wait("c"), Compute(1.0)]], {"c": [3.0]})
    assert tl.makespan == 3.0 + 1.0 and tl.ranks[0].exposed == 1.0
    # no overlap (degree 0): the sum
    tl = simulate([[Issue("c"), Wait("c"), Compute(2.0)]], {"c": [3.0]})
    assert tl.makespan == 5.0 and tl.ranks[0].exposed == 3.0
    # a collective starts when the last rank issues it: rank 1's stall before that is idle, not exposed
    tl = simulate([[Compute(4.0), Issue("c"), Wait("c")], [Issue("c"), Wait("c")]], {"c": [1.0, 1.0]})
    assert tl.makespan == 5.0
    assert tl.ranks[1].exposed == 1.0 and tl.ranks[1].idle == 4.0
    with pytest.raises(ValueError, match="different collectives"):
        simulate([[Issue("a")], [Issue("b")]], {"a": [1, 1], "b": [1, 1]})
    with pytest.raises(ValueError, match="before issuing"):
        simulate([[Wait("a")]], {})


@pytest.mark.parametrize("degree", [0, 1, 3, None])
def test_magi_timeline_invariants(cost, degree):
    sl = make_mask("varlen_causal", 8 * 2048, seed=1)
    res = simulate_magi(sl, 8 * 2048, 8, Shape(), cost, LinkModel(ranks_per_node=4),
                        DistAttnConfig(overlap=OverlapConfig(degree=degree)))
    for tl in (res.fwd, res.bwd):
        for r in tl.ranks:
            assert 0 <= r.exposed <= r.transfer + 1e-12
            assert math.isclose(r.compute + r.exposed + r.idle, tl.makespan, rel_tol=1e-9)
            assert r.end <= tl.makespan
    assert 0 < res.tflops_per_gpu("fwd") < 700 and 0 < res.tflops_per_gpu("bwd") < 700


@pytest.mark.parametrize("total", [4 * 2048, 4 * 2048 - 300])
def test_magi_forward_overlaps_the_cast_with_the_host_stage(cost, total):
    """Degree 1 on every rank: forward = max(host kernel, cast) + stage kernel + merge, as
    calc_attn issues stage 0's cast before the host kernel (dropping the overlap fails this).
    The second length leaves ranks with shards of different lengths: each merges its own rows."""
    cp, shape = 4, Shape()
    sl = make_mask("causal", total)
    links = LinkModel()
    cfg = DistAttnConfig(overlap=OverlapConfig(degree=1))
    plan = build_plan(sl, total, cp, shape, cfg)
    assert (len(set(plan.dispatch.shard_seqlens)) > 1) == (total % (cp * 128) != 0)
    res = simulate_magi(sl, total, cp, shape, cost, links, cfg, plan=plan)
    casts = links.collective_s([
        {d: n * 2 * shape.heads_kv * shape.head_dim * 2 for n, dsts in zip(p.input_split_sizes, p.dst_indices) for d in dsts}
        for p in (plan.cast_plan(0, r) for r in range(cp))])
    expect = []
    for r in range(cp):
        c = plan.calc_plan(r)
        stage = cost.forward_s(c.stages[0], shape.heads_q) + merge_s(cost, plan.dispatch.shard_seqlens[r], shape) if c.stages[0] else 0
        expect.append(max(cost.forward_s(c.host, shape.heads_q), casts[r]) + stage)
    assert math.isclose(res.fwd.makespan, max(expect), rel_tol=1e-9)
    for r in range(cp):  # every rank, not only the slowest
        assert math.isclose(res.fwd.ranks[r].end, expect[r], rel_tol=1e-9), f"rank {r}"
    assert any(cost.forward_s(plan.calc_plan(r).host, shape.heads_q) > 0 for r in range(cp))


def test_baselines_run_and_refuse_what_they_cannot_split(cost):
    sl = make_mask("varlen_causal", 16 * 1024)
    links = LinkModel(ranks_per_node=4)
    for fn in (simulate_ring, simulate_ulysses, simulate_usp):
        res = fn(sl, 16 * 1024, 16, Shape(), cost, links)
        assert res is not None and 0 < res.tflops_per_gpu("fwd") < 700
    assert simulate_ulysses(sl, 16 * 1024, 16, Shape(heads_q=8, heads_kv=8), cost, links) is None
    assert simulate_usp(sl, 16 * 1024, 4, Shape(), cost, links) is None  # one node: plain Ulysses


def test_simulator_refuses_an_unfitted_head_dim(cost):
    with pytest.raises(ValueError, match="head_dim=64"):
        Simulator(cost, shape=Shape(head_dim=64))


# A representative subset (one node, two nodes, cheap and comm-heavy masks) that runs in seconds.
AUTO_CASES = [Case("varlen_causal", 8192, 16), Case("varlen_full", 8192, 16), Case("causal", 4096, 16),
              Case("sliding_window", 8192, 8)]


def test_auto_degree_within_3_percent_of_the_best_fixed_degree(cost):
    rows = degree_check(Simulator(cost), AUTO_CASES)
    worst = max(rows, key=lambda r: r["auto_over_best"])
    assert worst["auto_over_best"] <= 1.03, worst


def test_cli_simulate_smoke(capsys, tmp_path):
    png = tmp_path / "sim.png"
    code = main(["simulate", "--cp", "2,4", "--tokens-per-gpu", "1024", "--masks", "causal,varlen_full",
                 "--quiet", "--check-degrees", "--plot", str(png), "--ranks-per-node", "2", "--per-rank"])
    out = capsys.readouterr()
    assert code == 0
    report = json.loads(out.out)
    assert report["SIMULATED"] is True and "SIMULATED" in out.err
    assert {r["method"] for r in report["rows"]} == {"magi", "ring", "ulysses", "usp"}
    assert len(report["degree_check"]) == 4 and png.stat().st_size > 0
    ranks = report["rows"][0]["per_rank_ms"]["fwd"]
    assert len(ranks) == report["rows"][0]["cp"] and set(ranks[0]) == {"end", "compute", "transfer", "exposed", "idle"}


@pytest.mark.parametrize("argv, message", [
    (["--cp", "1"], "--cp"), (["--masks", "nope"], "--masks"), (["--degree", "x"], "--degree"),
    (["--tokens-per-gpu", "1,a"], "--tokens-per-gpu"),
])
def test_cli_simulate_rejects_bad_flags(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        main(["simulate", *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_cli_simulate_unfitted_head_dim_is_a_clear_error(capsys):
    assert main(["simulate", "--cp", "2", "--head-dim", "64", "--quiet"]) == 1
    assert "head_dim=64" in capsys.readouterr().err


def test_calibration_script_smoke(tmp_path):
    """bench/calibrate_sim.py (the lead runs it on a GPU) still runs: CPU, tiny sizes."""
    import importlib
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.join(root, "bench"))
    try:
        calibrate = importlib.import_module("calibrate_sim")
    finally:
        sys.path.pop(0)
    out = tmp_path / "calib.json"
    assert calibrate.main(["--smoke", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["smoke"] and len(report["ranks"]) == 2 and report["launches"]
    assert all(r["measured_fwd_ms"] > 0 and r["simulated_fwd_ms"] >= 0 for r in report["ranks"])


def test_hier_backend_sends_each_row_once_per_destination_node(cost):
    """The two-hop model crosses nodes with exactly the rows magi_comm's two-hop path counts,
    and at cp 16 on 4-GPU nodes it beats the flat all-to-all."""
    from magi_comm import NodeTopology, inter_node_rows
    from magi_attn.simulate.magi_sim import _two_hop

    cp, total, shape = 16, 16 * 2048, Shape()
    sl = make_mask("varlen_causal", total)
    links = LinkModel(ranks_per_node=4)
    plan = build_plan(sl, total, cp, shape, DistAttnConfig(overlap=OverlapConfig(degree=2)))
    topo = NodeTopology(cp, 4)
    for s in range(plan.num_stages):
        hop1, _ = _two_hop(plan, s, 1, 4)
        crossing = sum(b for r, row in enumerate(hop1) for p, b in row.items() if p // 4 != r // 4)
        expect = sum(inter_node_rows(topo, r, plan.cast_plan(s, r).input_split_sizes, plan.cast_plan(s, r).dst_indices,
                                     True) for r in range(cp))
        assert crossing == expect > 0
    flat, hier = (simulate_magi(sl, total, cp, shape, cost, links,
                                DistAttnConfig(overlap=OverlapConfig(degree=2), comm_backend=c)) for c in ("a2a", "hier"))
    assert hier.fwd.makespan < flat.fwd.makespan and hier.bwd.makespan < flat.bwd.makespan
    with pytest.raises(ValueError, match="whole nodes"):
        simulate_magi(sl, total, 6, shape, cost, links, DistAttnConfig(comm_backend="hier"))


def test_planner_step_cost_trades_fixed_costs_against_overlap():
    """The dynamic degree's model: with nothing to hide, one stage (every stage costs its fixed
    merge and latency); with the wire dominating and no fixed cost, more stages."""
    from magi_solver.overlap import RankCosts, best_degree, step_cost

    calc, comm = (1.0,) * 8, (0.01,) * 8
    cheap_wire = [RankCosts(1.0, calc, comm, merge_s=0.2, dq_add_s=0.2, sources=tuple({1 - r: c} for c in comm))
                  for r in range(2)]
    assert best_degree(cheap_wire, 8, latency_s=0.01) == 1
    heavy_wire = [RankCosts(0.5, (0.5,) * 8, (1.0,) * 8) for _ in range(2)]
    d = best_degree(heavy_wire, 8, latency_s=0.0)
    assert d >= 4 and step_cost(heavy_wire, d, 0.0) < 0.8 * step_cost(heavy_wire, 1, 0.0)
    # the slowest rank sets the pace: a second, idle rank changes nothing
    one = [RankCosts(1.0, calc, comm)]
    assert step_cost(one + [RankCosts(0.0, (0.0,) * 8, (0.0,) * 8)], 2, 0.0) == step_cost(one, 2, 0.0)


@pytest.mark.parametrize("field, value", [("intra_node_gbps", 0.0), ("memory_gbps", -1.0), ("ranks_per_node", 0),
                                          ("stage_latency_us", -1.0)])
def test_overlap_config_rejects_bad_cost_model_values(field, value):
    with pytest.raises(ValueError, match=f"OverlapConfig.{field}"):
        OverlapConfig(**{field: value})
