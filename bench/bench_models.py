"""One training step (forward + backward, bf16) of Hugging Face models with attn_implementation
"magi" beside HF's "sdpa" and "flex_attention", in one process on one GPU: tokens/s, peak memory
and the loss, which must agree across implementations.

Models (built from configs, random weights, no downloads):
* ``llama1b``: a Llama-3.2-1B-like decoder (2048 hidden, 16 layers, 32 / 8 heads, d=64),
  packed documents from the embedded length distribution;
* ``gemma3``: a Gemma-3-1B-like decoder (1152 hidden, 26 layers, 4 / 1 heads, d=256, sliding
  window 512 on 5 of every 6 layers), packed documents;
* ``gpt_oss``: a small GPT-OSS-like MoE (sinks, window 128 on every other layer), one sequence:
  HF's GPT-OSS mask code ignores packed position_ids, so packing would not compare like with like.

Each implementation runs the same model (``set_attn_implementation``), in interleaved rounds,
median step time. Usage: ``python bench/bench_models.py --models llama1b gemma3 --seqlens 16384 32768``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


def build(kind: str):
    import transformers

    vocab = 32000
    if kind == "llama1b":
        cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                       num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                                       tie_word_embeddings=True)
        cls = transformers.LlamaForCausalLM
    elif kind == "gemma3":
        cfg = transformers.Gemma3TextConfig(vocab_size=vocab, hidden_size=1152, intermediate_size=6912,
                                            num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1,
                                            head_dim=256, sliding_window=512, max_position_embeddings=131072,
                                            query_pre_attn_scalar=256)
        cls = transformers.Gemma3ForCausalLM
    elif kind == "gpt_oss":
        cfg = transformers.GptOssConfig(vocab_size=vocab, hidden_size=1024, intermediate_size=1024, num_hidden_layers=8,
                                        num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_local_experts=8,
                                        num_experts_per_tok=2, sliding_window=128, max_position_embeddings=131072)
        cls = transformers.GptOssForCausalLM
    else:
        raise SystemExit(f"--models: unknown model {kind!r}")
    cfg._attn_implementation = "magi"
    torch.manual_seed(0)
    return cls(cfg).to(device="cuda", dtype=torch.bfloat16)


def batch(kind: str, seqlen: int, vocab: int):
    from magi_attn import cu_seqlens_of, sample_doc_lengths

    g = torch.Generator().manual_seed(seqlen)
    ids = torch.randint(0, vocab, (1, seqlen), generator=g)
    lengths = [seqlen] if kind == "gpt_oss" else sample_doc_lengths(seqlen, 0)
    cu = cu_seqlens_of(lengths)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = ids.clone()
    labels[:, :-1] = ids[:, 1:]
    labels[0, torch.tensor(cu[1:]) - 1] = -100
    return ids.cuda(), pos.cuda(), labels.cuda(), len(lengths)


def step(model, ids, pos, labels) -> float:
    logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    loss = torch.nn.functional.cross_entropy(logits[0].float(), labels[0], ignore_index=-100)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return loss.item()


def main() -> None:
    from magi_integrations.hf import register_magi

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["llama1b", "gemma3", "gpt_oss"])
    p.add_argument("--seqlens", nargs="+", type=int, default=[16384, 32768])
    p.add_argument("--impls", nargs="+", default=["magi", "sdpa", "flex_attention"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="bench_models.json")
    args = p.parse_args()
    register_magi()
    rows = []
    for kind in args.models:
        model = build(kind)
        impls = [i for i in args.impls if not (kind == "gpt_oss" and i == "sdpa")]  # HF: no sdpa for GPT-OSS
        for seqlen in args.seqlens:
            ids, pos, labels, docs = batch(kind, seqlen, model.config.vocab_size)
            times: dict[str, list[float]] = {i: [] for i in impls}
            stats: dict[str, dict] = {}
            for r in range(args.rounds + 1):  # round 0 warms up (compiles) and is not timed
                for impl in impls if r % 2 else impls[::-1]:
                    model.set_attn_implementation(impl)
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    t0 = time.perf_counter()
                    try:
                        loss = step(model, ids, pos, labels)
                    except torch.OutOfMemoryError:
                        stats[impl] = {"error": "out of memory"}
                        torch.cuda.empty_cache()
                        continue
                    torch.cuda.synchronize()
                    if r:
                        times[impl].append(time.perf_counter() - t0)
                    stats[impl] = {"loss": loss, "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
            for impl in impls:
                med = statistics.median(times[impl]) if times[impl] else None
                row = {"model": kind, "seqlen": seqlen, "documents": docs, "impl": impl, **stats.get(impl, {}),
                       "step_s": med, "tokens_per_s": seqlen / med if med else None}
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
        del model
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    print("| model | tokens | impl | tokens/s | peak GiB | loss |\n|---|---|---|---|---|---|")
    for r in rows:
        tps = f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else r.get("error", "-")
        print(f"| {r['model']} | {r['seqlen']} | {r['impl']} | {tps} | {r.get('peak_gib', 0):.1f} | {r.get('loss', float('nan')):.4f} |")


if __name__ == "__main__":
    main()
