"""Tests of the transformers rollout engine (tiny Qwen3-MoE on CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from moe_gspo.rollout.base import SamplingParams
from moe_gspo.rollout.hf_engine import HFEngine, sample_next_tokens
from moe_gspo.rollout.hf_router_hooks import HFRouterRecorder
from moe_gspo.tiny import build_tiny_model, make_tiny_checkpoint

EOS, PAD = 1, 0
PROMPTS = [[2, 5, 6, 7, 8], [2, 9], [2, 10, 11, 12, 13, 14, 15, 16, 17]]


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), seed=7)


def _force_eos_bias(engine, bias):
    """Give lm_head a bias on the EOS logit (the engine's own copy only)."""
    lm_head = engine.model.lm_head
    b = torch.zeros(lm_head.out_features, dtype=lm_head.weight.dtype)
    b[EOS] = bias
    lm_head.bias = torch.nn.Parameter(b, requires_grad=False)


def _same(a, b):
    return [np.array_equal(x.response_ids, y.response_ids) for x, y in zip(a, b)]


def _teacher_forced(model, sample):
    """log p of the response tokens and routes [P+R, L, K] from one full fp32 forward."""
    ids = torch.as_tensor(np.concatenate([sample.prompt_ids, sample.response_ids]))[None]
    with HFRouterRecorder(model) as rec, torch.no_grad():
        logits = model(ids).logits[0].float()
        (call,) = rec.pop()
    num_prompt = len(sample.prompt_ids)
    logp = torch.log_softmax(logits[num_prompt - 1:-1], -1)
    logp = logp.gather(-1, torch.as_tensor(sample.response_ids)[:, None])[:, 0]
    return logp.numpy(), call.topk_ids_NLK.numpy(), call.probs_NLK.numpy()


def test_properties(engine32, model):
    cfg = model.config
    assert engine32.records_routes
    assert engine32.top_k == cfg.num_experts_per_tok
    assert engine32.num_experts == cfg.num_experts
    assert engine32.moe_layer_ids == [i for i in range(cfg.num_hidden_layers) if i not in cfg.mlp_only_layers]
    assert engine32.num_moe_layers == len(engine32.moe_layer_ids)
    assert engine32.pad_token_id == PAD and engine32.eos_token_ids == [EOS]


def test_engine_holds_its_own_copy(model):
    with HFRouterRecorder(model) as learner_rec:  # hooks on the source must not be inherited
        engine = HFEngine(model, dtype="bfloat16", device="cpu")
        engine.generate([[2, 5]], SamplingParams(max_new_tokens=3))
        assert learner_rec.pop() == []
    src = dict(model.named_parameters())
    for name, p in engine.model.named_parameters():
        assert p.dtype == torch.bfloat16 and not p.requires_grad
        assert p.data_ptr() != src[name].data_ptr()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    # rotary frequencies stay float32, as when loading a checkpoint with dtype=bfloat16
    assert engine.model.model.rotary_emb.inv_freq.dtype == torch.float32
    assert sum(len(m._forward_hooks) for m in engine.model.modules()) == engine.num_moe_layers


def test_generate_fields_shapes_and_grouping(engine32):
    n, max_new = 3, 6
    samples = engine32.generate(PROMPTS, SamplingParams(n=n, max_new_tokens=max_new, seed=1))
    assert len(samples) == len(PROMPTS) * n
    L, K = engine32.num_moe_layers, engine32.top_k
    for b, s in enumerate(samples):
        assert s.prompt_index == b // n
        assert s.prompt_ids.dtype == np.int64 and s.prompt_ids.tolist() == PROMPTS[b // n]
        R = len(s.response_ids)
        assert s.response_ids.dtype == np.int64 and 1 <= R <= max_new
        assert s.response_logprobs.dtype == np.float32 and s.response_logprobs.shape == (R,)
        assert np.all(s.response_logprobs <= 0) and np.all(np.isfinite(s.response_logprobs))
        eos_at = np.flatnonzero(s.response_ids == EOS)
        if s.finish_reason == "stop":
            assert eos_at.tolist() == [R - 1]
        else:
            assert s.finish_reason == "length" and R == max_new and eos_at.size == 0
        T = len(s.prompt_ids) + R - 1
        assert s.routes_TLK.shape == (T, L, K) and s.routes_TLK.dtype == np.uint8
        assert s.routes_TLK.max() < engine32.num_experts
        assert np.all(s.routes_TLK[..., 0] != s.routes_TLK[..., 1])  # k distinct experts
        assert s.router_probs_TLK.shape == (T, L, K) and s.router_probs_TLK.dtype == np.float16
        probs = s.router_probs_TLK.astype(np.float32)
        assert np.all(probs > 0) and np.all(probs.sum(-1) <= 1.0 + 1e-3)
        assert np.all(np.diff(probs, axis=-1) <= 0)  # in top-k order
    # the n samples of one prompt share the prompt routes
    for i in range(len(PROMPTS)):
        P = len(PROMPTS[i])
        group = samples[i * n:(i + 1) * n]
        for s in group[1:]:
            assert np.array_equal(s.routes_TLK[:P], group[0].routes_TLK[:P])


def test_seed_determinism(engine32):
    sp = SamplingParams(n=4, max_new_tokens=8, seed=3)
    a = engine32.generate(PROMPTS, sp)
    b = engine32.generate(PROMPTS, sp)
    for x, y in zip(a, b):
        assert np.array_equal(x.response_ids, y.response_ids)
        assert np.array_equal(x.response_logprobs, y.response_logprobs)
        assert np.array_equal(x.routes_TLK, y.routes_TLK)
    c = engine32.generate(PROMPTS, SamplingParams(n=4, max_new_tokens=8, seed=4))
    assert not all(_same(a, c))
    # samples within a group differ too
    assert not all(_same(a[:1] * 3, a[1:4]))


def test_eos_stops_rows_and_keeps_padding(model):
    engine = HFEngine(model, dtype="float32", device="cpu")
    _force_eos_bias(engine, 50.0)
    for s in engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=5, seed=0)):
        assert s.response_ids.tolist() == [EOS] and s.finish_reason == "stop"
        assert s.routes_TLK.shape[0] == len(s.prompt_ids)
        assert s.response_logprobs[0] > -1e-4
    # a moderate bias stops rows at different steps inside one batch
    _force_eos_bias(engine, 4.0)
    samples = engine.generate(PROMPTS, SamplingParams(n=4, max_new_tokens=6, seed=0))
    lengths = {len(s.response_ids) for s in samples}
    assert len(lengths) > 1
    for s in samples:
        assert s.routes_TLK.shape[0] == len(s.prompt_ids) + len(s.response_ids) - 1
        assert (s.finish_reason == "stop") == (s.response_ids[-1] == EOS)
        assert EOS not in s.response_ids[:-1].tolist()


@pytest.mark.parametrize("eos_bias", [None, 4.0])
def test_fp32_logprobs_and_routes_match_teacher_forced_forward(model, eos_bias):
    """The key alignment check: decode-time routes == routes of one full forward.

    With an EOS bias, rows stop at different steps and finished rows keep being fed padding.
    """
    engine = HFEngine(model, dtype="float32", device="cpu")
    if eos_bias is not None:
        _force_eos_bias(engine, eos_bias)
    samples = engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=8, seed=5))
    if eos_bias is not None:
        assert len({len(s.response_ids) for s in samples}) > 1
    for s in samples:
        logp, routes, probs = _teacher_forced(engine.model, s)
        np.testing.assert_allclose(s.response_logprobs, logp, atol=1e-4, rtol=0)
        T = s.routes_TLK.shape[0]
        assert T == routes.shape[0] - 1
        assert np.array_equal(s.routes_TLK, routes[:T].astype(np.uint8))
        np.testing.assert_allclose(s.router_probs_TLK.astype(np.float32), probs[:T], atol=2e-3)


def test_bf16_logprobs_close_to_fp32_forward(model):
    engine = HFEngine(model, dtype="bfloat16", device="cpu")
    samples = engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=8, seed=5))
    diffs, agree = [], []
    for s in samples:
        logp, routes, _ = _teacher_forced(model, s)
        diffs.append(np.abs(s.response_logprobs - logp))
        agree.append(s.routes_TLK == routes[:len(s.routes_TLK)])
    # bf16 may differ from fp32 (no zero assertion), but only slightly
    assert np.concatenate(diffs).mean() < 0.02
    assert np.concatenate([a.ravel() for a in agree]).mean() > 0.9


def test_left_padding_matches_generating_alone(engine32):
    greedy = SamplingParams(n=1, max_new_tokens=6, temperature=0.0)
    batched = engine32.generate(PROMPTS, greedy)
    for prompt, s in zip(PROMPTS, batched):
        (alone,) = engine32.generate([prompt], greedy)
        assert np.array_equal(s.response_ids, alone.response_ids)
        np.testing.assert_allclose(s.response_logprobs, alone.response_logprobs, atol=1e-5)
        assert np.array_equal(s.routes_TLK, alone.routes_TLK)


def test_tiny_top_p_is_greedy(engine32):
    greedy = engine32.generate(PROMPTS, SamplingParams(max_new_tokens=5, temperature=0.0))
    nucleus = engine32.generate(PROMPTS, SamplingParams(max_new_tokens=5, top_p=1e-6, seed=9))
    assert all(_same(greedy, nucleus))


def test_sample_next_tokens_top_p_support():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]])).expand(4000, 3)
    g = torch.Generator().manual_seed(0)
    toks = sample_next_tokens(logits, temperature=1.0, top_p=0.6, generator=g)
    counts = torch.bincount(toks, minlength=3).tolist()
    assert counts[2] == 0 and counts[0] > 0 and counts[1] > 0
    # renormalised nucleus: P(0) = 0.5 / 0.8
    assert abs(counts[0] / 4000 - 0.625) < 0.04


def test_routes_off_gives_same_samples_without_hooks(model, engine32):
    plain = HFEngine(model, dtype="float32", device="cpu", record_routes=False)
    assert not plain.records_routes
    assert sum(len(m._forward_hooks) for m in plain.model.modules()) == 0
    sp = SamplingParams(n=2, max_new_tokens=6, seed=2)
    a, b = plain.generate(PROMPTS, sp), engine32.generate(PROMPTS, sp)
    assert all(_same(a, b))
    assert all(s.routes_TLK is None and s.router_probs_TLK is None for s in a)


def test_update_weights_matches_fresh_engine(model):
    other = build_tiny_model(seed=1)
    sp = SamplingParams(n=2, max_new_tokens=6, seed=0)
    engine = HFEngine(model, dtype="float32", device="cpu")
    before = engine.generate(PROMPTS, sp)
    engine.update_weights(other.state_dict().items())
    after = engine.generate(PROMPTS, sp)
    fresh = HFEngine(other, dtype="float32", device="cpu").generate(PROMPTS, sp)
    assert not all(_same(before, after))
    for x, y in zip(after, fresh):
        assert np.array_equal(x.response_ids, y.response_ids)
        assert np.array_equal(x.response_logprobs, y.response_logprobs)
        assert np.array_equal(x.routes_TLK, y.routes_TLK)


def test_update_weights_casts_dtype(model):
    engine = HFEngine(build_tiny_model(seed=2), dtype="bfloat16", device="cpu")
    engine.update_weights((k, v.to(torch.float16)) for k, v in model.state_dict().items())
    want = model.state_dict()["model.layers.1.mlp.experts.gate_up_proj"].to(torch.float16).to(torch.bfloat16)
    got = engine.model.state_dict()["model.layers.1.mlp.experts.gate_up_proj"]
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


def test_update_weights_per_expert_layout_matches_checkpoint_engine(model, ckpt_dir):
    """On-disk per-expert tensors (a real checkpoint's safetensors) load into fused weights."""
    disk = load_file(str(ckpt_dir / "model.safetensors"))
    assert any(".experts.0.gate_proj.weight" in k for k in disk)
    engine = HFEngine(model, dtype="float32", device="cpu")
    engine.update_weights(disk.items())
    from_dir = HFEngine(str(ckpt_dir), dtype="float32", device="cpu")
    for name, p in from_dir.model.state_dict().items():
        assert torch.equal(engine.model.state_dict()[name], p), name
    sp = SamplingParams(n=2, max_new_tokens=5, seed=1)
    assert all(_same(engine.generate(PROMPTS, sp), from_dir.generate(PROMPTS, sp)))


def test_update_weights_rejects_bad_input_and_changes_nothing(engine32):
    before = {k: v.clone() for k, v in engine32.model.state_dict().items()}
    good = ("model.layers.0.self_attn.q_proj.weight", torch.zeros_like(before["model.layers.0.self_attn.q_proj.weight"]))
    with pytest.raises(ValueError, match="model.layers.9.nope"):
        engine32.update_weights([good, ("model.layers.9.nope", torch.zeros(2))])
    with pytest.raises(ValueError, match="shape mismatch.*lm_head.weight"):
        engine32.update_weights([good, ("lm_head.weight", torch.zeros(3, 3))])
    with pytest.raises(ValueError, match="expert 99"):
        engine32.update_weights([("model.layers.1.mlp.experts.99.up_proj.weight", torch.zeros(32, 64))])
    for k, v in engine32.model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_constructor_errors(tmp_path, model):
    with pytest.raises(ValueError, match="not a checkpoint directory"):
        HFEngine(str(tmp_path / "missing"))
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                intermediate_size=64, vocab_size=51).save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="model_type='llama'"):
        HFEngine(str(tmp_path))
    with pytest.raises(ValueError, match="dtype="):
        HFEngine(model, dtype="int8")
    with pytest.raises(ValueError, match="Qwen3MoeForCausalLM"):
        HFEngine(model.model)


def test_generate_argument_errors(engine32):
    with pytest.raises(ValueError, match="prompts\\[1\\] is empty"):
        engine32.generate([[2], []], SamplingParams())
    with pytest.raises(ValueError, match="outside"):
        engine32.generate([[2, 999]], SamplingParams())
    with pytest.raises(ValueError, match="top_p"):
        engine32.generate([[2]], SamplingParams(top_p=0.0))
    with pytest.raises(ValueError, match="sampling.n"):
        engine32.generate([[2]], SamplingParams(n=0))
