"""Hugging Face Transformers backend: ``attn_implementation="magi"``.

The mask lives in a magi key, not in a dense tensor. Without context parallelism the backend
builds the key of each call from what HF passes: the documents (``cu_seq_lens_q``, packed
``position_ids``, or the rows of a padded batch, whose 2-D padding mask reaches it through the
mask function :func:`register_magi` registers) and the layer's own mask (``is_causal``,
``sliding_window`` per layer from ``config.layer_types``, chunked attention), with ``scaling``,
``softcap`` and ``s_aux`` sinks. With a CP group, use :func:`prepare_cp_batch` before the model
(it passes the batch's key as the ``magi_key`` kwarg) and :func:`cp_cross_entropy` after it.
Whatever the backend cannot honour raises an error that names the feature.
"""

from __future__ import annotations

import atexit
import bisect
import contextlib
import contextvars
import functools
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from magi_attn import (
    DistAttnConfig,
    DistAttnKey,
    batch_packing,
    calc_attn,
    dispatch,
    get_position_ids,
    magi_attn_flex_key,
    magi_attn_flex_key_for_new_mask,
    magi_attn_varlen_key,
    undispatch,
)
from magi_kernels import per_tensor
from magi_solver import check_positive_int, varlen_slices

logger = logging.getLogger(__name__)

ATTN_IMPLEMENTATION = "magi"


def _cu_from_position_ids(position_ids: torch.Tensor) -> list[int]:
    """Document starts where a packed position id does not follow its predecessor by 1."""
    pos = position_ids.reshape(-1)
    starts = torch.nonzero(pos[1:] != pos[:-1] + 1).reshape(-1) + 1
    return [0, *starts.tolist(), pos.numel()]


@dataclass(frozen=True)
class LayerMask:
    """The attention pattern of one layer, inside each document (or padded row).

    ``window``: ``(left, right)`` keys on each side (-1 = unbounded), as FlashAttention's
    ``window_size``; ``chunk``: chunked attention (Llama4) with chunks of that many tokens,
    counted from each document's position 0 (HF's ``chunked_overlay`` on packed positions)."""

    causal: bool = True
    window: tuple[int, int] = (-1, -1)
    chunk: int | None = None


# Model types whose "full_attention" layers get HF's sliding-window mask whenever
# config.sliding_window is set (MiniMax: its softmax layers are all "full_attention", beside its
# linear ones, and its model builds them create_sliding_window_causal_mask): the window they pass
# is the one HF applies, not one to drop
_WINDOWED_FULL_ATTENTION = frozenset({"minimax"})


def layer_mask(module: Any, kwargs: dict) -> LayerMask:
    """The mask HF's own (eager / sdpa) path gives this layer, from what the model passes and
    its config: ``is_causal`` (argument, else ``module.is_causal``), ``sliding_window``
    (argument; ``config.layer_types`` decides which layers have one, as HF's masks do) and
    chunked attention (``config.attention_chunk_size`` on ``chunked_attention`` layers)."""
    causal = bool(kwargs["is_causal"]) if kwargs.get("is_causal") is not None else bool(getattr(module, "is_causal", True))
    config = getattr(module, "config", None)
    layer_types = getattr(config, "layer_types", None)
    layer_idx = getattr(module, "layer_idx", None)
    layer_type = layer_types[layer_idx] if layer_types is not None and layer_idx is not None else None
    window = kwargs.get("sliding_window")
    chunk = None
    if layer_type == "full_attention":
        if getattr(config, "model_type", None) not in _WINDOWED_FULL_ATTENTION:
            window = None  # some models pass config.sliding_window to every layer; HF's mask has none here
    elif layer_type == "sliding_attention":
        if window is None:
            window = getattr(config, "sliding_window", None)
            if window is not None and not causal:  # HF's bidirectional mask: |i - j| <= sliding_window
                window += 1
        if window is None:
            raise ValueError(f"layer {layer_idx} is a sliding_attention layer (config.layer_types) but neither the "
                             "sliding_window argument nor config.sliding_window gives its window")
    elif layer_type == "chunked_attention":
        chunk = check_positive_int(getattr(config, "attention_chunk_size", None), "config.attention_chunk_size",
                                   "tokens per attention chunk")
        window = None
    elif layer_type is not None:
        raise ValueError(f"the magi attention backend does not know layer type {layer_type!r} (config.layer_types"
                         f"[{layer_idx}]); it honours full_attention, sliding_attention and chunked_attention")
    elif getattr(config, "attention_chunk_size", None) is not None:  # no layer types: every layer is chunked
        chunk = check_positive_int(config.attention_chunk_size, "config.attention_chunk_size",
                                   "tokens per attention chunk")
    if chunk is not None and not causal:
        raise ValueError("chunked attention with is_causal=False is not a mask HF defines; the magi backend refuses it")
    if window is None:
        return LayerMask(causal, (-1, -1), chunk)
    w = check_positive_int(window, "sliding_window", "keys each query sees, itself included")
    # HF: causal keeps keys i - w < j <= i (w keys with itself); bidirectional |i - j| <= w - 1
    return LayerMask(causal, (w - 1, 0) if causal else (w - 1, w - 1), None)


def _chunked_slices(docs: tuple[tuple[int, int, int], ...], chunk: int) -> list[tuple[int, int, int, int, int]]:
    """Causal attention inside each chunk of each document; chunks of ``chunk`` tokens counted
    from each document's anchor, its position-0 row (``docs``: (start, end, anchor) in packed
    coordinates), as HF's chunked mask counts them."""
    out = []
    for start, end, anchor in docs:
        p = start
        while p < end:
            q = min(end, anchor + ((p - anchor) // chunk + 1) * chunk)
            out.append((p, q, p, q, 1))
            p = q
    return out


def mask_slices(docs: tuple[tuple[int, int, int], ...], mask: LayerMask) -> list[tuple[int, int, int, int, int]]:
    """``(q_start, q_end, k_start, k_end, type)`` slices of ``mask`` over packed documents."""
    if mask.chunk is not None:
        return _chunked_slices(docs, mask.chunk)
    cu = [0]
    for start, end, _ in docs:
        if start != cu[-1]:
            raise AssertionError("documents must tile the packed sequence")
        cu.append(end)
    return [s.to_tuple() for s in varlen_slices(cu, cu, causal=mask.causal, window_size=mask.window)]


@functools.lru_cache(maxsize=64)
def _local_key(docs: tuple[tuple[int, int, int], ...], mask: LayerMask, hq: int, hk: int, d: int) -> DistAttnKey:
    """One key per (documents, layer mask), shared by the layers of a forward with that mask (and
    by later steps with the same packing), instead of re-planning at each attention call."""
    slices = mask_slices(docs, mask)
    total = docs[-1][1] if docs else 0
    return magi_attn_flex_key([s[:2] for s in slices], [s[2:4] for s in slices], [s[4] for s in slices], total, total,
                              hq, hk, d, None, DistAttnConfig(kernel_backend="auto"))


@dataclass(frozen=True)
class _Packing:
    """How a ``[b, s]`` call maps to one packed sequence: ``rows`` (flat ``b*s`` indices of the
    kept tokens, None when all are kept in order) and the packed documents."""

    rows: torch.Tensor | None
    docs: tuple[tuple[int, int, int], ...]


def _packing(b: int, s: int, attention_mask: torch.Tensor | None, kwargs: dict) -> _Packing:
    if attention_mask is not None:
        if attention_mask.dim() != 2 or attention_mask.dtype != torch.bool:
            raise ValueError(
                f"the magi attention backend takes a 2-D boolean padding mask [batch, seq] (HF passes it once "
                f"register_magi() has run), got a {attention_mask.dim()}-D {attention_mask.dtype} attention_mask; "
                "custom 4-D masks are not supported: express the mask as slices (magi_attn_flex_key)")
        return per_tensor(attention_mask, "magi_padding", lambda: _padded_packing(attention_mask[:, -s:]))
    if b != 1:  # no padding: every row is one sequence
        return _Packing(None, tuple((r * s, (r + 1) * s, r * s) for r in range(b)))
    cu, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    pos = kwargs.get("position_ids")
    if cu_k is not None and cu is None:
        raise ValueError("cu_seq_lens_k was passed without cu_seq_lens_q; pass both (the same documents)")
    if cu is not None:
        cu_list = _cu_seqlens_list(cu, "cu_seq_lens_q")
        if cu_k is not None and cu_k is not cu and _cu_seqlens_list(cu_k, "cu_seq_lens_k") != cu_list:
            raise NotImplementedError(
                "cu_seq_lens_k describes other documents than cu_seq_lens_q: the magi Hugging Face backend runs "
                "each packed document's self-attention, so both must be the same; use magi_attn_cross_key for "
                "queries and keys from different sequences")
        anchors = cu_list[:-1]  # chunks count from each document's start
    elif pos is not None:
        cu_list, anchors = per_tensor(pos, "packed_docs", lambda: _docs_from_position_ids(pos))
    else:
        cu_list, anchors = [0, s], [0]
    if cu_list[-1] != s:
        raise ValueError(f"cu_seq_lens_q / position_ids describe {cu_list[-1]} tokens but the call has {s}")
    return _Packing(None, tuple((a, e, r) for a, e, r in zip(cu_list, cu_list[1:], anchors) if e > a))


def _cu_seqlens_list(cu: torch.Tensor, name: str) -> list[int]:
    """The boundaries of a ``cu_seq_lens_*`` tensor as ints (read once per tensor)."""
    if cu.dtype.is_floating_point or cu.dim() != 1:
        raise TypeError(f"{name} must be a 1-D integer tensor, got a {cu.dim()}-D {cu.dtype} tensor")
    return per_tensor(cu, "cu_seqlens", lambda: [int(x) for x in cu.tolist()])


def _docs_from_position_ids(pos: torch.Tensor) -> tuple[list[int], list[int]]:
    """Packed documents of ``position_ids`` and each one's position-0 row: HF maps packed tokens
    to their positions before applying a chunked mask, so chunks count from position 0."""
    cu = _cu_from_position_ids(pos)
    first = pos.reshape(-1)[torch.tensor(cu[:-1], dtype=torch.long, device=pos.device)].tolist()
    return cu, [start - int(p) for start, p in zip(cu, first)]


def _padded_packing(mask: torch.Tensor) -> _Packing:
    """Each row's kept tokens (one contiguous run: left or right padding) become one document."""
    p = batch_packing(mask)
    docs = tuple((a, e, a) for a, e in zip(p.cu_seqlens, p.cu_seqlens[1:]) if e > a)
    return _Packing(p.rows, docs)


@functools.lru_cache(maxsize=64)
def _check_hf_packing(hf: HFPackedSequences, docs: tuple[tuple[int, int, int], ...], chunk: int | None) -> None:
    """Every row where HF's mask starts a sequence (or, with ``chunk``, a chunk) starts one here
    too. Once per (mask, packing): every layer of a forward gets the same two."""
    firsts = [d[0] for d in docs]

    def starts_here(r: int) -> bool:
        i = bisect.bisect_right(firsts, r) - 1
        if i < 0 or r >= docs[i][1]:
            return False
        return r == docs[i][0] or bool(chunk and (r - docs[i][2]) % chunk == 0)

    missing = [r for r in hf.starts if not starts_here(r)]
    if missing:
        raise ValueError(
            f"HF's mask sees packed sequences starting at rows {missing[:8]}, but this attention call got no "
            "position_ids or cu_seq_lens_q that say so (this model does not pass position_ids to its attention "
            "layers); pass cu_seq_lens_q and cu_seq_lens_k to the model (e.g. DataCollatorWithFlattening"
            "(return_flash_attn_kwargs=True)) so the magi backend packs the documents")


def _is_cross_attention(module: Any) -> bool:
    """Whether a layer attends from one sequence to another (an encoder-decoder's or a
    vision-language model's cross-attention), by the marks HF's attention modules carry: a
    ``*CrossAttention`` class (T5Gemma, Mllama, ...), ``is_cross_attention`` (GPT-2, BERT), or a
    non-causal layer of a decoder (BART, Whisper, Marian: ``encoder_attn``)."""
    if "CrossAttention" in type(module).__name__ or getattr(module, "is_cross_attention", False):
        return True
    return bool(getattr(module, "is_decoder", False)) and getattr(module, "is_causal", True) is False


def _check_model_config(config: Any, padded: bool) -> None:
    """Refuse, by name, the model families whose attention selects keys in a way no mask of the
    magi backend expresses (checked when HF builds the model's masks, before any layer runs).
    ``padded``: whether HF hands the layers a padding mask (a 2-D tensor)."""
    model_type = getattr(config, "model_type", None)
    if model_type in ("deepseek_v32", "glm_moe_dsa"):
        raise NotImplementedError(
            f"{model_type} uses DeepSeek sparse attention (DSA): each query attends only to the "
            f"config.index_topk={getattr(config, 'index_topk', None)} keys its indexer picks, a per-query top-k "
            "selection the magi attention backend cannot express as mask slices (it would run dense causal "
            "attention instead); use attn_implementation='eager' or 'sdpa' for this model")
    layer_types = getattr(config, "layer_types", None) or ()
    if model_type == "deepseek_v4":
        compressed = sorted({t for t in layer_types if t != "sliding_attention"})
        if compressed:
            raise NotImplementedError(
                f"deepseek_v4 layers of type {compressed} (config.layer_types) append compressed KV entries, with "
                "their own per-query visibility bias (and, for compressed_sparse_attention, an indexer's top-k), "
                "to the keys; the magi attention backend honours only its sliding_attention layers: use "
                "attn_implementation='eager' or 'sdpa' for this model")
    if model_type == "gemma4_text" and padded and getattr(config, "num_kv_shared_layers", 0):
        raise NotImplementedError(
            "Gemma 4 with KV-shared layers (config.num_kv_shared_layers > 0) slices the attention masks of those "
            "layers as 4-D tensors (Gemma4TextModel._maybe_slice_kv_shared_inputs); the magi backend's padding "
            "mask is 2-D, so it runs such models on unpadded rows only: pack the documents into one row "
            "(position_ids or cu_seq_lens) instead of padding, or use attn_implementation='sdpa' for this model")


_SOFTMAX_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention"})


def _check_cp_layers(module: Any) -> None:
    """Under context parallelism every layer that mixes tokens must see the whole sequence; the
    layers of a hybrid model that do not go through the attention interface (linear attention,
    DeltaNet, ...) would run on this rank's dispatched shard alone."""
    layer_types = getattr(getattr(module, "config", None), "layer_types", None) or ()
    other = sorted({t for t in layer_types if t not in _SOFTMAX_LAYER_TYPES})
    if other:
        raise NotImplementedError(
            f"this model has {other} layers (config.layer_types) besides softmax attention; they do not go "
            "through the attention backend, so under context parallelism they would run on each rank's shard "
            "of the dispatched tokens alone: run it without a CP group (the magi backend covers its softmax "
            "attention layers there)")


# The keyword arguments the backend reads (honours or refuses by value) ...
_READ_KWARGS = frozenset({
    "is_causal", "sliding_window", "softcap", "s_aux", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k",
    "magi_key", "magi_documents", "indices", "output_attentions",
})
# ... and those HF passes through every layer that do not change the attention's result (cache
# and output bookkeeping, loss arguments, a FlashAttention dropout flag with no dropout here, the
# longest document of cu_seq_lens_*: a launch hint for FlashAttention).
_INERT_KWARGS = frozenset({
    "use_cache", "cache_position", "past_key_value", "past_key_values", "position_embeddings",
    "output_hidden_states", "output_router_logits", "return_dict", "deterministic", "num_items_in_batch",
    "logits_to_keep", "max_length_q", "max_length_k",
})
_allowed_kwargs: set[str] = set()


def allow_attention_kwargs(*names: str) -> None:
    """Let the magi backend ignore these keyword arguments of a model's attention call.

    The backend refuses any argument it does not know (with a value other than None), because an
    unknown one may change the attention: a bias, a head mask, a selection of keys. Allow one only
    when you know it does not."""
    for n in names:
        if not isinstance(n, str) or not n:
            raise TypeError(f"allow_attention_kwargs takes argument names (str), got {n!r}")
    _allowed_kwargs.update(names)


def _check_known_kwargs(module: Any, kwargs: dict) -> None:
    unknown = sorted(k for k, v in kwargs.items()
                     if v is not None and k not in _READ_KWARGS and k not in _INERT_KWARGS and k not in _allowed_kwargs)
    if unknown:
        raise NotImplementedError(
            f"{type(module).__name__} passes {unknown} to its attention, which the magi backend does not know; "
            "an unknown argument may change the attention (a bias, a head mask, a key selection), so it is not "
            "dropped silently. If it does not change the result, allow it with "
            f"magi_integrations.hf.allow_attention_kwargs({', '.join(repr(k) for k in unknown)}); otherwise use "
            "attn_implementation='eager' or 'sdpa' for this model")


def _check_call_features(module: Any, dropout: float, kwargs: dict) -> None:
    _check_known_kwargs(module, kwargs)
    if _is_cross_attention(module):
        raise NotImplementedError(
            f"{type(module).__name__} is cross-attention (queries from one sequence, keys from another, e.g. an "
            "encoder-decoder's decoder attending to the encoder): the magi Hugging Face backend runs self-attention "
            "only, and would pair each query with the key at its own position and padding; use another "
            "attn_implementation for this model (magi_attn_cross_key runs cross-attention directly)")
    if dropout:
        raise ValueError("the magi attention backend has no attention dropout; set attention_dropout=0.0 "
                         "(or call model.eval())")
    if kwargs.get("indices") is not None:
        raise NotImplementedError(
            f"{type(module).__name__} passes indices= (a sparse attention's per-query top-k key selection, e.g. "
            "DeepSeek-V3.2's DSA indexer); the magi attention backend cannot honour it and would attend to every "
            "key: use attn_implementation='eager' or 'sdpa' for this model")
    if kwargs.get("output_attentions"):
        raise ValueError("the magi attention backend does not return attention weights (output_attentions=True); "
                         "use attn_implementation='eager' to inspect them")


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
    """HF attention interface: q ``[b, hq, s, d]``, k ``[b, hk, s, d]``, v ``[b, hk, s, dv]`` ->
    ``[b, s, hq, dv]``. Honours ``scaling``, ``softcap``, ``s_aux`` (sinks), ``is_causal``,
    ``sliding_window`` (per layer, with ``config.layer_types``), chunked attention and padding
    masks; anything else a model asks for raises."""
    _check_call_features(module, dropout, kwargs)
    mask = layer_mask(module, kwargs)
    softcap = float(kwargs.get("softcap") or 0.0)
    sink = kwargs.get("s_aux")
    b, hq, s, d = query.shape
    hk = key.shape[1]
    if key.shape[2] != s or value.shape[2] != s:
        raise NotImplementedError(
            f"{type(module).__name__} gave {s} queries against {key.shape[2]} keys / {value.shape[2]} values: the "
            "magi Hugging Face backend runs self-attention over the call's own tokens only (no KV cache, no extra "
            "or compressed KV entries, no queries sliced to logits_to_keep); use another attn_implementation for "
            "this model or call")
    magi_key = kwargs.get("magi_key")
    if magi_key is not None:  # context parallelism: the batch was dispatched by prepare_cp_batch
        _check_cp_layers(module)
        # HF's packing marker only restates the dispatched position ids: the key holds the documents
        if not (attention_mask is None or isinstance(attention_mask, HFPackedSequences)) or b != 1:
            raise ValueError("under context parallelism the batch must be one packed row without padding "
                             "(prepare_cp_batch); drop attention_mask and pack the documents with cu_seqlens")
        rows = None
        docs = kwargs.get("magi_documents")
        if docs is None:
            raise ValueError("magi_key was passed without magi_documents; use CPBatch.model_kwargs() from prepare_cp_batch")
        if (hq, hk, d) != (magi_key.num_heads_q, magi_key.num_heads_kv, magi_key.head_dim):
            raise NotImplementedError(
                f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) has {hq} query / {hk} KV heads "
                f"of dim {d}, but the CP batch was planned for {magi_key.num_heads_q} / {magi_key.num_heads_kv} of "
                f"dim {magi_key.head_dim}: layers with their own head counts or head dims (e.g. MiMo-V2-Flash's "
                "sliding layers, Gemma 4's global_head_dim) are not supported under context parallelism; run "
                "this model without a CP group")
        key_for_layer = cp_layer_key(magi_key, docs, mask)
    else:
        hf_packed = attention_mask if isinstance(attention_mask, HFPackedSequences) else None
        packing = _packing(b, s, None if hf_packed else attention_mask, kwargs)
        if hf_packed is not None:
            _check_hf_packing(hf_packed, packing.docs,
                              getattr(getattr(module, "config", None), "attention_chunk_size", None))
        rows = packing.rows
        key_for_layer = _local_key(packing.docs, mask, hq, hk, d)
    q, k, v = (t.transpose(1, 2).reshape(b * s, t.shape[1], t.shape[3]) for t in (query, key, value))  # [b*s, h, d]
    if rows is not None:
        q, k, v = (t.index_select(0, rows) for t in (q, k, v))
    recorder = _MAX_LOGITS.get()
    out, *rest = calc_attn(q, k, v, key_for_layer, softmax_scale=scaling, softcap=softcap, sink=sink,
                           return_max_logits=recorder is not None)
    if recorder is not None:
        recorder.add(module, rest[1])
    if rows is not None:  # padding rows come back as zeros, in the caller's layout
        out = out.new_zeros((b * s, *out.shape[1:])).index_copy(0, rows, out)
    return out.reshape(b, s, hq, out.shape[-1]), None


class MaxLogits:
    """Per attention module, the largest scaled (softcapped) logit of each query head in the
    forward passes run inside :func:`record_max_logits` (the max over those calls), fp32 ``[hq]``;
    under context parallelism the max over every rank's rows, the same on every rank. For Muon
    QK-clip: after the forward, scale each layer's W_q/W_k rows of the heads above the threshold."""

    def __init__(self) -> None:
        self.by_module: dict[torch.nn.Module, torch.Tensor] = {}

    def add(self, module: torch.nn.Module, max_logits: torch.Tensor) -> None:
        old = self.by_module.get(module)
        self.by_module[module] = max_logits if old is None else torch.maximum(old, max_logits)

    def named(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The recorded values by module name within ``model``."""
        names = {m: n for n, m in model.named_modules()}
        return {names[m]: v for m, v in self.by_module.items() if m in names}


_MAX_LOGITS: contextvars.ContextVar[MaxLogits | None] = contextvars.ContextVar("magi_max_logits", default=None)


@contextlib.contextmanager
def record_max_logits():
    """``with record_max_logits() as rec: loss = model(...).loss`` records, for every layer that
    runs on the magi backend, each query head's largest scaled logit (:class:`MaxLogits`). Costs
    what ``calc_attn(return_max_logits=True)`` costs (one all-gather of ``hq`` floats per layer
    under CP; the Triton forward instead of the Gluon one on sm90 at head dim 128)."""
    rec = MaxLogits()
    token = _MAX_LOGITS.set(rec)
    try:
        yield rec
    finally:
        _MAX_LOGITS.reset(token)


@functools.lru_cache(maxsize=64)
def cp_layer_key(base: DistAttnKey, docs: tuple[tuple[int, int, int], ...], mask: LayerMask) -> DistAttnKey:
    """The key of a layer under context parallelism: the batch's key (``prepare_cp_batch``, the
    causal document mask) or, for another layer mask (window, chunks, bidirectional), a key for
    that mask over the same dispatch, with its own comm plan, built once per batch and mask. Every
    rank runs the same layers in the same order, so each builds (and cross-checks) the same keys."""
    if mask == LayerMask():
        return base
    slices = mask_slices(docs, mask)
    return magi_attn_flex_key_for_new_mask(base, [s[:2] for s in slices], [s[2:4] for s in slices],
                                           [s[4] for s in slices])


# the key caches hold runtimes and their process groups: drop them before the interpreter's teardown
for _cache in (_local_key, cp_layer_key):
    atexit.register(_cache.cache_clear)


def register_magi() -> str:
    """Register ``"magi"`` with transformers' AttentionInterface and, so that padding masks reach
    the backend, a mask function with its AttentionMaskInterface (the 2-D padding mask, or None
    without padding, as for FlashAttention). Idempotent; returns the name. Call before building
    the model (``from_pretrained(..., attn_implementation="magi")``)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, magi_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, magi_padding_mask)
    return ATTN_IMPLEMENTATION


def magi_padding_mask(batch_size: int, q_length: int, kv_length: int, q_offset: Any = 0, kv_offset: int = 0,
                      attention_mask: torch.Tensor | None = None, use_vmap: bool = False, **kwargs: Any):
    """HF mask function of the magi backend: the 2-D padding mask (None without padding), as for
    FlashAttention; the pattern itself is rebuilt from the layer (:func:`layer_mask`). Refuses
    what that would lose: a model's own mask overlay and decoding with a KV cache."""
    from transformers.masking_utils import flash_attention_mask

    if use_vmap:
        raise NotImplementedError(
            "this model adds its own mask overlay (or_mask_function / and_mask_function, e.g. bidirectional "
            "image-token blocks) to HF's attention mask; the magi attention backend cannot honour it: use "
            "attn_implementation='sdpa' or 'flex_attention' for this model")
    if not (isinstance(q_offset, int) and q_offset == 0 and kv_offset == 0):
        raise NotImplementedError("the magi attention backend runs training and prefill without a KV cache "
                                  "(use_cache=False); decode with another attn_implementation")
    if q_length != kv_length:
        raise NotImplementedError(
            f"the magi attention backend got {q_length} queries against {kv_length} keys: decoding with a KV cache "
            "or cross-attention (an encoder-decoder model such as T5Gemma) is not supported by the Hugging Face "
            "backend; use use_cache=False for training and prefill, and another attn_implementation for "
            "cross-attention (magi_attn_cross_key runs cross-attention directly)")
    padding = flash_attention_mask(batch_size, q_length, kv_length, attention_mask=attention_mask, **kwargs)
    if padding is None and batch_size == 1 and q_length > 1 and kwargs.get("mask_function") is not None:
        starts = _hf_sequence_starts(kwargs["mask_function"], q_length)
        if starts:
            padding = HFPackedSequences(starts)
    _check_model_config(kwargs.get("config"), padded=isinstance(padding, torch.Tensor))
    return padding


@dataclass(frozen=True)
class HFPackedSequences:
    """What the mask function hands the attention when HF found packed sequences (from
    ``position_ids``) in an unpadded row: the rows where a new sequence starts. The attention
    checks that it packs the same way (a model that does not pass ``position_ids`` to its
    attention layers would otherwise attend across documents)."""

    starts: tuple[int, ...]

    def __getitem__(self, index: Any) -> HFPackedSequences:
        """Gemma 4 slices every layer mask to the queries it keeps before its KV-shared layers
        (``mask[:, :, -logits_to_keep:, :]``, all of them in training): keeping all is a no-op;
        fewer queries than keys is refused by the attention itself."""
        whole = slice(None), slice(0, None)
        if not (isinstance(index, tuple) and all(isinstance(i, slice) and i in whole for i in index)):
            raise NotImplementedError(
                f"the magi backend's packed-sequence mask cannot be indexed by {index!r} (a model slicing its "
                "attention mask to some queries, e.g. logits_to_keep > 0 before Gemma 4's KV-shared layers); "
                "run the forward with logits_to_keep=0 or use another attn_implementation")
        return self


def _hf_sequence_starts(mask_function: Any, length: int) -> tuple[int, ...]:
    """Rows ``q`` whose HF mask hides key ``q - 1``: sequence starts of a packed row, and chunk
    boundaries of a chunked layer (O(length) evaluations of HF's index-based mask function). A
    mask that hides every one (a one-key window) says nothing and gives none."""
    q = torch.arange(1, length)
    zero = torch.zeros_like(q)
    sees_previous = torch.as_tensor(mask_function(zero, zero, q, q - 1)).reshape(-1)
    if sees_previous.numel() != q.numel() or not bool(sees_previous.any()):
        return ()
    return tuple(q[~sees_previous].tolist())


@dataclass
class CPBatch:
    """A batch prepared for context parallelism: this rank's tokens and the model kwargs."""

    key: DistAttnKey
    input_ids: torch.Tensor  # [1, shard]: this rank's tokens (shards may differ in length)
    position_ids: torch.Tensor  # [1, shard], global positions for RoPE
    labels: torch.Tensor | None  # [1, total] global, shifted target ids (-100 = ignore)
    local_labels: torch.Tensor | None = None  # [1, shard]: this rank's targets, dispatched like its tokens
    documents: tuple[tuple[int, int, int], ...] = ()  # (start, end, position-0 row) of each document

    def model_kwargs(self) -> dict[str, Any]:
        return {"input_ids": self.input_ids, "position_ids": self.position_ids, "magi_key": self.key,
                "magi_documents": self.documents, "use_cache": False}


def prepare_cp_batch(
    input_ids: torch.Tensor,
    cu_seqlens: list[int],
    *,
    num_heads_q: int,
    num_heads_kv: int,
    head_dim: int,
    cp_group: dist.ProcessGroup | DeviceMesh | None,
    config: DistAttnConfig = DistAttnConfig(),
) -> CPBatch:
    """Plan a packed batch ``[1, S]`` of documents (``cu_seqlens``), causal within documents,
    and keep this rank's tokens (ranks may hold different counts). Positions restart at 0 in
    every document (RoPE). ``cp_group``: as in :func:`magi_attn.magi_attn_flex_key` (a process
    group, a 1-D or ``("inter", "intra")`` DeviceMesh, or None)."""
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
        local_labels=dispatch(labels[0], key).unsqueeze(0),
        documents=tuple((int(a), int(b), int(a)) for a, b in zip(cu_seqlens, cu_seqlens[1:]) if b > a),
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
    layers = getattr(model_config, "per_layer_config", None)  # HF's heterogeneous configs (Gemma 4)
    shapes = {(getattr(c, "num_key_value_heads", None), getattr(c, "head_dim", None)) for c in layers or ()}
    if len(shapes) > 1:
        raise NotImplementedError(
            "this model's layers have different KV head counts or head dims (config.per_layer_config, e.g. Gemma 4's "
            "global_head_dim); one CP batch plans one head shape for every layer: run it without context "
            "parallelism, or give every layer the same heads")
    hq = model_config.num_attention_heads
    nope, rope = (getattr(model_config, n, None) for n in ("qk_nope_head_dim", "qk_rope_head_dim"))
    if nope is not None and rope is not None:  # MLA (DeepSeek): the query/key head dim; v has its own
        head_dim = nope + rope
    else:
        head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // hq
    return {
        "num_heads_q": hq,
        "num_heads_kv": getattr(model_config, "num_key_value_heads", None) or hq,
        "head_dim": head_dim,
    }
