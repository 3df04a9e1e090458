"""The distributed benchmark runs end to end on 2 gloo processes (tiny sizes)."""

import importlib
import json
import os
import subprocess
import sys
import time

import pytest


def bench_module(name: str):
    """A script of ``bench/`` imported as a module (the folder is not a package)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.join(root, "bench"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


@pytest.mark.parametrize("comm", ["a2a", "hier"])
def test_bench_dist_smoke(tmp_path, comm):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path / "d.json"
    # hier with one rank per node: two "nodes", every remote KV row crosses between them
    subprocess.run([sys.executable, os.path.join(root, "bench", "bench_dist.py"), "--cp", "2", "--tokens-per-rank", "128",
                    "--masks", "causal", "--heads-q", "4", "--heads-kv", "2", "--head-dim", "8", "--iters", "1",
                    "--comm", comm, "--ranks-per-node", "1", "--out", str(out)], check=True, timeout=300)
    rows = json.loads(out.read_text())["rows"]
    # causal over 2 ranks: rank 0 receives remote KV, so the byte check is not 0 == 0
    assert rows and rows[0]["magi_fwd_bytes_plan"] > 0
    assert rows[0]["magi_fwd_bytes_received"] == rows[0]["magi_fwd_bytes_plan"]
    assert (rows[0]["magi_fwd_inter_node_bytes_sent"] > 0) == (comm == "hier")


def test_kernel_bench_interleaves_rounds_and_takes_medians():
    """bench_kernels times every implementation once per round, each round starting one later
    (so none always follows the others' heat), and reports the median round; a failing one
    is dropped without losing the others."""
    bench_kernels = bench_module("bench_kernels")
    calls, clock = [], iter(range(100))

    def timer(fn, reps_ms):
        calls.append(fn())
        return {"a": 1.0, "b": 2.0, "c": 3.0}[calls[-1]] * (1 + next(clock) % 3)

    def broken():
        raise RuntimeError("peer failed")

    fns = {"a": lambda: "a", "b": lambda: "b", "c": lambda: "c", "x": broken}
    windows, samples = {}, {}
    out = bench_kernels.interleaved_times(fns, rounds=3, reps_ms=1.0, timer=timer, windows=windows,
                                          samples=samples)
    # an untimed heat-up call of the first, then rounds starting at a, b, c
    assert calls == ["a", "a", "b", "c", "b", "c", "a", "c", "a", "b"]
    # timings (base x 1, 2 or 3 by call number; the heat-up's is dropped):
    # a 2, 1, 3; b 6, 4, 2; c 3, 9, 6: the medians
    assert out == {"a": 2.0, "b": 4.0, "c": 6.0}
    # every round's timing in timed order, kept for the spread behind each median
    assert samples == {"a": [2.0, 1.0, 3.0], "b": [6.0, 4.0, 2.0], "c": [3.0, 9.0, 6.0]}
    # one wall-clock window per timed round, none for the failing one
    assert set(windows) == {"a", "b", "c"} and all(len(w) == 3 for w in windows.values())
    assert all(t0 <= t1 for w in windows.values() for t0, t1 in w)


def clock_log(start: float, clocks: list[int], watts: list[float], period: float = 0.1) -> str:
    """An nvidia-smi log as device_run.sh writes it: one sample per ``period`` from ``start``."""
    lines = []
    for i, (mhz, w) in enumerate(zip(clocks, watts)):
        t = start + i * period
        stamp = time.strftime("%Y/%m/%d %H:%M:%S", time.localtime(t)) + f".{round((t % 1) * 1000):03d}"
        lines.append(f"{stamp}, {mhz} MHz, {w:.2f} W, 40")
    return "\n".join(lines) + "\n2026/12/05 17:0"  # cut mid-line, as a killed logger leaves it


def test_gpu_clocks_reads_the_clock_inside_each_timing_window(tmp_path):
    """``bench/gpu_clocks.py``: samples inside a window (widened by half a period) give its
    median clock and largest power; per implementation over all its rounds' windows; the call's
    loaded median skips idle samples; a row without windows is left alone."""
    gc = bench_module("gpu_clocks")
    start = 1_800_000_000.0  # whole second: sample i at start + i / 10
    clocks = [345] * 5 + [1980, 1900, 1800, 1700, 1600] + [345] * 5 + [1500, 1500, 1400, 1400, 1400]
    watts = [70.0] * 5 + [500, 650, 700, 700, 700] + [80.0] * 5 + [700] * 5
    log = tmp_path / "gpu_clocks.csv"
    log.write_text(clock_log(start, clocks, watts))
    samples = gc.load_samples(str(log))
    assert len(samples) == 20 and samples[5].sm_mhz == 1980 and abs(samples[5].t - (start + 0.5)) < 1e-6

    # samples 5..9 inside [0.5, 0.9]: clocks 1980..1600, median 1800
    assert gc.window_stats(samples, [(start + 0.5, start + 0.9)]) == {"sm_mhz": 1800, "power_w": 700.0, "samples": 5}
    # a window between two samples still catches the nearer one (pad of half a period)
    assert gc.window_stats(samples, [(start + 0.51, start + 0.53)])["sm_mhz"] == 1980
    assert gc.window_stats(samples, [(start - 10, start - 9)]) is None

    summary = gc.call_summary(samples)
    assert summary["sm_mhz_min"] == 345 and summary["sm_mhz_max"] == 1980
    # loaded: power >= 60 % of 700 W: samples 5..9 and 15..19, median of their 10 clocks
    assert summary["loaded_samples"] == 10 and summary["sm_mhz_loaded_median"] == 1550

    data = {"rows": [{"seqlen": 8, "mask": "causal", "timing_windows": {
        "magi_fwd": [[start + 0.5, start + 0.6]], "flex_fwd": [[start + 1.5, start + 1.6], [start + 1.8, start + 1.9]]}},
        {"seqlen": 8, "mask": "full"}]}
    lines = gc.annotate_bench(data, samples)
    assert data["rows"][0]["sm_mhz"] == {"magi_fwd": 1940, "flex_fwd": 1450}
    assert data["rows"][0]["power_w"]["flex_fwd"] == 700.0
    assert "sm_mhz" not in data["rows"][1] and len(lines) == 1

    sweep = [{"cfg": "A", "t0": start + 1.5, "t1": start + 1.9}, {"cfg": "B", "error": "boom"}]
    assert gc.annotate_sweep(sweep, samples) == 1 and sweep[0]["sm_mhz"] == 1400 and "sm_mhz" not in sweep[1]

    # the CLI rewrites both files in place
    bench_json, sweep_jsonl = tmp_path / "b.json", tmp_path / "s.jsonl"
    data["rows"][0].pop("sm_mhz")
    bench_json.write_text(json.dumps(data))
    sweep_jsonl.write_text("".join(json.dumps(r) + "\n" for r in sweep))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    res = subprocess.run([sys.executable, os.path.join(root, "bench", "gpu_clocks.py"), str(log), "--bench",
                          str(bench_json), "--sweep", str(sweep_jsonl)], capture_output=True, text=True, check=True)
    assert "under load" in res.stdout
    assert json.loads(bench_json.read_text())["rows"][0]["sm_mhz"]["magi_fwd"] == 1940
    assert json.loads(sweep_jsonl.read_text().splitlines()[0])["sm_mhz"] == 1400


def test_sweep_sets_parse_combinations_and_pick_the_pass():
    """MAGI_SWEEP_SETS: ';'-separated settings of several variables (or 'default'), each timed
    on the forward only when all its variables are forward ones; a malformed item is an error
    naming the variable."""
    sweep_tiles = bench_module("sweep_tiles")
    sets = sweep_tiles.parse_sets("default; MAGI_GLUON_BWD_PIECES=1,MAGI_GLUON_BWD_PIECE_ADD=tma;"
                                  "MAGI_GLUON_FWD=0;")
    assert sets == [{}, {"MAGI_GLUON_BWD_PIECES": "1", "MAGI_GLUON_BWD_PIECE_ADD": "tma"},
                    {"MAGI_GLUON_FWD": "0"}]
    assert [sweep_tiles.set_pass(s) for s in sets] == ["bwd", "bwd", "fwd"]
    assert sweep_tiles.set_pass({"MAGI_TRITON_TMA": "0", "MAGI_GLUON_BWD_PIECES": "1"}) == "bwd"
    with pytest.raises(ValueError, match="MAGI_SWEEP_SETS"):
        sweep_tiles.parse_sets("MAGI_GLUON_BWD_PIECES")


def test_sweep_ab_rounds_alternate_direction():
    """Repeated settings are timed in rounds, every other one reversed, so a clock that sinks
    through a mask's timings favours none; the default once per round too; a sweep without
    repeats keeps its order."""
    sweep_tiles = bench_module("sweep_tiles")
    runs = [("set", c, {}) for c in "ABCABCAB"]
    assert "".join(r[1] for r in sweep_tiles.balanced_order(runs)) == "ABCCBAAB"
    single = [("X", "1", {}), ("X", "2", {}), ("Y", "1", {})]
    assert sweep_tiles.balanced_order(single) == single
    # the same value of two variables is two settings
    assert sweep_tiles.balanced_order([("X", "1", {}), ("Y", "1", {}), ("X", "1", {}), ("Y", "1", {})]) == \
        [("X", "1", {}), ("Y", "1", {}), ("Y", "1", {}), ("X", "1", {})]


def test_fwd_item_fit_counts_blocks_and_recovers_costs():
    """``bench/fwd_item_fit.py``: the forward's key and partial blocks per tile of a mask (full
    1024: 8 tiles of 8 full blocks; causal: 1..8 blocks, the diagonal one partial), and the fit
    recovers the per-block and per-item costs of synthetic times."""
    fit = bench_module("fwd_item_fit")
    assert fit.item_features("full", 1024) == (8.0, 0.0, 8)
    assert fit.item_features("causal", 1024) == (4.5, 1.0, 8)
    rows = []
    for S in (1024, 2048, 4096):
        for mask in ("full", "causal", "sliding_window"):
            blocks, partial, items = fit.item_features(mask, S)
            us = 1.8 * blocks + 0.3 * partial + 5.0  # per item and SM
            rows.append({"seqlen": S, "mask": mask, "magi_fwd_ms": us * items * 2 / 4 / 1e3})
    coef, table = fit.fit(rows, "magi_fwd_ms", sms=4, heads=2)
    assert coef == pytest.approx([1.8, 0.3, 5.0], abs=1e-6) and len(table) == 9


def test_ab_summary_means_repeats_and_divides_by_the_baseline(tmp_path):
    """``bench/ab_summary.py``: a setting's repeats are averaged per (seqlen, mask, pass), the
    ratio is to the first setting timed on that pass (or ``--base``), error rows are skipped."""
    ab = bench_module("ab_summary")
    rows = [{"seqlen": 8, "mask": "causal", "pass": "bwd", "cfg": c, "tflops": t}
            for c, t in (("default", 500.0), ("X=1", 550.0), ("default", 520.0), ("X=1", 530.0))]
    rows += [{"seqlen": 8, "mask": "causal", "pass": "fwd", "cfg": "P=0", "tflops": 400.0},
             {"seqlen": 8, "mask": "causal", "pass": "fwd", "cfg": "P=1", "tflops": 440.0},
             {"seqlen": 8, "mask": "causal", "pass": "fwd", "cfg": "P=2", "error": "boom"}]
    path = tmp_path / "sweep.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = {(r["pass"], r["cfg"]): r for r in ab.summarise(ab.load_rows([str(path)]))}
    assert set(out) == {("bwd", "default"), ("bwd", "X=1"), ("fwd", "P=0"), ("fwd", "P=1")}
    assert out["bwd", "X=1"]["tflops"] == 540.0 and out["bwd", "X=1"]["spread"] == 20.0
    assert out["bwd", "X=1"]["ratio"] == round(540 / 510, 4) and out["bwd", "default"]["ratio"] == 1.0
    assert out["fwd", "P=1"]["ratio"] == 1.1 and out["fwd", "P=1"]["base"] == "P=0"
    by_base = {r["cfg"]: r for r in ab.summarise(ab.load_rows([str(path)]), base="X=1") if r["pass"] == "bwd"}
    assert by_base["default"]["ratio"] == round(510 / 540, 4)
    assert out["bwd", "X=1"]["sm_mhz"] is None  # no clock annotation in these rows


def test_ab_summary_averages_the_clock_of_annotated_repeats():
    """Rows annotated by ``bench/gpu_clocks.py`` carry ``sm_mhz``: the summary gives each
    setting the mean clock of its repeats, so a win bought by a higher clock shows."""
    ab = bench_module("ab_summary")
    rows = [{"seqlen": 8, "mask": "full", "pass": "fwd", "cfg": c, "tflops": 500.0, "sm_mhz": m}
            for c, m in (("A", 1600), ("B", 1800), ("A", 1700), ("B", 1800))]
    out = {r["cfg"]: r for r in ab.summarise(rows)}
    assert out["A"]["sm_mhz"] == 1650 and out["B"]["sm_mhz"] == 1800
    # equal TFLOP/s at a higher clock: less per cycle than the baseline A
    assert out["A"]["ratio_per_mhz"] == 1.0 and out["B"]["ratio_per_mhz"] == round(1650 / 1800, 4)
    per_mhz = ab.verdicts(out.values(), ("full",), key="ratio_per_mhz")
    assert per_mhz[0]["cfg"] == "B" and per_mhz[0]["verdict"] == "keep off"


def test_ab_summary_verdicts_follow_the_adoption_rule():
    """A variant is adopted only if it wins on the target masks by the gain and no mask loses
    more than the allowed loss; a target win with a loss elsewhere is a per-launch candidate."""
    ab = bench_module("ab_summary")

    def rec(cfg, mask, ratio, seqlen=8):
        return {"seqlen": seqlen, "mask": mask, "pass": "bwd", "cfg": cfg, "ratio": ratio, "base": "default"}

    summary = [rec("default", m, 1.0) for m in ("causal", "full")]
    summary += [rec("A", "causal", 1.03), rec("A", "causal", 1.00, seqlen=16), rec("A", "full", 0.997)]
    summary += [rec("B", "causal", 1.05), rec("B", "full", 0.97)]
    summary += [rec("C", "causal", 1.005), rec("C", "full", 1.02)]
    summary += [rec("D", "full", 1.05)]
    got = {v["cfg"]: v for v in ab.verdicts(summary, ("causal",))}
    assert set(got) == {"A", "B", "C", "D"}, "the baseline gets no verdict"
    assert got["A"]["verdict"] == "adopt" and got["A"]["per_mask"]["causal"] == 1.015
    assert got["B"]["verdict"] == "per-launch"
    assert got["C"]["verdict"] == "keep off"
    assert got["D"]["verdict"] == "no target rows"
    assert ab.verdicts(summary, ("causal",), gain=0.02)[0]["verdict"] == "keep off"


def test_flex_softcap_peer_computes_magis_softcap():
    """The Flex / FA4-through-Flex peers' softcap (``softcap_score_mod``) is magi's: the same tanh
    cap of the scaled logits (flex_attention's forward on the CPU against the torch backend, fp64)."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from magi_kernels import flex_flash_attn_func

    bench_kernels = bench_module("bench_kernels")
    assert bench_kernels.softcap_score_mod(0.0) is None
    torch.manual_seed(0)
    S, hq, hk, d, cap = 64, 4, 2, 16, 2.0
    q, k, v = (torch.randn(S, h, d, dtype=torch.float64) * 2 for h in (hq, hk, hk))
    ours = flex_flash_attn_func(q, k, v, [(0, S)], [(0, S)], [1], backend="torch", softcap=cap)[0]
    bm = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, S, S, device="cpu")
    qf, kf, vf = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    theirs = flex_attention(qf, kf, vf, score_mod=bench_kernels.softcap_score_mod(cap), block_mask=bm,
                            enable_gqa=True)[0].transpose(0, 1)
    uncapped = flex_attention(qf, kf, vf, block_mask=bm, enable_gqa=True)[0].transpose(0, 1)
    assert (uncapped - ours).abs().max() > 1e-2  # the cap matters at these logits
    torch.testing.assert_close(theirs, ours, rtol=1e-10, atol=1e-10)
