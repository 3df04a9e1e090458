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
    "minimax": Family("MiniMaxConfig", "MiniMaxForCausalLM",  # lightning (linear) attention on odd layers
                      dict(head_dim=8, num_local_experts=4, num_experts_per_tok=2, block_size=4, num_hidden_layers=3,
                           layer_types=["full_attention", "linear_attention", "full_attention"])),
    "minimax_window": Family("MiniMaxConfig", "MiniMaxForCausalLM",  # HF windows its full_attention layers
                             dict(head_dim=8, num_local_experts=4, num_experts_per_tok=2, block_size=4,
                                  num_hidden_layers=3, sliding_window=5,
                                  layer_types=["full_attention", "linear_attention", "full_attention"])),
    "minimax_m2": Family("MiniMaxM2Config", "MiniMaxM2ForCausalLM",
                         dict(head_dim=8, num_local_experts=4, num_experts_per_tok=2)),
    "mimo_v2_flash": Family("MiMoV2FlashConfig", "MiMoV2FlashForCausalLM",  # sinks on window layers, v dim != qk dim
                            dict(head_dim=8, v_head_dim=6, sliding_window=5, layer_types=["full_attention",
                                 "sliding_attention"], n_routed_experts=4, num_experts_per_tok=2,
                                 moe_intermediate_size=16)),
    "seed_oss": Family("SeedOssConfig", "SeedOssForCausalLM", dict(head_dim=8, residual_dropout=0.0)),
    "apertus": Family("ApertusConfig", "ApertusForCausalLM", dict(pad_token_id=0)),
    "afmoe": Family("AfmoeConfig", "AfmoeForCausalLM",  # gated attention output, windows per layer
                    dict(head_dim=8, sliding_window=5, layer_types=SWA, num_experts=4, num_experts_per_tok=2,
                         num_shared_experts=1, moe_intermediate_size=16)),
    "vaultgemma": Family("VaultGemmaConfig", "VaultGemmaForCausalLM",
                         dict(head_dim=8, sliding_window=5, attn_logit_softcapping=3.0, final_logit_softcapping=5.0,
                              query_pre_attn_scalar=12, layer_types=SWA)),
    "granite_swa": Family("GraniteSWAConfig", "GraniteSWAForCausalLM",  # sinks, windows per layer, multiplier
                          dict(sliding_window=5, layer_types=SWA, attention_multiplier=0.3)),
    "qwen3_next": Family("Qwen3NextConfig", "Qwen3NextForCausalLM",  # gated DeltaNet layers + gated attention
                         dict(head_dim=8, layer_types=["linear_attention", "full_attention"], linear_key_head_dim=8,
                              linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                              num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                              shared_expert_intermediate_size=16)),
    "olmo_hybrid": Family("OlmoHybridConfig", "OlmoHybridForCausalLM",
                          dict(layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                               linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                               pad_token_id=0)),
    "kimi_linear": Family("KimiLinearConfig", "KimiLinearForCausalLM",  # MLA + KDA linear layers
                          dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                               num_key_value_heads=4, layer_types=["linear_attention", "full_attention"],
                               linear_head_dim=8, linear_num_heads=4, num_local_experts=4, num_experts_per_tok=2,
                               moe_intermediate_size=16, pad_token_id=0)),
    "longcat_flash": Family("LongcatFlashConfig", "LongcatFlashForCausalLM",  # MLA, two attentions per layer
                            dict(num_layers=1, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, head_dim=4,
                                 qk_rope_head_dim=4, v_head_dim=6, num_key_value_heads=4, ffn_hidden_size=48,
                                 n_routed_experts=4, moe_topk=2, zero_expert_num=2, expert_ffn_hidden_size=16)),
    "gemma3n": Family("Gemma3nTextConfig", "Gemma3nForCausalLM",  # KV shared across layers, AltUp, value norm
                      dict(head_dim=8, sliding_window=5, num_hidden_layers=4, num_kv_shared_layers=2,
                           layer_types=SWA * 2, vocab_size_per_layer_input=64, hidden_size_per_layer_input=8,
                           laurel_rank=4, altup_num_inputs=2, activation_sparsity_pattern=[0.0] * 4,
                           pad_token_id=0)),
    "gemma4": Family("Gemma4TextConfig", "Gemma4ForCausalLM",  # K = V, own heads and head dim on full layers
                     dict(head_dim=8, global_head_dim=16, num_global_key_value_heads=1, sliding_window=5,
                          layer_types=SWA, attention_k_eq_v=True, vocab_size_per_layer_input=64,
                          hidden_size_per_layer_input=8, pad_token_id=0)),
    "gemma4_kv_shared": Family("Gemma4TextConfig", "Gemma4ForCausalLM",  # layers 2, 3 reuse K/V of layers 0, 1
                               dict(head_dim=8, global_head_dim=8, sliding_window=5, num_hidden_layers=4,
                                    num_kv_shared_layers=2, layer_types=SWA * 2, vocab_size_per_layer_input=64,
                                    hidden_size_per_layer_input=8, pad_token_id=0)),
    "deepseek_v4_sliding": Family("DeepseekV4Config", "DeepseekV4ForCausalLM",  # sliding layers only: K = V, sinks
                                  dict(head_dim=8, num_key_value_heads=1, q_lora_rank=16, sliding_window=5,
                                       layer_types=["sliding_attention"] * 2, o_groups=2, o_lora_rank=8,
                                       n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                       hc_mult=2, index_n_heads=2, index_head_dim=8, index_topk=4)),
}

# Families whose attention the magi backend refuses by name (a per-query top-k key selection, or
# compressed KV entries appended to the keys): tiny configs to check the refusal
REFUSED_FAMILIES: dict[str, Family] = {
    "deepseek_v32": Family("DeepseekV32Config", "DeepseekV32ForCausalLM",  # DSA indexer top-k
                           dict(q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                                v_head_dim=6, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                                first_k_dense_replace=1, moe_intermediate_size=16, num_key_value_heads=4,
                                index_topk=4, index_head_dim=8, index_n_heads=2)),
    "glm_moe_dsa": Family("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM",  # DSA indexer top-k
                          dict(q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                               v_head_dim=6, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
                               moe_intermediate_size=16, num_key_value_heads=4, index_topk=4, index_head_dim=8,
                               index_n_heads=2)),
    "deepseek_v4_compressed": Family("DeepseekV4Config", "DeepseekV4ForCausalLM",  # CSA / HCA layers
                                     dict(FAMILIES["deepseek_v4_sliding"].kwargs,
                                          layer_types=["sliding_attention", "compressed_sparse_attention"])),
}


def build(name: str, attn: str) -> torch.nn.Module:
    import transformers

    from magi_integrations.hf import register_magi

    register_magi()
    fam = FAMILIES[name] if name in FAMILIES else REFUSED_FAMILIES[name]
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
