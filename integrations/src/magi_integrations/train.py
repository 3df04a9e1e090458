"""Hydra app: train a tiny Llama with magi context parallelism (and FSDP2) for N steps.

``magi-train`` (defaults: 4 CPU processes with gloo, cp=4, packed varlen-causal documents of
4096 tokens) logs loss and tokens/s with a progress bar. Override anything from the command line:
``magi-train parallel=cpu_dp2_cp2 mask.seqlen=8192 steps=50 cp.degree=2``.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import sys
import time
from typing import Any

import torch

from magi_attn.launch import finish_worker, free_port

from .config import TrainConfig, register_configs

logger = logging.getLogger("magi_integrations.train")


def resolve(cfg: Any) -> TrainConfig:
    """OmegaConf config -> validated dataclasses (runs every ``__post_init__`` check)."""
    from omegaconf import OmegaConf

    obj = OmegaConf.to_object(cfg) if not isinstance(cfg, TrainConfig) else cfg
    return obj.validate()


def synthetic_documents(total: int, vocab: int, mask: str, seed: int) -> tuple[torch.Tensor, list[int]]:
    """Packed documents whose next token is (token + stride) mod vocab: learnable, so the loss
    falls, and every document starts at a random token."""
    from magi_attn.masks import cu_seqlens_of, sample_doc_lengths

    g = torch.Generator().manual_seed(seed)
    lengths = sample_doc_lengths(total, seed) if mask == "varlen_causal" else [total]
    parts = []
    for n in lengths:
        start = torch.randint(0, vocab, (1,), generator=g)
        stride = torch.randint(1, 4, (1,), generator=g)
        parts.append((start + stride * torch.arange(n)) % vocab)
    return torch.cat(parts)[None], cu_seqlens_of(lengths)


def build_model(cfg: TrainConfig, attn: str, dtype: torch.dtype, device: torch.device):
    from transformers import LlamaConfig, LlamaForCausalLM

    from .hf import register_magi

    register_magi()
    m = cfg.model
    hf_cfg = LlamaConfig(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads,
        max_position_embeddings=m.max_position_embeddings, attention_dropout=0.0,
    )
    hf_cfg._attn_implementation = attn
    torch.manual_seed(cfg.seed)  # same initial weights on every rank
    model = LlamaForCausalLM(hf_cfg).to(device=device, dtype=dtype)
    model.config._attn_implementation = attn
    return model


def _worker(rank: int, cfg: TrainConfig, port: int, world: int, results_path: str) -> None:
    import torch.distributed as dist
    from tqdm import tqdm

    from magi_attn import DispatchConfig, DistAttnConfig, OverlapConfig

    from .fsdp import build_dp_cp_mesh, shard_model
    from .hf import attention_config, gather_logits, prepare_cp_batch

    p = cfg.parallel
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    use_cuda = p.device == "cuda"
    if use_cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world)
    try:
        device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
        dtype = getattr(torch, cfg.dtype)
        mesh = build_dp_cp_mesh(p.dp, p.cp, "cuda" if use_cuda else "cpu")
        # attention is always magi (exact packed-document masks); cp.backend=none just means
        # no CP group, i.e. every rank attends over its whole sequence
        cp_group = mesh.cp_group if cfg.cp.backend == "magi" else None
        model = build_model(cfg, "magi", dtype, device)
        if p.fsdp and world > 1:
            from transformers.models.llama.modeling_llama import LlamaDecoderLayer

            shard_model(model, mesh, (LlamaDecoderLayer,))
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        acfg = DistAttnConfig(DispatchConfig(chunk_size=cfg.cp.chunk_size), OverlapConfig(degree=cfg.cp.degree),
                              kernel_backend=cfg.cp.kernel_backend, comm_backend=cfg.cp.comm_backend,
                              ranks_per_node=cfg.cp.ranks_per_node)
        losses, times = [], []
        bar = tqdm(range(cfg.steps), desc="train", disable=rank != 0, file=sys.stdout)
        for step in bar:
            ids, cu = synthetic_documents(cfg.mask.seqlen, cfg.model.vocab_size, cfg.mask.name,
                                          cfg.mask.seed + 1000 * step + mesh.dp_rank)
            ids = ids.to(device)
            t0 = time.perf_counter()
            batch = prepare_cp_batch(ids, cu, cp_group=cp_group, config=acfg, **attention_config(model.config))
            logits = gather_logits(model(**batch.model_kwargs()).logits, batch.key)
            valid = (batch.labels != -100).sum()
            loss = torch.nn.functional.cross_entropy(
                logits[0].float(), batch.labels[0], ignore_index=-100, reduction="sum") / valid
            (loss * mesh.loss_scale).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if use_cuda:
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)
            mean_loss = mean_loss.item() / world  # every CP rank holds its dp group's loss
            losses.append(mean_loss)
            times.append(dt)
            tok_s = cfg.mask.seqlen * p.dp / dt
            bar.set_postfix(loss=f"{mean_loss:.4f}", tok_s=f"{tok_s:,.0f}")
            if rank == 0:
                logger.info("step %d loss %.5f tokens/s %.0f", step, mean_loss, tok_s)
        if rank == 0:  # a file, not a queue: workers leave with os._exit (see finish_worker)
            with open(results_path, "w") as f:
                json.dump({"losses": losses, "step_s": times}, f)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    finish_worker()


def run(cfg: Any) -> dict[str, Any]:
    """Train with a (composed or dataclass) config; returns rank 0's losses and step times."""
    import torch.multiprocessing as mp

    tc = resolve(cfg)
    world = tc.parallel.dp * tc.parallel.cp
    if tc.parallel.device == "cuda" and torch.cuda.device_count() < world:
        raise ValueError(f"parallel.device=cuda needs {world} GPUs, found {torch.cuda.device_count()}")
    fd, results_path = tempfile.mkstemp(prefix="magi-train-", suffix=".json")
    os.close(fd)
    logger.info("training: %s", tc)
    try:
        mp.start_processes(_worker, args=(tc, free_port(), world, results_path), nprocs=world, start_method="spawn")
        with open(results_path) as f:
            out = json.load(f)
    finally:
        os.unlink(results_path)
    tokens = tc.mask.seqlen * tc.parallel.dp
    med = sorted(out["step_s"])[len(out["step_s"]) // 2]
    out.update(first_loss=out["losses"][0], last_loss=out["losses"][-1], tokens_per_s=tokens / med)
    print(f"loss {out['first_loss']:.4f} -> {out['last_loss']:.4f} over {tc.steps} steps, "
          f"{out['tokens_per_s']:,.0f} tokens/s (median step, dp={tc.parallel.dp} cp={tc.parallel.cp})")
    return out


def main() -> None:
    import hydra

    register_configs()

    @hydra.main(config_path="conf", config_name="train", version_base="1.3")
    def _app(cfg) -> None:
        run(cfg)

    _app()


if __name__ == "__main__":
    main()
