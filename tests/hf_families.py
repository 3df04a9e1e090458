"""Tiny models of the Hugging Face families whose attention has a feature a backend can drop:
sliding windows (per layer from ``layer_types``), softcap, sinks, chunked attention,
bidirectional layers, MLA. Built from their Config classes (no downloads), float64."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch

COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, attention_dropout=0.0, tie_word_embeddings=False)
SWA = ["sliding_attention", "full_attention"]


@dataclass(frozen=True)
class Family:
    config: str
    model: str
    kwargs: dict = field(default_factory=dict)
    causal_lm: bool = True  # False: an encoder (masked LM), bidirectional


FAMILIES: dict[str, Family] = {
    "llama": Family("LlamaConfig", "LlamaForCausalLM"),
    "qwen3": Family("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=8)),
    "mistral": Family("MistralConfig", "MistralForCausalLM", dict(sliding_window=5)),
    "phi3": Family("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=5, pad_token_id=0)),
    "qwen2_sliding": Family("Qwen2Config", "Qwen2ForCausalLM",
                            dict(use_sliding_window=True, sliding_window=5, max_window_layers=1, layer_types=SWA)),
    "gemma2": Family("Gemma2Config", "Gemma2ForCausalLM",
                     dict(head_dim=8, sliding_window=5, attn_logit_softcapping=3.0, final_logit_softcapping=5.0,
                          query_pre_attn_scalar=12, layer_types=SWA)),
    "gemma3": Family("Gemma3TextConfig", "Gemma3ForCausalLM",
                     dict(head_dim=8, sliding_window=5, query_pre_attn_scalar=12, layer_types=SWA)),
    "gpt_oss": Family("GptOssConfig", "GptOssForCausalLM",
                      dict(head_dim=8, sliding_window=5, num_local_experts=4, num_experts_per_tok=2, layer_types=SWA)),
    "cohere2": Family("Cohere2Config", "Cohere2ForCausalLM", dict(sliding_window=5, layer_types=SWA)),
    "exaone4": Family("Exaone4Config", "Exaone4ForCausalLM", dict(sliding_window=5, layer_types=SWA)),
    "llama4_chunked": Family("Llama4TextConfig", "Llama4ForCausalLM",
                             dict(head_dim=8, attention_chunk_size=4, num_local_experts=2, num_experts_per_tok=1,
                                  intermediate_size_mlp=48, no_rope_layers=[1, 0], interleave_moe_layer_step=1,
                                  layer_types=["chunked_attention", "full_attention"], attn_temperature_tuning=False)),
    "deepseek_v3_mla": Family("DeepseekV3Config", "DeepseekV3ForCausalLM",
                              dict(q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                                   v_head_dim=6, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                                   first_k_dense_replace=1, moe_intermediate_size=16, num_key_value_heads=4)),
    "mixtral": Family("MixtralConfig", "MixtralForCausalLM",
                      dict(sliding_window=5, num_local_experts=4, num_experts_per_tok=2)),
    "starcoder2": Family("Starcoder2Config", "Starcoder2ForCausalLM", dict(sliding_window=5)),
    "olmo3": Family("Olmo3Config", "Olmo3ForCausalLM", dict(sliding_window=5, layer_types=SWA)),
    "qwen3_sliding": Family("Qwen3Config", "Qwen3ForCausalLM",
                            dict(head_dim=8, use_sliding_window=True, sliding_window=5, max_window_layers=1,
                                 layer_types=SWA)),
    "granite": Family("GraniteConfig", "GraniteForCausalLM", dict(attention_multiplier=0.3)),  # scaling != d^-0.5
    "deepseek_v2_mla": Family("DeepseekV2Config", "DeepseekV2ForCausalLM",
                              dict(q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                                   v_head_dim=6, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
                                   moe_intermediate_size=16, num_key_value_heads=4)),
    "ministral": Family("MinistralConfig", "MinistralForCausalLM", dict(head_dim=8, sliding_window=5, layer_types=SWA)),
    "smollm3": Family("SmolLM3Config", "SmolLM3ForCausalLM",  # NoPE on every other layer, window on the rest
                      dict(head_dim=8, no_rope_layers=[1, 0], use_sliding_window=True, sliding_window=5, pad_token_id=0)),
    "hunyuan_dense": Family("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM", dict(head_dim=8)),  # q/k norms
    "flint": Family("FlintConfig", "FlintForCausalLM",  # sinks, windows per layer; eager scores in float32
                    dict(head_dim=8, sliding_window=5, layer_types=SWA)),
    "eurobert": Family("EuroBertConfig", "EuroBertForMaskedLM", dict(head_dim=8, pad_token_id=0), causal_lm=False),
    "modernbert": Family("ModernBertConfig", "ModernBertForMaskedLM",
                         dict(num_hidden_layers=2, global_attn_every_n_layers=2, local_attention=6,
                              layer_types=SWA, pad_token_id=0), causal_lm=False),
}


def build(name: str, attn: str) -> torch.nn.Module:
    import transformers

    from magi_integrations.hf import register_magi

    register_magi()
    fam = FAMILIES[name]
    kwargs = {**COMMON, **fam.kwargs}
    if name == "modernbert":
        for k in ("num_key_value_heads", "max_position_embeddings"):
            kwargs.pop(k)
        kwargs["max_position_embeddings"] = 128
    cfg = getattr(transformers, fam.config)(**kwargs, experts_implementation="eager")  # float64 MoE
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    model = getattr(transformers, fam.model)(cfg).to(torch.float64)
    model.config._attn_implementation = attn
    return model


@contextlib.contextmanager
def float64_softmax():
    """HF's eager attention takes its softmax in float32 even for float64 models (errors ~1e-7):
    run it in the input's dtype so a 1e-9 comparison means something."""
    real = torch.nn.functional.softmax

    def softmax(x: torch.Tensor, dim: Any = None, _stacklevel: int = 3, dtype: Any = None) -> torch.Tensor:
        if x.dtype == torch.float64:
            dtype = torch.float64
        return real(x, dim=dim, dtype=dtype)

    torch.nn.functional.softmax = softmax
    try:
        yield
    finally:
        torch.nn.functional.softmax = real
