"""The apps run the way the ecosystem runs: under torchrun (one host or several) and by starting
their own workers, with the same results; the CLI keeps stdout for its JSON and reports errors in
one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from magi_attn.launch import free_port

RUN = ["run", "--seqlen", "256", "--iters", "1", "--dtype", "fp64", "--heads-q", "4", "--heads-kv", "2",
       "--head-dim", "16", "--mask", "causal", "--cpu"]
TIMEOUT = 240


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _magi_attn(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "magi_attn.cli", *args], capture_output=True, text=True,
                          timeout=TIMEOUT, env=_env())


def _torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


def _report(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "leaked semaphore" not in proc.stderr, proc.stderr[-2000:]
    report = json.loads(proc.stdout)  # stdout holds the JSON and nothing else
    assert report["ok"], report
    return report


@pytest.fixture(scope="module")
def spawned() -> dict:
    report = _report(_magi_attn(*RUN, "--cp", "2"))
    assert report["launched"] is False and report["cp"] == 2
    return report


def test_torchrun_one_host_matches_the_spawned_run(spawned):
    proc = subprocess.run(_torchrun("--nproc-per-node", "2", "--master-port", str(free_port()), "-m", "magi_attn.cli",
                                    *RUN), capture_output=True, text=True, timeout=TIMEOUT, env=_env())
    report = _report(proc)
    assert report["launched"] is True and report["cp"] == 2
    assert report["max_abs_err_vs_fp64"] == spawned["max_abs_err_vs_fp64"]
    assert report["imbalance"] == spawned["imbalance"]


def _wait_together(procs: list[subprocess.Popen], logs: list) -> list[tuple[str, str]]:
    """Wait for all; once one fails (or the time is up) the others are killed instead of
    waiting for a rendezvous that can no longer complete. Returns each one's (stdout, stderr)."""
    import time

    deadline = time.monotonic() + TIMEOUT
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
            for p in procs:
                p.kill()
        time.sleep(0.2)
    return [(out.read_text(), err.read_text()) for out, err in logs]


def test_torchrun_two_hosts_rendezvous_from_the_environment(spawned, tmp_path):
    """Two torchrun agents (--nnodes 2) meet at MASTER_ADDR:MASTER_PORT, as on two hosts."""
    port = str(free_port())
    logs = [(tmp_path / f"out{n}", tmp_path / f"err{n}") for n in range(2)]
    procs = [subprocess.Popen(_torchrun("--nnodes", "2", "--node-rank", str(n), "--nproc-per-node", "1",
                                        "--master-addr", "127.0.0.1", "--master-port", port, "-m", "magi_attn.cli", *RUN),
                              stdout=open(logs[n][0], "w"), stderr=open(logs[n][1], "w"), env=_env())
             for n in range(2)]
    outs = _wait_together(procs, logs)
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    report = json.loads(outs[0][0])
    assert outs[1][0].strip() == ""  # only global rank 0 reports
    assert report["cp"] == 2 and report["max_abs_err_vs_fp64"] == spawned["max_abs_err_vs_fp64"]


def test_cp_that_disagrees_with_torchrun_is_refused():
    proc = subprocess.run(_torchrun("--nproc-per-node", "2", "--master-port", str(free_port()), "-m", "magi_attn.cli",
                                    *RUN, "--cp", "3"), capture_output=True, text=True, timeout=TIMEOUT, env=_env())
    assert proc.returncode != 0
    assert "--cp 3 disagrees with the launcher's WORLD_SIZE=2" in proc.stderr


def test_errors_are_one_line_without_a_traceback():
    proc = _magi_attn(*RUN, "--cp", "2", "--heads-q", "3")
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("magi-attn run: error:") and "num_heads_q=3" in last, last
    assert proc.stdout == ""


def test_debug_shows_the_traceback():
    proc = _magi_attn("--debug", *RUN, "--cp", "2", "--heads-q", "3")
    assert proc.returncode != 0 and "Traceback" in proc.stderr


@pytest.mark.parametrize("args,message", [
    (["run", "--iters", "0"], "--iters: must be a positive integer"),
    (["run", "--cp", "0"], "--cp: must be a positive integer"),
    (["plan", "--degree", "-1"], "--degree: must be an integer >= 0"),
    (["run", "--timeout", "nan"], "--timeout: must be a finite number > 0"),
])
def test_bad_arguments_name_the_flag(args, message):
    proc = _magi_attn(*args)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_version_and_plan_json():
    from magi_attn import __version__

    proc = _magi_attn("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"magi-attn {__version__}"
    plan = _magi_attn("plan", "--mask", "causal", "--seqlen", "256", "--cp", "2")
    assert plan.returncode == 0 and json.loads(plan.stdout)["cp_size"] == 2
