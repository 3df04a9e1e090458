"""FSDP2 over dp x cp with magi CP: one optimizer step equals the single-process step on the
mean of the dp batches' losses (checks mesh layout, sharding and the cp loss scale)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dist_harness import run_distributed

pytest.importorskip("transformers")

DP, CP, LR = 2, 2, 0.05


def _batch(dp_rank):
    from magi_integrations.train import synthetic_documents

    return synthetic_documents(96, 96, "varlen_causal", seed=11 + dp_rank)


def _loss(model, ids, cu, cp_group, cfg):
    from magi_integrations.hf import attention_config, gather_logits, prepare_cp_batch

    batch = prepare_cp_batch(ids, cu, cp_group=cp_group, config=cfg, **attention_config(model.config))
    logits = gather_logits(model(**batch.model_kwargs()).logits, batch.key)
    valid = (batch.labels != -100).sum()
    return torch.nn.functional.cross_entropy(logits[0], batch.labels[0], ignore_index=-100, reduction="sum") / valid


def fsdp_worker(rank, world):
    from magi_attn import DispatchConfig, DistAttnConfig, OverlapConfig
    from magi_integrations.fsdp import build_dp_cp_mesh, shard_model
    from hf_llama import tiny_llama
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    cfg = DistAttnConfig(DispatchConfig(chunk_size=6), OverlapConfig(degree=2, min_chunk_size=4), kernel_backend="torch")
    # reference: one process, mean of the two dp batches, plain SGD
    ref = tiny_llama("magi")
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    sum(_loss(ref, *_batch(d), None, cfg) for d in range(DP)).div(DP).backward()
    ref_opt.step()

    mesh = build_dp_cp_mesh(DP, CP)
    assert mesh.cp_group is not None and mesh.dp_rank == rank // CP
    model = shard_model(tiny_llama("magi"), mesh, (LlamaDecoderLayer,))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    loss = _loss(model, *_batch(mesh.dp_rank), mesh.cp_group, cfg)
    (loss * mesh.loss_scale).backward()
    opt.step()
    for (n, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.full_tensor(), r.detach(), atol=1e-10, rtol=0, msg=lambda m, n=n: f"rank {rank} {n}: {m}")


def test_fsdp2_dp2_cp2_step_matches_single_process():
    run_distributed(fsdp_worker, DP * CP)
