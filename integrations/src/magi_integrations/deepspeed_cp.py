"""DeepSpeed with magi context parallelism.

DeepSpeed treats every rank as data parallel and averages gradients over all of them. With CP,
each rank of a CP group computes the full (undispatched) loss but only its own tokens'
gradient, so scaling the loss by ``cp`` makes DeepSpeed's average equal the mean over the real
data-parallel batches (the same rule as FSDP2, :class:`magi_integrations.fsdp.DpCpMesh`).
On CPU, DeepSpeed runs with ``DS_ACCELERATOR=cpu`` over gloo; ZeRO stages 0-2 work there,
fused optimizers and ZeRO-3 offload need a GPU build of DeepSpeed.
"""

from __future__ import annotations

from typing import Any

import torch


def deepspeed_config(micro_batch: int, world: int, zero_stage: int = 1, grad_clip: float = 1.0) -> dict[str, Any]:
    """A minimal engine config; the optimizer is passed to ``deepspeed.initialize`` directly so
    the CPU path needs no compiled ops."""
    if zero_stage not in (0, 1, 2):
        raise ValueError(f"zero_stage must be 0, 1 or 2 for CP training here, got {zero_stage}")
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "train_batch_size": micro_batch * world,
        "gradient_clipping": grad_clip,
        "zero_optimization": {"stage": zero_stage},
        "steps_per_print": 1 << 30,
    }


def init_engine(model: torch.nn.Module, optimizer: torch.optim.Optimizer, world: int, zero_stage: int = 1):
    import deepspeed

    engine, opt, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=deepspeed_config(1, world, zero_stage), dist_init_required=False
    )
    return engine, opt
