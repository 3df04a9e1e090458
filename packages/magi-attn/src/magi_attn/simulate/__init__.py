"""Simulated distributed speed: magi's real plan for every rank, priced by a kernel cost model
fitted to single-GPU measurements and a link model (NVLink inside a node, InfiniBand across),
run through the two-stream timeline calc_attn follows; ring (zigzag), Ulysses and USP on the
same models. Pure CPU: no GPU and no process group needed. Results are SIMULATED, not measured.

    sim = Simulator(KernelCostModel("H100"))
    rows = sweep(sim, [Case("varlen_causal", 8192, cp) for cp in (8, 16, 32, 64)], METHODS)
"""

from .baselines import simulate_ring, simulate_ulysses, simulate_usp
from .cost_model import DEVICES, KernelCostModel
from .links import LinkModel
from .magi_sim import Result, Shape, build_plan, dq_add_s, merge_s, simulate_magi
from .report import FIXED_DEGREES, METHODS, Case, Simulator, degree_check, format_table, plot, sweep
from .timeline import Compute, Issue, RankTimes, Timeline, Wait, simulate

__all__ = [
    "Case", "Compute", "DEVICES", "FIXED_DEGREES", "Issue", "KernelCostModel", "LinkModel", "METHODS", "RankTimes",
    "Result", "Shape", "Simulator", "Timeline", "Wait", "build_plan", "degree_check", "dq_add_s", "format_table",
    "merge_s", "plot",
    "simulate", "simulate_magi", "simulate_ring", "simulate_ulysses", "simulate_usp", "sweep",
]
