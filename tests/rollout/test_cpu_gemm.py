"""bf16 GEMMs as fp32 GEMMs of the bf16 values, and attention computed in fp32 from bf16 inputs
(moe_gspo/rollout/cpu_gemm.py): the rounding points of a bf16 engine, so the same rollouts up to the order
of fp32 additions and the attention probabilities' rounding, with the same gap to an fp32 model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from moe_gspo.rollout.base import SamplingParams
from moe_gspo.rollout.cpu_gemm import ATTENTION_FP32, Fp32GemmForBf16, fp32_copy, fp32_gemms_in, needs_fp32_gemm
from moe_gspo.rollout.hf_engine import HFEngine
from moe_gspo.tiny import build_tiny_model
from moe_gspo.tensor_cache import TensorCache


def _bf16(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


def test_gemms_inside_the_mode_are_fp32_gemms_of_the_bf16_values_rounded_once():
    x, w, w3 = _bf16(128, 64), _bf16(96, 64, seed=1), _bf16(4, 64, 32, seed=2)
    offs = torch.tensor([10, 10, 70, 128], dtype=torch.int32)  # an empty group too
    with Fp32GemmForBf16():
        lin, mm, gmm = F.linear(x, w), x @ w.T, torch._grouped_mm(x, w3, offs=offs)
        elementwise = x * 3  # not a GEMM: untouched, still bf16 arithmetic
    assert lin.dtype == mm.dtype == gmm.dtype == elementwise.dtype == torch.bfloat16
    assert torch.equal(lin, F.linear(x.float(), w.float()).bfloat16())
    assert torch.equal(mm, (x.float() @ w.float().T).bfloat16())
    assert torch.equal(gmm, torch._grouped_mm(x.float(), w3.float(), offs=offs).bfloat16())
    # ... and within one bf16 rounding of torch's own bf16 kernels (both accumulate in fp32)
    for ours, native in ((lin, F.linear(x, w)), (gmm, torch._grouped_mm(x, w3, offs=offs))):
        ulp = native.float().abs().clamp(min=1e-3) * 2.0 ** -7
        assert ((ours.float() - native.float()).abs() <= ulp).all()
    # fp32 inputs are left alone
    with Fp32GemmForBf16():
        assert F.linear(x.float(), w.float()).dtype == torch.float32


def test_applies_to_bf16_on_cpu_only():
    assert not needs_fp32_gemm("cpu", torch.float32)
    assert not needs_fp32_gemm("cuda", torch.bfloat16)
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert needs_fp32_gemm("cpu", torch.bfloat16) == (not native)


def _fp32_gap(model, prompts, samples) -> np.ndarray:
    """|log-prob of each sampled token under the fp32 model - the engine's log-prob|."""
    gaps = []
    with torch.no_grad():
        for s in samples:
            prompt = prompts[s.prompt_index]
            ids = torch.tensor([list(prompt) + list(s.response_ids)])
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)[len(prompt) - 1:-1]
            ref = logp.gather(-1, torch.as_tensor(s.response_ids)[:, None]).squeeze(-1).numpy()
            gaps.append(np.abs(ref - s.response_logprobs))
    return np.concatenate(gaps)


def test_engine_rollouts_match_the_native_bf16_kernels():
    """Same seed, same weights: the same sampled tokens but for rare rounding-decided draws, log-probs
    within bf16 rounding of torch's native bf16 kernels, routes equal but for rare flips, and the same
    gap to the fp32 model (the train-inference mismatch the drift metrics measure)."""
    model = build_tiny_model(seed=0)
    # prompts of different lengths: the shorter ones are left-padded, so the attention mask matters
    prompts = [[2, 5, 6, 7, 8, 9, 10, 11], [2, 9, 12], [2, 3, 4, 5, 3, 4, 5, 6, 7, 8, 9, 10],
               [2, 17, 16, 15, 14]]
    sampling = SamplingParams(n=8, max_new_tokens=12, seed=3)
    native = HFEngine(model, dtype="bfloat16", device="cpu", fp32_gemm=False).generate(prompts, sampling)
    ours = HFEngine(model, dtype="bfloat16", device="cpu", fp32_gemm=True).generate(prompts, sampling)
    same = [np.array_equal(a.response_ids, b.response_ids) for a, b in zip(native, ours)]
    assert np.mean(same) >= 0.9
    dlogp = np.concatenate([np.abs(a.response_logprobs - b.response_logprobs)
                            for a, b, eq in zip(native, ours, same) if eq])
    assert dlogp.max() < 2e-2 and np.median(dlogp) < 2e-3
    same_routes = np.concatenate([(a.routes_TLK == b.routes_TLK).all(-1).ravel()
                                  for a, b, eq in zip(native, ours, same) if eq])
    assert same_routes.mean() > 0.98
    gap_native, gap_ours = _fp32_gap(model, prompts, native).mean(), _fp32_gap(model, prompts, ours).mean()
    assert gap_native > 1e-4  # there is a bf16 mismatch to keep ...
    assert 0.8 < gap_ours / gap_native < 1.25  # ... and the fast path keeps its size


def test_scoped_fp32_gemms_equal_the_mode_over_the_whole_model_and_restore_the_forwards():
    """`fp32_gemms_in` (the engine's: the mode only inside modules that own a matrix, nn.Linear
    directly, cached fp32 weights) computes exactly what the mode over the whole forward computes with
    the same attention: same logits bit for bit; forwards and attention implementation restored."""
    model = build_tiny_model(seed=0).to(torch.bfloat16)
    ids = torch.tensor([[2, 5, 6, 7, 8, 9, 10, 11], [0, 0, 0, 2, 9, 12, 13, 14]])  # row 1 left-padded
    mask = (ids != 0).long()
    assert model.config._attn_implementation == "sdpa"
    with torch.inference_mode():
        x = _bf16(64, model.config.hidden_size, seed=1)
        with fp32_gemms_in(model, TensorCache()):
            assert model.config._attn_implementation == ATTENTION_FP32
            scoped = model(input_ids=ids, attention_mask=mask).logits
            again = model(input_ids=ids, attention_mask=mask).logits  # the cached fp32 weights: same numbers
            alone = model(input_ids=ids[1:, 3:]).logits  # the padded row computed without its padding
            head = model.lm_head(x)
        model.config._attn_implementation = ATTENTION_FP32
        try:
            with Fp32GemmForBf16():
                whole = model(input_ids=ids, attention_mask=mask).logits
        finally:
            model.config._attn_implementation = "sdpa"
    assert torch.equal(whole, scoped) and torch.equal(scoped, again)
    # the padding is masked out: the padded row's real positions are what they are alone (bf16 rounding)
    assert (scoped[1, 3:].float() - alone[0].float()).abs().max() < 0.05
    assert torch.equal(head, F.linear(x.float(), model.lm_head.weight.float()).bfloat16())
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert model.config._attn_implementation == "sdpa"


def test_fp32_attention_is_sdpa_of_the_upcast_inputs_rounded_once():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from moe_gspo.rollout.cpu_gemm import sdpa_fp32_for_bf16

    model = build_tiny_model(seed=0).to(torch.bfloat16)
    attn = model.model.layers[0].self_attn
    q, k, v = _bf16(3, 4, 5, 32, seed=1), _bf16(3, 2, 5, 32, seed=2), _bf16(3, 2, 5, 32, seed=3)
    mask = torch.ones(3, 1, 5, 5, dtype=torch.bool).tril()
    got, _ = sdpa_fp32_for_bf16(attn, q, k, v, mask, scaling=attn.scaling)
    want, _ = sdpa_attention_forward(attn, q.float(), k.float(), v.float(), mask, scaling=attn.scaling)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want.bfloat16())


def test_cached_fp32_weights_follow_in_place_updates():
    w = torch.nn.Parameter(_bf16(8, 4), requires_grad=False)
    cache = TensorCache()
    first = fp32_copy(cache, w)
    assert first.dtype == torch.float32 and torch.equal(first, w.float()) and fp32_copy(cache, w) is first  # reused
    with torch.no_grad():
        w[2].copy_(torch.full((4,), 3.0))  # a weight sync writes through views: the version counter moves
    assert torch.equal(fp32_copy(cache, w), w.float()) and float(fp32_copy(cache, w)[2, 0]) == 3.0
    act = _bf16(2, 4)
    assert torch.equal(fp32_copy(cache, act), act.float())  # an activation is cast every time, never cached
    assert len(cache) == 1


def test_engine_uses_synced_weights_not_stale_fp32_copies():
    """After update_weights, a generation equals a fresh engine's on the new weights (no stale cache)."""
    a, b = build_tiny_model(seed=0), build_tiny_model(seed=1)
    prompts = [[2, 5, 6, 7, 8, 9, 10, 11]]
    sampling = SamplingParams(n=4, max_new_tokens=8, seed=5)
    engine = HFEngine(a, dtype="bfloat16", device="cpu", fp32_gemm=True)
    before = engine.generate(prompts, sampling)
    engine.update_weights(b.state_dict().items())
    after = engine.generate(prompts, sampling)
    fresh = HFEngine(b, dtype="bfloat16", device="cpu", fp32_gemm=True).generate(prompts, sampling)
    for x, y in zip(after, fresh):
        assert np.array_equal(x.response_ids, y.response_ids)
        assert np.array_equal(x.response_logprobs, y.response_logprobs)
    assert any(not np.array_equal(x.response_logprobs, y.response_logprobs) for x, y in zip(before, after))


def test_fp32_gemm_true_where_it_does_not_apply_is_an_error_naming_the_field():
    model = build_tiny_model(seed=0)
    with pytest.raises(ValueError, match=r"fp32_gemm=True \(rollout.fp32_gemm=true\).*runs torch.float32 on cpu"):
        HFEngine(model, dtype="float32", device="cpu", fp32_gemm=True)
    assert not HFEngine(model, dtype="float32", device="cpu").fp32_gemm  # None: off where it does not apply
