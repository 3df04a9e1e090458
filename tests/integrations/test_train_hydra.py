"""Hydra app: composed configs, validation errors, and CP + FSDP2 training runs on gloo."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
from hydra import compose, initialize_config_module  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from magi_integrations.config import register_configs  # noqa: E402
from magi_integrations.train import resolve, run  # noqa: E402

register_configs()


def _compose(*overrides):
    with initialize_config_module(config_module="magi_integrations.conf", version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides))


def test_defaults_and_overrides():
    cfg = resolve(_compose())
    assert (cfg.parallel.dp, cfg.parallel.cp, cfg.cp.backend, cfg.mask.name) == (1, 4, "magi", "varlen_causal")
    cfg = resolve(_compose("parallel=cpu_dp2_cp2", "mask.seqlen=512", "cp.overlap_degree=2"))
    assert (cfg.parallel.dp, cfg.parallel.cp, cfg.mask.seqlen, cfg.cp.overlap_degree) == (2, 2, 512, 2)
    assert type(cfg.parallel).__name__ == "ParallelConfig"


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["cp=none"], "cp.backend=none needs parallel.cp=1"),
        (["model.num_heads=3"], "multiple of model.num_heads"),
        (["mask.name=diagonal"], "mask.name must be one of"),
        (["dtype=int8"], "dtype must be one of"),
        (["parallel.dp=0"], "parallel.dp must be a positive int"),
        (["mask.seqlen=100000"], "exceeds model.max_position_embeddings"),
        (["cp.comm_backend=nccl"], "cp.comm_backend must be one of"),
        (["cp.ranks_per_node=0"], "ranks_per_node"),
        (["parallel.cp=0"], "parallel.cp must be a positive int"),
        (["cp.overlap_degree=-1"], "cp.overlap_degree must be an int >= 0"),
        (["cp.comm_timeout_s=0"], "cp.comm_timeout_s must be"),
        (["mask.seqlen=1"], "mask.seqlen=1 is too short to train"),
    ],
)
def test_validation_errors(overrides, match):
    with pytest.raises(ValueError, match=match):
        resolve(_compose(*overrides))


def test_deterministic_takes_a_bool():
    with pytest.raises(Exception, match="cp.deterministic=maybe"):  # OmegaConf's own type check names it
        _compose("cp.deterministic=maybe")
    assert resolve(_compose("cp.deterministic=true")).cp.deterministic is True


def test_unknown_key_is_rejected():
    with pytest.raises(Exception, match="nope"):
        _compose("model.nope=1")


def test_cp_training_matches_single_process_and_learns():
    common = ["mask.seqlen=384", "steps=3", "dtype=float64", "model.hidden_size=32", "model.intermediate_size=64",
              "cp.chunk_size=16"]
    single = run(_compose("parallel=single", "cp=none", *common))
    cp = run(_compose("parallel=cpu_dp2_cp2", *common, "cp.overlap_degree=2"))
    # dp=2 averages two different batches: compare the cp=2,dp=1 run to the single process instead
    cp_only = run(_compose("parallel.cp=2", *common))
    for a, b in zip(single["losses"], cp_only["losses"]):
        assert abs(a - b) < 1e-9, (single["losses"], cp_only["losses"])
    # packed short documents can land whole on one rank (no remote KV at all); a causal mask
    # makes every rank fetch KV: through all_to_all and the two-hop path (2 ranks = 2 "nodes")
    single_c = run(_compose("parallel=single", "cp=none", *common, "mask.name=causal"))
    for extra in ([], ["cp.comm_backend=hier", "cp.ranks_per_node=1"], ["cp.deterministic=true"]):
        other = run(_compose("parallel.cp=2", *common, "mask.name=causal", *extra))
        for a, b in zip(single_c["losses"], other["losses"]):
            assert abs(a - b) < 1e-9, (extra, single_c["losses"], other["losses"])
    assert cp["last_loss"] < cp["first_loss"]
    assert OmegaConf.create({"ok": True}).ok


def test_cp_without_fsdp_averages_gradients_like_the_single_process():
    common = ["mask.seqlen=256", "steps=3", "dtype=float64", "model.hidden_size=32", "model.intermediate_size=64",
              "cp.chunk_size=16", "mask.name=causal"]
    single = run(_compose("parallel=single", "cp=none", *common))
    no_fsdp = run(_compose("parallel.cp=2", "parallel.fsdp=false", *common))
    for a, b in zip(single["losses"], no_fsdp["losses"]):
        assert abs(a - b) < 1e-9, (single["losses"], no_fsdp["losses"])


@pytest.mark.parametrize("overrides,error", [
    (["mask.seqlen=7"], "mask.seqlen=7 is too short to train"),  # documents of one token: nothing to predict
    (["lr=1e30", "steps=4"], "the loss is nan"),
])
def test_runs_that_cannot_train_stop_with_an_error(overrides, error):
    with pytest.raises(Exception, match=error):
        run(_compose("parallel.cp=2", "model.hidden_size=32", "model.intermediate_size=64", *overrides))


def _train_cli(tmp_path, name: str, launcher: list[str]) -> str:
    import os
    import subprocess

    run_dir = tmp_path / name
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run(
        [*launcher, "-m", "magi_integrations.train", "parallel.cp=2", "steps=2", "mask.seqlen=128", "dtype=float64",
         "model.hidden_size=32", "model.intermediate_size=64", f"hydra.run.dir={run_dir}"],
        capture_output=True, text=True, timeout=300, env={**env, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "leaked semaphore" not in proc.stderr, proc.stderr[-2000:]
    assert {"rank0.log", "rank1.log"} <= {p.name for p in run_dir.iterdir()}
    assert "step 1 loss" in (run_dir / "rank0.log").read_text()
    return [line for line in proc.stdout.splitlines() if line.startswith("loss ")][0]


def test_magi_train_spawned_and_under_torchrun_give_the_same_losses(tmp_path):
    import sys

    from magi_attn.launch import free_port

    spawned = _train_cli(tmp_path, "spawned", [sys.executable])
    launched = _train_cli(tmp_path, "torchrun", [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                                                 "2", "--master-port", str(free_port())])
    assert spawned.split(",")[0] == launched.split(",")[0], (spawned, launched)  # "loss a -> b over 2 steps"
