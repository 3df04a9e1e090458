"""HF Transformers backend: a tiny Llama built from a config gives the same logits and gradients
with attn_implementation="magi" (packed documents, 1 process and CP over gloo) as with sdpa
run document by document."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dist_harness import run_distributed
from hf_llama import CU, labels_of, loss_of, reference, tiny_llama

transformers = pytest.importorskip("transformers")


def test_single_process_packed_position_ids():
    ref_model, ids, ref_logits = reference()
    loss_of(ref_logits, labels_of(ids)).backward()
    model = tiny_llama("magi")
    pos = torch.cat([torch.arange(b - a) for a, b in zip(CU, CU[1:])])[None]
    logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    torch.testing.assert_close(logits, ref_logits, atol=1e-10, rtol=0)
    loss_of(logits, labels_of(ids)).backward()
    for (n, p), (_, r) in zip(model.named_parameters(), ref_model.named_parameters()):
        torch.testing.assert_close(p.grad, r.grad, atol=1e-10, rtol=0, msg=lambda m, n=n: f"{n}: {m}")


def cp_worker(rank, world, loss_mode="gather"):
    from magi_attn import DispatchConfig, DistAttnConfig, OverlapConfig
    from magi_integrations.hf import attention_config, cp_cross_entropy, gather_logits, prepare_cp_batch

    ref_model, ids, ref_logits = reference()
    labels = labels_of(ids)
    loss_of(ref_logits, labels).backward()
    model = tiny_llama("magi")
    cfg = DistAttnConfig(DispatchConfig(chunk_size=4), OverlapConfig(degree=2, min_chunk_size=4), kernel_backend="torch")
    batch = prepare_cp_batch(ids, CU, cp_group=dist.group.WORLD, config=cfg, **attention_config(model.config))
    assert torch.equal(batch.labels, labels)
    assert len(set(batch.key.runtime.shard_seqlens)) > 1  # 70 tokens in chunks of 4: ranks hold different counts
    if loss_mode == "gather":
        logits = gather_logits(model(**batch.model_kwargs()).logits, batch.key)
        torch.testing.assert_close(logits, ref_logits, atol=1e-10, rtol=0)
        loss_of(logits, batch.labels).backward()
    else:  # each rank's share of the loss from its own logits; the shares sum to the mean loss
        share = cp_cross_entropy(model(**batch.model_kwargs()).logits, batch)
        total = share.detach().clone()
        dist.all_reduce(total)
        n = (labels != -100).sum()
        torch.testing.assert_close(total, loss_of(ref_logits, labels).detach() / n, atol=1e-12, rtol=0)
        (share * n).backward()  # the reference's backward is of the summed loss
    for (n, p), (_, r) in zip(model.named_parameters(), ref_model.named_parameters()):
        g = p.grad.clone()
        dist.all_reduce(g)  # each CP rank holds its tokens' share of the gradient
        torch.testing.assert_close(g, r.grad, atol=1e-10, rtol=0, msg=lambda m, n=n: f"rank {rank} {n}: {m}")


@pytest.mark.parametrize("loss_mode", ["gather", "local"])
@pytest.mark.parametrize("world", [2, 3])
def test_context_parallel_llama_matches_sdpa(world, loss_mode):
    run_distributed(cp_worker, world, loss_mode)


def test_from_pretrained_with_magi(tmp_path):
    """save_pretrained / from_pretrained(..., attn_implementation="magi") works offline."""
    from transformers import LlamaForCausalLM

    ref_model, ids, ref_logits = reference()
    ref_model.save_pretrained(tmp_path)
    model = LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="magi", torch_dtype=torch.float64)
    assert model.config._attn_implementation == "magi"
    pos = torch.cat([torch.arange(b - a) for a, b in zip(CU, CU[1:])])[None]
    logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    torch.testing.assert_close(logits, ref_logits, atol=1e-10, rtol=0)
