"""Hydra app: train a tiny Llama with magi context parallelism (and FSDP2) for N steps.

``magi-train`` (defaults: 4 CPU processes with gloo, cp=4, packed varlen-causal documents of
4096 tokens) logs loss and tokens/s with a progress bar. Override anything from the command line:
``magi-train parallel=cpu_dp2_cp2 mask.seqlen=8192 steps=50 cp.overlap_degree=2``. Under
``torchrun --nproc-per-node N --no-python magi-train ...`` each process is one rank (N must be
``parallel.dp * parallel.cp``); without a launcher the app starts its own local workers.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from typing import Any

import torch

from magi_attn import WorkerEnv, exit_worker, init_worker, launched_env, run_workers

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
    from magi_attn import cu_seqlens_of, sample_doc_lengths

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


def _log_to(log_dir: str | None, rank: int) -> None:
    """Send this worker's log records to ``<log_dir>/rank<r>.log`` (the Hydra run's folder): a
    spawned worker does not inherit the handlers Hydra gave the main process."""
    if not log_dir:
        return
    handler = logging.FileHandler(os.path.join(log_dir, f"rank{rank}.log"))
    handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
    for name in ("magi_integrations", "magi_attn", "magi_comm", "magi_kernels"):
        lg = logging.getLogger(name)
        lg.addHandler(handler)
        lg.setLevel(logging.INFO)


def _worker(env: WorkerEnv, cfg: TrainConfig, log_dir: str | None) -> dict[str, Any] | None:
    """One rank of the training run; rank 0 returns the losses and step times."""
    import torch.distributed as dist
    from tqdm import tqdm

    from magi_attn import DispatchConfig, DistAttnConfig, OverlapConfig

    from .fsdp import build_dp_cp_mesh, shard_model
    from .hf import attention_config, cp_cross_entropy, prepare_cp_batch

    _log_to(log_dir, env.rank)
    p = cfg.parallel
    use_cuda = p.device == "cuda"
    device = init_worker(env, use_cuda, cfg.cp.comm_timeout_s)
    world = env.world_size
    if world != p.dp * p.cp:
        raise ValueError(f"parallel.dp * parallel.cp = {p.dp * p.cp} processes, but {world} were launched; "
                         "set torchrun's --nproc-per-node x --nnodes to dp * cp")
    dtype = getattr(torch, cfg.dtype)
    mesh = build_dp_cp_mesh(p.dp, p.cp, "cuda" if use_cuda else "cpu")
    # attention is always magi (exact packed-document masks); cp.backend=none just means
    # no CP group, i.e. every rank attends over its whole sequence
    cp_group = mesh.cp_group if cfg.cp.backend == "magi" else None
    model = build_model(cfg, "magi", dtype, device)
    if world > 1 and p.fsdp:
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        shard_model(model, mesh, (LlamaDecoderLayer,))
        train_model = model
    elif world > 1:
        # without FSDP the gradients are still averaged over every rank (dp x cp), as FSDP would:
        # each CP rank holds only its tokens' share of the gradient (see DpCpMesh.loss_scale)
        train_model = torch.nn.parallel.DistributedDataParallel(model, process_group=mesh.flat.get_group())
    else:
        train_model = model
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    acfg = DistAttnConfig(DispatchConfig(chunk_size=cfg.cp.chunk_size), OverlapConfig(degree=cfg.cp.overlap_degree),
                          kernel_backend=cfg.cp.kernel_backend, comm_backend=cfg.cp.comm_backend,
                          ranks_per_node=cfg.cp.ranks_per_node, comm_timeout_s=cfg.cp.comm_timeout_s,
                          deterministic=cfg.cp.deterministic)
    losses, times = [], []
    for step in tqdm(range(cfg.steps), desc="train", disable=not env.is_main, file=sys.stderr):
        ids, cu = synthetic_documents(cfg.mask.seqlen, cfg.model.vocab_size, cfg.mask.name,
                                      cfg.mask.seed + 1000 * step + mesh.dp_rank)
        ids = ids.to(device)
        t0 = time.perf_counter()
        batch = prepare_cp_batch(ids, cu, cp_group=cp_group, config=acfg, **attention_config(model.config))
        # each rank's share of its dp group's loss, from its own logits only (no [S, vocab] gather)
        loss = cp_cross_entropy(train_model(**batch.model_kwargs()).logits, batch)
        valid = (batch.labels != -100).sum()
        # one all-reduce gives every rank the mean loss and whether any rank had nothing to
        # predict, so all ranks stop together (before a backward that would spread a NaN)
        stats = torch.stack([loss.detach().double(), (valid == 0).double()])
        dist.all_reduce(stats)
        mean_loss = stats[0].item() / p.dp  # the CP ranks' shares sum to their dp group's loss
        if stats[1].item() > 0:
            raise ValueError(f"mask.seqlen={cfg.mask.seqlen} is too short to train: at step {step} a batch has no "
                             "token whose next token is in the same document; raise mask.seqlen")
        if not math.isfinite(mean_loss):
            raise FloatingPointError(f"the loss is {mean_loss} at step {step}: stopping the run (lower lr={cfg.lr}, "
                                     f"or use dtype=float32 instead of {cfg.dtype})")
        (loss * mesh.loss_scale).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if use_cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        losses.append(mean_loss)
        times.append(dt)
        if env.is_main:
            logger.info("step %d loss %.5f tokens/s %.0f", step, mean_loss, cfg.mask.seqlen * p.dp / dt)
    return {"losses": losses, "step_s": times} if env.is_main else None


def run(cfg: Any, log_dir: str | None = None) -> dict[str, Any] | None:
    """Train with a (composed or dataclass) config. Returns rank 0's losses, step times and
    tokens/s (None on the other ranks of a torchrun launch). Under torchrun this process is one
    rank; otherwise it starts ``parallel.dp * parallel.cp`` local workers. ``log_dir`` receives
    each worker's log (``rank<r>.log``)."""
    tc = resolve(cfg)
    world = tc.parallel.dp * tc.parallel.cp
    env = launched_env()
    if env is None and tc.parallel.device == "cuda" and torch.cuda.device_count() < world:
        raise ValueError(f"parallel.device=cuda needs {world} GPUs, found {torch.cuda.device_count()}")
    logger.info("training: %s", tc)
    out = run_workers(_worker, world, tc, log_dir)
    if out is None:
        return None
    tokens = tc.mask.seqlen * tc.parallel.dp
    med = sorted(out["step_s"])[len(out["step_s"]) // 2]
    out.update(first_loss=out["losses"][0], last_loss=out["losses"][-1], tokens_per_s=tokens / med)
    logger.info("loss %.4f -> %.4f over %d steps, %s tokens/s (median step, dp=%d cp=%d)", out["first_loss"],
                out["last_loss"], tc.steps, f"{out['tokens_per_s']:,.0f}", tc.parallel.dp, tc.parallel.cp)
    return out


def main() -> None:
    import hydra

    register_configs()

    @hydra.main(config_path="conf", config_name="train", version_base="1.3")
    def _app(cfg) -> float | None:
        from hydra.core.hydra_config import HydraConfig

        out = run(cfg, HydraConfig.get().runtime.output_dir)
        if out is None:  # a torchrun rank other than 0
            return None
        print(f"loss {out['first_loss']:.4f} -> {out['last_loss']:.4f} over {len(out['losses'])} steps, "
              f"{out['tokens_per_s']:,.0f} tokens/s")
        return out["last_loss"]  # the objective a Hydra sweeper minimises

    _app()
    if launched_env() is not None:  # a torchrun rank: leave without the teardown gloo's threads can abort
        exit_worker(0)


if __name__ == "__main__":
    main()
