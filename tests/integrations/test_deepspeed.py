"""A DeepSpeed engine step of the tiny Llama with magi CP on 2 gloo processes equals the
single-process gradient (CPU accelerator)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from dist_harness import run_distributed

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")


def ds_worker(rank, world):
    os.environ["DS_ACCELERATOR"] = "cpu"
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))  # what a launcher sets
    from magi_attn import DispatchConfig, DistAttnConfig, OverlapConfig
    from magi_integrations.deepspeed_cp import init_engine
    from magi_integrations.hf import attention_config, gather_logits, prepare_cp_batch
    from hf_llama import CU, labels_of, loss_of, reference, tiny_llama

    # DeepSpeed reduces fp16/bf16/fp32 gradients only: fp32 here, tolerance for fp32 summation order
    ref_model, ids, ref_logits = reference(torch.float32)
    loss_of(ref_logits, labels_of(ids)).backward()
    model = tiny_llama("magi", torch.float32)
    engine, _ = init_engine(model, torch.optim.SGD(model.parameters(), lr=0.0), world, zero_stage=0)
    cfg = DistAttnConfig(DispatchConfig(chunk_size=5), OverlapConfig(degree=1), kernel_backend="torch")
    batch = prepare_cp_batch(ids, CU, cp_group=dist.group.WORLD, config=cfg, **attention_config(model.config))
    logits = gather_logits(engine(**batch.model_kwargs()).logits, batch.key)
    engine.backward(loss_of(logits, batch.labels) * world)  # cp = world here; DeepSpeed averages
    for (n, p), (_, r) in zip(engine.module.named_parameters(), ref_model.named_parameters()):
        torch.testing.assert_close(p.grad, r.grad, atol=2e-5, rtol=1e-4, msg=lambda m, n=n: f"rank {rank} {n}: {m}")
    engine.step()


def test_deepspeed_engine_step_with_cp():
    run_distributed(ds_worker, 2)
