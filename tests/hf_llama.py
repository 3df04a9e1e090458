"""The tiny Llama of the integration tests (built from a config, no download), its packed
documents and the sdpa reference run document by document (the exact packed-causal semantics)."""

from __future__ import annotations

import torch

CU = [0, 9, 30, 31, 57, 70]


def tiny_llama(attn: str, dtype=torch.float64):
    from transformers import LlamaConfig, LlamaForCausalLM

    from magi_integrations.hf import register_magi

    register_magi()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.0,
                      max_position_embeddings=128)
    cfg._attn_implementation = attn
    model = LlamaForCausalLM(cfg).to(dtype)
    model.config._attn_implementation = attn
    return model


def tokens():
    return torch.randint(0, 96, (1, CU[-1]), generator=torch.Generator().manual_seed(1))


def reference(dtype=torch.float64):
    """sdpa, one document per forward: the exact packed-causal semantics."""
    model = tiny_llama("sdpa", dtype)
    ids = tokens()
    logits = torch.cat([model(input_ids=ids[:, a:b], use_cache=False).logits for a, b in zip(CU, CU[1:])], dim=1)
    return model, ids, logits


def loss_of(logits, labels):
    return torch.nn.functional.cross_entropy(logits[0], labels[0], ignore_index=-100, reduction="sum")


def labels_of(ids):
    lab = ids.clone()
    lab[:, :-1] = ids[:, 1:]
    lab[:, -1] = -100
    lab[0, torch.tensor(CU[1:]) - 1] = -100
    return lab
