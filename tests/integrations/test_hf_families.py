"""attn_implementation="magi" gives HF's own reference attention, family by family: logits and
every parameter gradient against "eager" (its softmax in float64), on one sequence, packed
documents (by position_ids and by cu_seq_lens), and a padded batch of 2; CP on 2 and 3 ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dist_harness import run_distributed
from hf_families import FAMILIES, build, float64_softmax

pytest.importorskip("transformers")

TOL = 1e-9
# Gemma's norms compute in float32 even in a float64 model; under CP the shards have other shapes
# than the reference's row, so those fp32 roundings differ (seen: 2e-9 abs, 2e-7 rel on a norm weight)
# (Gemma3n's, Gemma 4's and DeepSeek-V4's RMSNorms too; seen under CP: 4.2e-8, 5.3e-9 and 7.3e-9 on an
# embedding gradient)
FP32_INTERNALS = {"gemma2", "gemma3", "gemma3n", "gemma4_kv_shared", "deepseek_v4_sliding"}
# Qwen3-Next's RMSNorms (q/k norms, layer norms) compute in float32 even in a float64 model: ulp
# differences between two correct attentions come out of them as float32 roundings (seen: 1.7e-8 on
# the logits; 7e-10 with those norms patched to float64), also without CP
FP32_NORMS = {"qwen3_next"}
FP32_INTERNALS |= FP32_NORMS
# Flint's eager attention computes its scores and softmax in float32 even in a float64 model: the
# reference itself is float32-accurate (seen: 1.5e-6 abs / 1.2e-5 rel on an embedding gradient);
# GraniteSWA's eager takes its sink scale sigmoid(logsumexp - sink) in float32 (seen: 2.9e-8 logits)
FP32_REFERENCE = {"flint", "granite_swa"}
TOL_FP32_REFERENCE = 5e-5
TOL_FP32_INTERNALS = 1e-6
S = 24
CU = [0, 9, 20, 24]  # documents longer than the windows (5) and chunks (4) of the tiny models
# Llama4 does not pass position_ids to its attention layers: packing by position_ids alone would
# attend across documents, so the backend refuses it and asks for cu_seq_lens (that case passes)
# (DeepSeek-V4 takes position_ids as a named argument of its attention: the same refusal);
# Gemma 4 with KV-shared layers slices its masks as 4-D tensors: refused with a padding mask;
# Qwen3-Next's and OLMo-Hybrid's gated DeltaNet layers (HF's, not magi's) refuse cu_seq_lens on CPU
_NEEDS_CU = (ValueError, "pass cu_seq_lens_q and cu_seq_lens_k")
_KV_SHARED = (NotImplementedError, "KV-shared layers")
_FLA = (ValueError, "flash-linear-attention")
REFUSED = {("llama4_chunked", "packed_position_ids"): _NEEDS_CU,
           ("deepseek_v4_sliding", "packed_position_ids"): _NEEDS_CU,
           ("gemma4_kv_shared", "padded_batch"): _KV_SHARED,
           ("qwen3_next", "packed_cu_seq_lens"): _FLA, ("olmo_hybrid", "packed_cu_seq_lens"): _FLA}
# GPT-OSS does not give position_ids to its mask functions, so its eager path attends across packed
# documents (its flash path does not): its packed reference runs document by document instead
# (for the others, eager on the packed row: same shapes, so the same fp32-internal rounding)
# AFMoE's model builds its masks without position_ids too (the same, on its sliding and full layers)
MASKS_IGNORE_PACKING = {"gpt_oss", "afmoe"}
CASES = ["one_sequence", "packed_position_ids", "packed_cu_seq_lens", "padded_batch"]


def _inputs(case: str) -> tuple[dict, dict, torch.Tensor]:
    """(eager kwargs, magi kwargs, [b, s] bool of the positions that count)."""
    g = torch.Generator().manual_seed(7)
    if case == "padded_batch":  # left padding in row 0, right padding in row 1
        ids = torch.randint(1, 64, (2, 14), generator=g)
        mask = torch.ones(2, 14, dtype=torch.long)
        mask[0, :3] = 0
        mask[1, 10:] = 0
        kw = dict(input_ids=ids, attention_mask=mask)
        return kw, dict(kw), mask.bool()
    ids = torch.randint(1, 64, (1, S), generator=g)
    if case == "one_sequence":
        kw = dict(input_ids=ids)
        return kw, dict(kw), torch.ones(1, S, dtype=torch.bool)
    pos = torch.cat([torch.arange(b - a) for a, b in zip(CU, CU[1:])])[None]
    eager = dict(input_ids=ids, position_ids=pos)  # HF's masks detect packing from position_ids
    magi = dict(eager)
    if case == "packed_cu_seq_lens":
        cu = torch.tensor(CU, dtype=torch.int32)
        magi.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=11, max_length_k=11)
    return eager, magi, torch.ones(1, S, dtype=torch.bool)


def _run(model, kwargs: dict, valid: torch.Tensor, per_document: bool = False):
    """Logits and parameter gradients of a weighted sum of the logits. ``per_document``: run
    each packed document on its own (the packed semantics, whatever a model's mask code does
    with packed position_ids: GPT-OSS, for one, does not give them to its mask functions)."""
    if per_document:
        ids = kwargs["input_ids"]
        logits = torch.cat([model(input_ids=ids[:, a:b], use_cache=False).logits for a, b in zip(CU, CU[1:])], dim=1)
    else:
        logits = model(**kwargs, use_cache=False).logits
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(logits.shape, generator=g, dtype=logits.dtype) * valid[..., None]
    (logits * weight).sum().backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _compare(name: str, case: str, logits, grads, ref_logits, ref_grads, valid) -> None:
    tol = TOL_FP32_REFERENCE if name in FP32_REFERENCE else TOL_FP32_INTERNALS if name in FP32_NORMS else TOL
    torch.testing.assert_close(logits[valid], ref_logits[valid], atol=tol, rtol=tol,
                               msg=lambda m: f"{name}/{case} logits: {m}")
    assert grads.keys() == ref_grads.keys(), f"{name}/{case}: parameters with gradients differ"
    for n, gr in ref_grads.items():
        torch.testing.assert_close(grads[n], gr, atol=tol, rtol=tol, msg=lambda m, n=n: f"{name}/{case} {n}: {m}")


def _reference(name: str, eager_kw: dict, valid: torch.Tensor, per_document: bool):
    with float64_softmax():
        return _run(build(name, "eager"), eager_kw, valid, per_document)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_matches_eager(name, case):
    fam = FAMILIES[name]
    if not fam.causal_lm and case.startswith("packed"):
        pytest.skip("HF's bidirectional encoder masks take no packed position_ids")
    eager_kw, magi_kw, valid = _inputs(case)
    if (name, case) in REFUSED:
        error, match = REFUSED[(name, case)]
        with pytest.raises(error, match=match):
            _run(build(name, "magi"), magi_kw, valid)
        return
    per_document = case.startswith("packed") and name in MASKS_IGNORE_PACKING
    ref_logits, ref_grads = _reference(name, eager_kw, valid, per_document)
    logits, grads = _run(build(name, "magi"), magi_kw, valid)
    _compare(name, case, logits, grads, ref_logits, ref_grads, valid)


def _cp_worker(rank: int, world: int, name: str) -> None:
    from magi_attn import DispatchConfig, DistAttnConfig, OverlapConfig
    from magi_integrations.hf import attention_config, cp_cross_entropy, prepare_cp_batch

    eager_kw, _, valid = _inputs("packed_position_ids")
    ids = eager_kw["input_ids"]
    model = build(name, "magi")
    cfg = DistAttnConfig(DispatchConfig(chunk_size=4), OverlapConfig(degree=2, min_chunk_size=4), kernel_backend="torch")
    batch = prepare_cp_batch(ids, CU, cp_group=dist.group.WORLD, config=cfg, **attention_config(model.config))
    share = cp_cross_entropy(model(**batch.model_kwargs()).logits, batch)
    share.backward()
    ref_model = build(name, "eager")
    with float64_softmax():
        if name in MASKS_IGNORE_PACKING:
            ref_logits = torch.cat([ref_model(input_ids=ids[:, a:b], use_cache=False).logits
                                    for a, b in zip(CU, CU[1:])], dim=1)
        else:
            ref_logits = ref_model(**eager_kw, use_cache=False).logits
    n = (batch.labels != -100).sum()
    ref = torch.nn.functional.cross_entropy(ref_logits[0], batch.labels[0], ignore_index=-100, reduction="sum") / n
    ref.backward()
    total = share.detach().clone()
    dist.all_reduce(total)
    tol = TOL_FP32_REFERENCE if name in FP32_REFERENCE else TOL_FP32_INTERNALS if name in FP32_INTERNALS else TOL
    torch.testing.assert_close(total, ref.detach(), atol=tol, rtol=0)
    for (pn, p), (_, r) in zip(model.named_parameters(), ref_model.named_parameters()):
        if r.grad is None:
            assert p.grad is None or not p.grad.any(), pn
            continue
        grad = p.grad.clone()
        dist.all_reduce(grad)  # each CP rank holds its tokens' share
        torch.testing.assert_close(grad, r.grad, atol=tol, rtol=tol, msg=lambda m, pn=pn: f"rank {rank} {pn}: {m}")


# refused under CP (test below): hybrids whose linear-attention layers run outside the backend, and
# models whose layers have their own head counts or head dims (one CP batch plans one head shape)
CP_REFUSED = {**{n: "'linear_attention'.*under context parallelism" for n in
                 ("minimax", "minimax_window", "qwen3_next", "olmo_hybrid", "kimi_linear")},
              "mimo_v2_flash": "not supported under context parallelism", "gemma4": "without context parallelism"}
CP_SKIP = ("mixtral", "starcoder2", "granite", "ministral", "hunyuan_dense", "minimax_m2", "seed_oss", "apertus",
           "vaultgemma")  # the same attention features as families kept under CP
CP_CASES = [(n, 2) for n, f in FAMILIES.items() if f.causal_lm and n not in CP_SKIP + tuple(CP_REFUSED)] + [
    (n, 3) for n in ("llama", "gemma3", "gpt_oss", "llama4_chunked", "deepseek_v3_mla")]


@pytest.mark.parametrize("name,world", CP_CASES)
def test_family_under_context_parallelism(name, world):
    """Every layer's own mask (windows per layer type, chunks, sinks, MLA) over one dispatch."""
    run_distributed(_cp_worker, world, name)


@pytest.mark.parametrize("name", list(CP_REFUSED))
def test_refuses_under_context_parallelism(name):
    """Linear-attention layers do not go through the backend (under CP they would see one shard);
    per-layer head shapes do not fit the batch's one plan: both refused by name."""
    from magi_attn import DistAttnConfig
    from magi_integrations.hf import attention_config, prepare_cp_batch

    model = build(name, "magi")
    with pytest.raises(NotImplementedError, match=CP_REFUSED[name]):
        batch = prepare_cp_batch(_inputs("packed_position_ids")[0]["input_ids"], CU, cp_group=None,
                                 config=DistAttnConfig(kernel_backend="torch"), **attention_config(model.config))
        model(**batch.model_kwargs())


def test_refuses_what_it_cannot_honour():
    model = build("llama", "magi")
    model.train()
    model.config.attention_dropout = 0.5
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5
    with pytest.raises(ValueError, match="no attention dropout"):
        model(input_ids=torch.randint(1, 64, (1, 8)), use_cache=False)
    model = build("llama", "magi")
    cache = model(input_ids=torch.randint(1, 64, (1, 8)), use_cache=True).past_key_values  # prefill is fine
    with pytest.raises(NotImplementedError, match="without a KV cache"):  # decoding is not
        # transformers >= 5.2x names the argument `cache` (`past_key_values` is deprecated there)
        import inspect

        arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        model(input_ids=torch.randint(1, 64, (1, 1)), use_cache=True, **{arg: cache})
    mask = torch.ones(1, 8, dtype=torch.long)
    mask[0, 3] = 0
    with pytest.raises(ValueError, match="padding between its tokens"):
        model(input_ids=torch.randint(1, 64, (1, 8)), attention_mask=mask, use_cache=False)


@pytest.mark.parametrize("name,match", [("deepseek_v32", "deepseek_v32 uses DeepSeek sparse attention"),
                                        ("glm_moe_dsa", "glm_moe_dsa uses DeepSeek sparse attention"),
                                        ("deepseek_v4_compressed", "'compressed_sparse_attention'")])
def test_refuses_families_it_cannot_honour(name, match):
    """Families whose attention picks keys per query (DSA's indexer top-k) or appends compressed KV
    entries: refused by name when HF builds the masks, on one sequence and on a padded batch."""
    for case in ("one_sequence", "padded_batch"):
        _, magi_kw, _ = _inputs(case)
        with pytest.raises(NotImplementedError, match=match):
            build(name, "magi")(**magi_kw, use_cache=False)
    build(name, "eager")(**_inputs("one_sequence")[0], use_cache=False)  # the config itself runs


def test_refuses_what_the_attention_call_cannot_carry():
    """The attention interface itself refuses a sparse selection (``indices=``) and queries that
    are not the keys' own tokens (extra or compressed KV, queries sliced to logits_to_keep)."""
    from magi_integrations.hf import magi_attention_forward

    module = build("llama", "magi").model.layers[0].self_attn
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, h, 8, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    with pytest.raises(NotImplementedError, match="passes indices="):
        magi_attention_forward(module, q, k, v, None, indices=torch.zeros(1, 8, 2, dtype=torch.long))
    longer = torch.randn(1, 2, 12, 8, generator=g, dtype=torch.float64)
    with pytest.raises(NotImplementedError, match="8 queries against 12 keys"):
        magi_attention_forward(module, q, longer, longer, None)


def test_refuses_cross_attention():
    """An encoder-decoder's cross-attention (queries and keys of different lengths) is refused by
    name, not mistaken for a decode step or run as self-attention."""
    import transformers

    from magi_integrations.hf import register_magi

    register_magi()
    sub = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
               num_key_value_heads=2, head_dim=8, max_position_embeddings=64, attention_dropout=0.0,
               sliding_window=5, layer_types=["full_attention"], query_pre_attn_scalar=8, pad_token_id=0)
    cfg = transformers.T5GemmaConfig(encoder=sub, decoder=sub, vocab_size=64, pad_token_id=0, dropout_rate=0.0,
                                     attention_dropout=0.0)
    cfg._attn_implementation = "magi"
    model = transformers.T5GemmaForConditionalGeneration(cfg).to(torch.float64)
    model.set_attn_implementation("magi")
    with pytest.raises(NotImplementedError, match="cross-attention"):
        model(input_ids=torch.randint(3, 64, (1, 10)), decoder_input_ids=torch.randint(3, 64, (1, 6)), use_cache=False)
    # equal lengths would pass the length check: the layer itself is recognised as cross-attention
    with pytest.raises(NotImplementedError, match="T5GemmaCrossAttention is cross-attention"):
        model(input_ids=torch.randint(3, 64, (1, 8)), decoder_input_ids=torch.randint(3, 64, (1, 8)), use_cache=False)
    bart = transformers.BartConfig(vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1,
                                   encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=48,
                                   decoder_ffn_dim=48, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0)
    bart._attn_implementation = "magi"
    bart_model = transformers.BartForConditionalGeneration(bart).to(torch.float64)
    bart_model.set_attn_implementation("magi")
    with pytest.raises(NotImplementedError, match="BartAttention is cross-attention"):
        bart_model(input_ids=torch.randint(3, 64, (1, 8)), decoder_input_ids=torch.randint(3, 64, (1, 8)),
                   use_cache=False)


@pytest.mark.parametrize("name", ["llama", "gemma2", "mistral", "modernbert"])
def test_record_max_logits_matches_eager_scores(name):
    """record_max_logits: per layer and query head, the largest scaled (softcapped) logit that
    the eager path feeds its softmax (masked cells there are -inf or the dtype's minimum)."""
    from magi_integrations.hf import record_max_logits

    ids = torch.randint(1, 64, (1, S), generator=torch.Generator().manual_seed(5))
    seen: list[torch.Tensor] = []
    real = torch.nn.functional.softmax

    def softmax(x, dim=None, _stacklevel=3, dtype=None):
        if x.dim() == 4:  # [b, hq, q, k]: attention scores plus the additive mask
            seen.append(x.detach().amax(dim=(0, 2, 3)))
        return real(x, dim=dim, dtype=torch.float64 if x.dtype == torch.float64 else dtype)

    torch.nn.functional.softmax = softmax
    try:
        build(name, "eager")(input_ids=ids, use_cache=False)
    finally:
        torch.nn.functional.softmax = real
    model = build(name, "magi")
    with record_max_logits() as rec:
        model(input_ids=ids, use_cache=False)
    got = list(rec.named(model).values())
    assert len(got) == len(seen) == model.config.num_hidden_layers
    for layer, (g, ref) in enumerate(zip(got, seen)):
        torch.testing.assert_close(g.double(), ref, atol=1e-5, rtol=1e-6, msg=lambda m, i=layer: f"layer {i}: {m}")


def test_refuses_unknown_attention_kwargs():
    """An argument the backend does not know may change the attention (a bias, a head mask): it is
    refused by name unless the user allows it."""
    import magi_integrations.hf as hf

    model = build("llama", "magi")
    attn = model.model.layers[0].self_attn
    q, k, v = (torch.randn(1, h, 6, 8, dtype=torch.float64) for h in (4, 2, 2))
    with pytest.raises(NotImplementedError, match=r"passes \['attn_bias'\].*allow_attention_kwargs\('attn_bias'\)"):
        hf.magi_attention_forward(attn, q, k, v, None, scaling=8 ** -0.5, attn_bias=torch.zeros(6, 6))
    out, _ = hf.magi_attention_forward(attn, q, k, v, None, scaling=8 ** -0.5, attn_bias=None, use_cache=True)
    try:
        hf.allow_attention_kwargs("attn_bias")
        allowed, _ = hf.magi_attention_forward(attn, q, k, v, None, scaling=8 ** -0.5, attn_bias=torch.zeros(6, 6))
    finally:
        hf._allowed_kwargs.discard("attn_bias")
    assert torch.equal(allowed, out)
    with pytest.raises(TypeError, match="argument names"):
        hf.allow_attention_kwargs(3)


def test_refuses_key_documents_other_than_the_queries():
    """cu_seq_lens_k is honoured only as the queries' own documents: another layout is refused."""
    import magi_integrations.hf as hf

    attn = build("llama", "magi").model.layers[0].self_attn
    q, k, v = (torch.randn(1, h, 6, 8, dtype=torch.float64) for h in (4, 2, 2))
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    same, _ = hf.magi_attention_forward(attn, q, k, v, None, scaling=8 ** -0.5, cu_seq_lens_q=cu,
                                        cu_seq_lens_k=cu.clone())
    alone, _ = hf.magi_attention_forward(attn, q, k, v, None, scaling=8 ** -0.5, cu_seq_lens_q=cu)
    assert torch.equal(same, alone)
    with pytest.raises(NotImplementedError, match="cu_seq_lens_k describes other documents"):
        hf.magi_attention_forward(attn, q, k, v, None, scaling=8 ** -0.5, cu_seq_lens_q=cu,
                                  cu_seq_lens_k=torch.tensor([0, 3, 6], dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seq_lens_k was passed without cu_seq_lens_q"):
        hf.magi_attention_forward(attn, q, k, v, None, scaling=8 ** -0.5, cu_seq_lens_k=cu)
