"""Hugging Face Transformers backend: ``attn_implementation="magi"``.

The mask lives in a magi key, not in a dense tensor: the attention function ignores
``attention_mask`` and takes the key from the ``magi_key`` forward kwarg (HF passes unknown
model kwargs down to attention). Without a key it derives one for this call from
``cu_seq_lens_q`` or packed ``position_ids`` (no CP), so the backend also works unchanged as a
plain varlen attention. With a CP group, use :func:`prepare_cp_batch` before the model and
:func:`gather_logits` after it.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from magi_attn import DistAttnConfig, DistAttnKey, calc_attn, dispatch, get_position_ids, magi_attn_varlen_key, undispatch
from magi_kernels.host_cache import per_tensor

logger = logging.getLogger(__name__)

ATTN_IMPLEMENTATION = "magi"


def _cu_from_position_ids(position_ids: torch.Tensor) -> list[int]:
    """Document starts where a packed position id does not follow its predecessor by 1."""
    pos = position_ids.reshape(-1)
    starts = torch.nonzero(pos[1:] != pos[:-1] + 1).reshape(-1) + 1
    return [0, *starts.tolist(), pos.numel()]


def _key_for_call(module: Any, query: torch.Tensor, key: torch.Tensor, kwargs: dict) -> DistAttnKey:
    b, hq, s, d = query.shape
    if b != 1:
        raise ValueError(
            f"the magi attention backend takes packed batches of size 1 (got batch {b}); flatten documents "
            "into one row (e.g. transformers.DataCollatorWithFlattening) and pass cu_seq_lens_q or position_ids"
        )
    # every layer gets the same tensor: read it on the host once per forward, not once per layer
    cu = kwargs.get("cu_seq_lens_q")
    pos = kwargs.get("position_ids")
    if cu is not None:
        cu_list = per_tensor(cu, "cu_seqlens", lambda: [int(x) for x in cu.tolist()])
    elif pos is not None:
        cu_list = per_tensor(pos, "packed_doc_starts", lambda: _cu_from_position_ids(pos))
    else:
        cu_list = [0, s]
    causal = bool(getattr(module, "is_causal", True))
    window = getattr(module, "sliding_window", None)
    ws = (window - 1, 0) if (window and causal) else (-1, -1)
    return _local_key(tuple(cu_list), hq, key.shape[1], d, causal and ws == (-1, -1), ws)


@functools.lru_cache(maxsize=64)
def _local_key(cu: tuple[int, ...], hq: int, hk: int, d: int, causal: bool, window: tuple[int, int]) -> DistAttnKey:
    """One key per mask, shared by every layer of a forward (and by later steps with the same
    packing), instead of re-planning at each attention call."""
    return magi_attn_varlen_key(list(cu), list(cu), hq, hk, d, None, causal=causal, window_size=window,
                                dist_attn_config=DistAttnConfig(kernel_backend="auto"))


def magi_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """HF attention interface: q ``[b, hq, s, d]``, k/v ``[b, hk, s, d]`` -> ``[b, s, hq, d]``."""
    if dropout:
        raise ValueError("the magi attention backend has no attention dropout; set attention_dropout=0.0")
    magi_key = kwargs.get("magi_key")
    if magi_key is None:
        magi_key = _key_for_call(module, query, key, kwargs)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [s, h, d]
    out, _ = calc_attn(q, k, v, magi_key, softmax_scale=scaling, softcap=float(getattr(module, "softcap", 0.0) or 0.0))
    return out.unsqueeze(0), None


def register_magi() -> str:
    """Register ``"magi"`` with transformers' AttentionInterface (idempotent); returns the name.
    Call before building the model (``from_pretrained(..., attn_implementation="magi")``)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, magi_attention_forward)
    return ATTN_IMPLEMENTATION


@dataclass
class CPBatch:
    """A batch prepared for context parallelism: this rank's tokens and the model kwargs."""

    key: DistAttnKey
    input_ids: torch.Tensor  # [1, shard]
    position_ids: torch.Tensor  # [1, shard], global positions for RoPE
    labels: torch.Tensor | None  # [1, total] global, shifted target ids (-100 = ignore)
    local_labels: torch.Tensor | None = None  # [1, shard]: this rank's targets, dispatched like its tokens

    def model_kwargs(self) -> dict[str, Any]:
        return {"input_ids": self.input_ids, "position_ids": self.position_ids, "magi_key": self.key, "use_cache": False}


def prepare_cp_batch(
    input_ids: torch.Tensor,
    cu_seqlens: list[int],
    *,
    num_heads_q: int,
    num_heads_kv: int,
    head_dim: int,
    cp_group: dist.ProcessGroup | None,
    config: DistAttnConfig = DistAttnConfig(),
) -> CPBatch:
    """Plan a packed batch ``[1, S]`` of documents (``cu_seqlens``), causal within documents,
    and keep this rank's tokens. Positions restart at 0 in every document (RoPE)."""
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must be [1, total_tokens] (packed), got {tuple(input_ids.shape)}")
    S = input_ids.shape[1]
    if cu_seqlens[-1] != S:
        raise ValueError(f"cu_seqlens ends at {cu_seqlens[-1]} but input_ids has {S} tokens")
    key = magi_attn_varlen_key(cu_seqlens, cu_seqlens, num_heads_q, num_heads_kv, head_dim, cp_group,
                               causal=True, dist_attn_config=config)
    doc_pos = torch.cat([torch.arange(b - a) for a, b in zip(cu_seqlens, cu_seqlens[1:])]).to(input_ids.device)
    global_rows = get_position_ids(key).to(input_ids.device)
    labels = input_ids.clone()
    labels[:, :-1] = input_ids[:, 1:]
    labels[:, -1] = -100
    ends = torch.tensor(cu_seqlens[1:], device=input_ids.device) - 1
    labels[0, ends] = -100  # no target across document boundaries
    return CPBatch(
        key=key,
        input_ids=dispatch(input_ids[0], key).unsqueeze(0),
        position_ids=doc_pos[global_rows].unsqueeze(0),
        labels=labels,
        local_labels=dispatch(labels[0], key, pad_value=-100).unsqueeze(0),
    )


def cp_cross_entropy(logits_local: torch.Tensor, batch: CPBatch) -> torch.Tensor:
    """This rank's share of the mean next-token loss of the whole packed sequence, from its own
    logits ``[1, shard, V]`` and ``batch.local_labels``: memory O(shard x vocab), no logits gather.

    Summed over the CP ranks it equals the mean loss of the full logits (every rank knows the
    global number of targets, so no collective is needed), and each rank's backward gives its
    tokens' share of the gradient, as with :func:`gather_logits`. With FSDP or DDP over dp x cp
    ranks, scale it by ``cp`` (``DpCpMesh.loss_scale``) so their average is the mean over dp."""
    if batch.local_labels is None or batch.labels is None:
        raise ValueError("batch has no labels: build it with prepare_cp_batch")
    logits = logits_local[0]
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()  # the softmax of a 16-bit vocab row loses the loss's precision
    targets = (batch.labels != -100).sum().clamp(min=1)
    return torch.nn.functional.cross_entropy(logits, batch.local_labels[0], ignore_index=-100, reduction="sum") / targets


def gather_logits(logits_local: torch.Tensor, key: DistAttnKey) -> torch.Tensor:
    """``[1, shard, V]`` -> ``[1, total, V]`` in global order (differentiable). Every rank then
    holds the whole sequence's logits (O(total x vocab) memory): for the loss, use
    :func:`cp_cross_entropy` instead."""
    return undispatch(logits_local[0], key).unsqueeze(0)


def attention_config(model_config: Any) -> dict[str, int]:
    """Head counts of a HF config, for :func:`prepare_cp_batch`."""
    hq = model_config.num_attention_heads
    return {
        "num_heads_q": hq,
        "num_heads_kv": getattr(model_config, "num_key_value_heads", None) or hq,
        "head_dim": getattr(model_config, "head_dim", None) or model_config.hidden_size // hq,
    }
