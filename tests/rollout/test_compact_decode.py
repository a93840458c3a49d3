"""The compact decode step (moe_gspo/rollout/compact_decode.py) against transformers' own forward: the
same samples, log-probs, routes and router probabilities from the same seed and weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moe_gspo.rollout.base import SamplingParams
from moe_gspo.rollout.compact_decode import DENSE_EXPERTS_RATIO, CompactDecoder, unsupported_reason
from moe_gspo.rollout.hf_engine import HFEngine
from moe_gspo.tiny import build_tiny_model, tiny_qwen3_moe_config

# different lengths: the shorter prompts are left-padded, so the attention mask is exercised
PROMPTS = [[2, 5, 6, 7, 8, 9, 10, 11], [2, 9, 12], [2, 3, 4, 5, 3, 4, 5, 6, 7, 8, 9, 10], [2, 17, 16, 15]]
SAMPLING = SamplingParams(n=6, max_new_tokens=10, seed=5)

MODELS = {
    "default": {},  # 1 dense + 2 MoE layers, 8 experts top-2: every expert computed, then gathered
    "many experts, no renormalisation": dict(num_experts=24, norm_topk_prob=False, mlp_only_layers=[]),
}
ENGINES = {
    "bf16 as fp32 GEMMs": dict(dtype="bfloat16", fp32_gemm=True),
    "bf16 kernels": dict(dtype="bfloat16", fp32_gemm=False),
    "fp32": dict(dtype="float32"),
}


def _model(name):
    return build_tiny_model(tiny_qwen3_moe_config(**MODELS[name]), seed=1)


def _assert_same_rollouts(ref, ours, *, exact: bool):
    assert [s.finish_reason for s in ref] == [s.finish_reason for s in ours]
    for a, b in zip(ref, ours):
        np.testing.assert_array_equal(a.response_ids, b.response_ids)
        np.testing.assert_array_equal(a.routes_TLK, b.routes_TLK)
        if exact:
            np.testing.assert_array_equal(a.response_logprobs, b.response_logprobs)
            np.testing.assert_array_equal(a.router_probs_TLK, b.router_probs_TLK)
        else:  # fp32: the same dot products, summed in another order by the GEMM kernels
            np.testing.assert_allclose(a.response_logprobs, b.response_logprobs, atol=1e-5)
            np.testing.assert_allclose(a.router_probs_TLK, b.router_probs_TLK, atol=2e-3)


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("engine_name", list(ENGINES))
def test_compact_decode_samples_what_transformers_samples(model_name, engine_name):
    model = _model(model_name)
    kw = ENGINES[engine_name]
    reference = HFEngine(model, device="cpu", compact_decode=False, **kw)
    engine = HFEngine(model, device="cpu", **kw)
    assert engine.compact_decode and not reference.compact_decode
    ref, ours = reference.generate(PROMPTS, SAMPLING), engine.generate(PROMPTS, SAMPLING)
    assert len({len(s.response_ids) for s in ours}) > 1  # rows stopped at different steps
    _assert_same_rollouts(ref, ours, exact=kw["dtype"] == "bfloat16")


@pytest.mark.parametrize("engine_name", ["bf16 as fp32 GEMMs", "fp32"])
def test_unpadded_prompts(engine_name):
    """Prompts of one length: no padding mask, so transformers' prefill takes SDPA's causal flag instead."""
    model = _model("default")
    kw = ENGINES[engine_name]
    prompts = [[2, 5, 6, 7, 8], [2, 9, 12, 3, 4], [2, 17, 16, 15, 14]]
    ref = HFEngine(model, device="cpu", compact_decode=False, **kw).generate(prompts, SAMPLING)
    ours = HFEngine(model, device="cpu", **kw).generate(prompts, SAMPLING)
    _assert_same_rollouts(ref, ours, exact=kw["dtype"] == "bfloat16")


def test_both_expert_paths_are_exercised():
    dense = _model("default").config
    assert dense.num_experts <= DENSE_EXPERTS_RATIO * dense.num_experts_per_tok
    module = _model("many experts, no renormalisation").config
    assert module.num_experts > DENSE_EXPERTS_RATIO * module.num_experts_per_tok


def test_lm_head_bias_and_greedy_decoding():
    """A bias on the EOS logit (added before the bf16 rounding, as nn.Linear adds it) and temperature 0."""
    model = _model("default")
    engines = [HFEngine(model, dtype="bfloat16", device="cpu", compact_decode=c) for c in (False, True)]
    for engine in engines:
        head = engine.model.lm_head
        bias = torch.zeros(head.out_features, dtype=head.weight.dtype)
        bias[model.config.eos_token_id] = 1.5
        head.bias = torch.nn.Parameter(bias, requires_grad=False)
    for sampling in (SAMPLING, SamplingParams(n=1, max_new_tokens=10, temperature=0.0)):
        ref, ours = (engine.generate(PROMPTS, sampling) for engine in engines)
        _assert_same_rollouts(ref, ours, exact=True)


def test_weight_updates_reach_the_compact_decoder():
    """Its concatenated / fp32 weights are rebuilt after a weight sync (version counters)."""
    old, new = _model("default"), build_tiny_model(seed=11)
    engine = HFEngine(old, dtype="bfloat16", device="cpu")
    before = engine.generate(PROMPTS, SAMPLING)
    engine.update_weights(new.state_dict().items())
    fresh = HFEngine(new, dtype="bfloat16", device="cpu", compact_decode=False).generate(PROMPTS, SAMPLING)
    after = engine.generate(PROMPTS, SAMPLING)
    _assert_same_rollouts(fresh, after, exact=True)
    assert any(not np.array_equal(a.response_ids, b.response_ids) for a, b in zip(before, after))


def test_unsupported_models_fall_back_or_raise():
    model = build_tiny_model(tiny_qwen3_moe_config(attention_bias=True), seed=0)
    assert "attention_bias" in unsupported_reason(model)
    assert not HFEngine(model, dtype="float32", device="cpu").compact_decode  # None: falls back
    with pytest.raises(ValueError, match="attention_bias=True.*compact_decode=False.*rollout.compact_decode"):
        HFEngine(model, dtype="float32", device="cpu", compact_decode=True)
    eager = build_tiny_model(seed=0)
    eager.config._attn_implementation = "eager"
    assert "eager" in unsupported_reason(eager)
    with pytest.raises(ValueError, match="Qwen3MoeForCausalLM"):
        CompactDecoder(torch.nn.Linear(2, 2), fp32_gemm=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compact_decode_on_cuda_samples_what_transformers_samples():
    """On a GPU (bf16 kernels, no fp32 emulation): the same samples and routes as transformers' forward; the
    log-probs within bf16 rounding (the GPU's GEMM kernels may pick other tilings for the fused q/k/v)."""
    model = _model("default")
    reference = HFEngine(model, dtype="bfloat16", device="cuda", compact_decode=False)
    engine = HFEngine(model, dtype="bfloat16", device="cuda")
    assert engine.compact_decode and not engine.fp32_gemm
    ref, ours = reference.generate(PROMPTS, SAMPLING), engine.generate(PROMPTS, SAMPLING)
    same = [np.array_equal(a.response_ids, b.response_ids) for a, b in zip(ref, ours)]
    assert np.mean(same) >= 0.9
    dlogp = np.concatenate([np.abs(a.response_logprobs - b.response_logprobs)
                            for a, b, eq in zip(ref, ours, same) if eq])
    assert dlogp.max() < 2e-2
