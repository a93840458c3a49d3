"""W8A8 FP8 rollouts (moe_gspo/rollout/fp8.py, `rollout.fp8_activations`): the dynamic per-token activation
quantizer by hand, where the engine applies it, both decoders alike, and the config checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moe_gspo.config_load import config_from_dict
from moe_gspo.rollout.base import SamplingParams
from moe_gspo.rollout.fp8 import (FP8_E4M3_MAX, FP8_MIN_ACTIVATION_SCALE, Fp8ActivationQuantizer,
                                  fake_quantize_fp8_per_token, rollout_precision)
from moe_gspo.rollout.hf_engine import HFEngine
from moe_gspo.tiny import build_tiny_model, tiny_qwen3_moe_config

PROMPTS = [[2, 5, 6, 7, 8, 9, 10, 11], [2, 9, 12], [2, 3, 4, 5, 3, 4, 5, 6, 7, 8, 9, 10], [2, 17, 16, 15]]
SAMPLING = SamplingParams(n=6, max_new_tokens=10, seed=5)
MODELS = {
    "default": {},  # 8 experts top-2: the compact decoder computes every expert itself
    "many experts": dict(num_experts=24, norm_topk_prob=False, mlp_only_layers=[]),  # the experts module runs
}


# ----------------------------------------------------------------------------- the quantizer, by hand
def test_row_with_amax_448_maps_to_itself_on_the_grid():
    row = torch.tensor([[448.0, -448.0, 1.0, 0.5625, -3.5, 0.001953125, 0.0, 240.0]])  # all e4m3 values
    assert torch.equal(fake_quantize_fp8_per_token(row), row)  # scale 1: q = x


def test_between_two_grid_points_rounds_as_torchs_cast():
    # scale 1 (amax 448): 1.0625 lies halfway between 1.0 and 1.125 -> ties to even mantissa 1.0;
    # 1.1875 halfway between 1.125 and 1.25 -> 1.25 (even); 1.1 -> nearest 1.125; 300 -> 288 (step 32)
    row = torch.tensor([[448.0, 1.0625, 1.1875, 1.1, 300.0]])
    expected = [448.0, 1.0, 1.25, 1.125, 288.0]
    assert fake_quantize_fp8_per_token(row).tolist()[0] == expected
    assert row.to(torch.float8_e4m3fn).float().tolist()[0] == expected  # what torch's cast does


def test_zero_row_stays_zero_and_scale_is_per_row():
    # row 0: amax 896 -> scale 2: 3.0 -> 1.5 exact, 1.1 -> 0.55 -> 0.5625 -> 1.125
    # row 1: zeros; row 2: amax 44.8 -> scale 0.1: 44.8 -> 448, 1.0 -> 10 on the grid (10 = 1.25 * 8)
    x = torch.tensor([[896.0, 3.0, 1.1], [0.0, 0.0, 0.0], [44.8, 1.0, -44.8]])
    y = fake_quantize_fp8_per_token(x)
    assert y[0].tolist() == [896.0, 3.0, 1.125]
    assert y[1].tolist() == [0.0, 0.0, 0.0]
    s = torch.tensor(44.8) / FP8_E4M3_MAX  # fp32, as the quantizer computes it
    assert y[2].tolist() == [(torch.tensor(448.0) * s).item(), (torch.tensor(10.0) * s).item(),
                             (torch.tensor(-448.0) * s).item()]
    # per row, not per tensor: a per-tensor scale (2) would flush row 2's 1.0 to 1.0 / 2 = 0.5 -> 1.0 exactly,
    # but 44.8 / 2 = 22.4 -> 22 -> 44; per row 44.8 stays 44.8
    assert abs(y[2, 0].item() - 44.8) < 1e-5


def test_tiny_rows_use_the_minimum_scale_and_dtype_is_kept():
    x = torch.tensor([[1e-6, -2e-7]], dtype=torch.bfloat16)
    y = fake_quantize_fp8_per_token(x)
    assert y.dtype == torch.bfloat16
    s = FP8_MIN_ACTIVATION_SCALE  # 1 / (448 * 512): amax / 448 is below it
    q = (x.float() / s).to(torch.float8_e4m3fn).float()
    assert torch.equal(y, (q * s).to(torch.bfloat16))
    assert fake_quantize_fp8_per_token(torch.zeros(0, 4)).shape == (0, 4)


def test_leading_dims_are_tokens():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 16) * torch.logspace(-2, 2, 3)[None, :, None]
    y = fake_quantize_fp8_per_token(x)
    for i in range(2):
        for t in range(3):
            assert torch.equal(y[i, t], fake_quantize_fp8_per_token(x[i, t][None])[0])


# ----------------------------------------------------------------------------- where the engine applies it
def _model(name="default"):
    return build_tiny_model(tiny_qwen3_moe_config(**MODELS[name]), seed=1)


def test_hooked_layers(model):
    eng = HFEngine(model, device="cpu", quantization="fp8", fp8_activations=True, compact_decode=False)
    names = set(eng._fp8_act.names)
    assert "model.layers.0.self_attn.q_proj" in names and "model.layers.0.mlp.down_proj" in names
    assert "model.layers.1.mlp.experts" in names and "model.layers.1.mlp.gate" in names
    assert "lm_head" not in names and not any("norm" in n or "embed" in n for n in names)
    no_router = Fp8ActivationQuantizer(eng.model, router=False)
    assert "model.layers.1.mlp.gate" not in no_router.names
    no_router.remove()


def test_inputs_of_every_quantized_gemm_are_on_a_per_token_grid(model):
    """Record the activation operand of every GEMM of transformers' forward: on its per-row e4m3 grid with
    W8A8 (the experts' down-projection input included), not without."""
    from torch.overrides import TorchFunctionMode

    seen = []
    gemms_fns = (torch.nn.functional.linear, torch._grouped_mm, getattr(torch.nn.functional, "grouped_mm", None))

    class Record(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in gemms_fns:
                seen.append((args[1].shape, args[0]))
            return func(*args, **kwargs)

    for w8a8 in (True, False):
        eng = HFEngine(model, device="cpu", quantization="fp8", fp8_activations=w8a8, compact_decode=False,
                       fp32_gemm=False)
        seen.clear()
        with Record():
            eng.generate([[2, 5, 6, 7]], SamplingParams(n=1, max_new_tokens=2, seed=0))
        vocab = eng.vocab_size
        gemms = [(shape, x) for shape, x in seen if shape[0] != vocab]  # lm_head stays bf16
        assert len(gemms) > 20
        on_grid = [torch.equal(fake_quantize_fp8_per_token(x), x) for _, x in gemms]
        assert all(on_grid) if w8a8 else not any(on_grid)
        # the experts' down projection ([E, H, I] transposed) gets its input from _apply_gate
        assert any(len(shape) == 3 and shape[-1] == model.config.hidden_size for shape, _ in gemms)


@pytest.fixture(scope="module")
def rollouts(model):
    out = {}
    for name, kw in {"bf16": {}, "fp8": dict(quantization="fp8"),
                     "w8a8": dict(quantization="fp8", fp8_activations=True)}.items():
        out[name] = HFEngine(model, device="cpu", **kw).generate(PROMPTS, SAMPLING)
    return out


def _logprobs(samples):
    return np.concatenate([s.response_logprobs for s in samples])


def test_w8a8_differs_from_weight_only_and_from_bf16(rollouts):
    for other in ("bf16", "fp8"):
        a, b = rollouts["w8a8"], rollouts[other]
        same_tokens = all(np.array_equal(x.response_ids, y.response_ids) for x, y in zip(a, b))
        assert not same_tokens or not np.array_equal(_logprobs(a), _logprobs(b)), other
    # and the routes of the prompts (same tokens fed) change somewhere
    assert any(not np.array_equal(x.routes_TLK[:len(x.prompt_ids)], y.routes_TLK[:len(y.prompt_ids)])
               for x, y in zip(rollouts["w8a8"], rollouts["fp8"]))


ENGINES = {"bf16 as fp32 GEMMs": dict(fp32_gemm=True), "bf16 kernels": dict(fp32_gemm=False)}


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("engine_name", list(ENGINES))
@pytest.mark.parametrize("router", [True, False])
def test_both_decoders_apply_w8a8_alike(model_name, engine_name, router):
    model = _model(model_name)
    kw = dict(device="cpu", quantization="fp8", fp8_activations=True, fp8_router=router, **ENGINES[engine_name])
    reference = HFEngine(model, compact_decode=False, **kw)
    engine = HFEngine(model, compact_decode=True, **kw)
    ref, ours = reference.generate(PROMPTS, SAMPLING), engine.generate(PROMPTS, SAMPLING)
    assert [s.finish_reason for s in ref] == [s.finish_reason for s in ours]
    for a, b in zip(ref, ours):
        np.testing.assert_array_equal(a.response_ids, b.response_ids)
        np.testing.assert_array_equal(a.routes_TLK, b.routes_TLK)
        np.testing.assert_array_equal(a.response_logprobs, b.response_logprobs)
        np.testing.assert_array_equal(a.router_probs_TLK, b.router_probs_TLK)
    # and W8A8 is on in both: the compact decoder's rollouts differ from weight-only FP8's
    weight_only = HFEngine(model, compact_decode=True, **{**kw, "fp8_activations": False}).generate(PROMPTS, SAMPLING)
    assert not np.array_equal(_logprobs(weight_only), _logprobs(ours)) or any(
        not np.array_equal(x.response_ids, y.response_ids) for x, y in zip(weight_only, ours))


def test_eager_experts_and_missing_quantization_are_refused(model):
    with pytest.raises(ValueError, match="fp8_activations=True .*pass quantization='fp8'"):
        HFEngine(model, device="cpu", fp8_activations=True)
    eager = build_tiny_model(seed=0)
    eager.config._experts_implementation = "eager"
    with pytest.raises(ValueError, match="'eager' implementation.*down-projection input"):
        HFEngine(eager, device="cpu", quantization="fp8", fp8_activations=True)


def test_remove_restores_the_weight_only_forward(model):
    eng = HFEngine(model, device="cpu", quantization="fp8", compact_decode=False)
    ref = eng.generate(PROMPTS, SAMPLING)
    hooks = Fp8ActivationQuantizer(eng.model)
    assert not np.array_equal(_logprobs(ref), _logprobs(eng.generate(PROMPTS, SAMPLING)))
    hooks.remove()
    np.testing.assert_array_equal(_logprobs(ref), _logprobs(eng.generate(PROMPTS, SAMPLING)))
    assert not any("_apply_gate" in m.__dict__ for m in eng.model.modules())


# ----------------------------------------------------------------------------- config
def test_config_checks():
    cfg = config_from_dict({"rollout": {"quantization": "fp8", "fp8_activations": True}})
    assert cfg.rollout.fp8_activations and not config_from_dict({}).rollout.fp8_activations
    with pytest.raises(ValueError, match="rollout.fp8_activations=true needs rollout.quantization=fp8"):
        config_from_dict({"rollout": {"fp8_activations": True}})
    with pytest.raises(ValueError, match="rollout.fp8_activations=true is for the hf engine.*already W8A8"):
        config_from_dict({"rollout": {"quantization": "fp8", "fp8_activations": True, "engine": "vllm"}})


def test_precision_label():
    assert rollout_precision("bfloat16", "fp8", None, "hf", fp8_activations=True) == (
        "bfloat16 with FP8 (e4m3) weights and per-token activations (W8A8), per-channel scales (emulated)")
    assert rollout_precision("bfloat16", "fp8") == "bfloat16 with FP8 (e4m3) weights, per-channel scales (emulated)"
