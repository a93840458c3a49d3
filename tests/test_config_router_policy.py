"""Issue 41 deliverable 4: the router-policy config fields (model.freeze_router, model.router_dtype,
model.router_bias_update_rate, algo.router_aux_loss, algo.router_aux_loss_coef): defaults keep today's
behaviour, and every combination that cannot apply is one ValueError naming the field."""

from __future__ import annotations

import pytest

from moe_gspo.config_load import load_config
from moe_gspo.run.setup import megatron_router_overrides


def test_defaults_are_todays_behaviour():
    cfg = load_config(None)
    m, a = cfg.model, cfg.algo
    assert (m.freeze_router, m.router_dtype, m.router_bias_update_rate) == (False, None, None)
    assert (a.router_aux_loss, a.router_aux_loss_coef) == ("none", 0.0)
    assert megatron_router_overrides(cfg) == {}


def test_variants_load_and_map_to_megatron():
    cfg = load_config(None, ["model.freeze_router=true", "model.router_dtype=fp64", "algo.router_aux_loss=seq_aux_loss",
                             "algo.router_aux_loss_coef=0.001"])
    assert cfg.model.freeze_router is True
    assert megatron_router_overrides(cfg) == {"moe_router_dtype": "fp64", "moe_router_load_balancing_type": "seq_aux_loss",
                                              "moe_aux_loss_coeff": 0.001}


@pytest.mark.parametrize("overrides,msg", [
    (["model.router_dtype=fp16"], "model.router_dtype"),
    (["model.router_dtype=fp64", "rollout.engine=vllm"], "vLLM's fused MoE gate"),
    (["model.router_dtype=fp32", "rollout.quantization=fp8"], "rollout.fp8_router=false"),
    (["model.router_bias_update_rate=0.0"], "Qwen3-MoE.*has no expert bias"),
    (["model.router_bias_update_rate=0.001"], "DeepSeek-V3-style sigmoid routers"),
    (["algo.router_aux_loss=aux_loss"], "needs algo.router_aux_loss_coef > 0"),
    (["algo.router_aux_loss_coef=0.01"], "has no effect with algo.router_aux_loss=none"),
    (["algo.router_aux_loss=seq_aux_loss", "algo.router_aux_loss_coef=-1"], "must be >= 0"),
    (["algo.router_aux_loss=global_aux_loss", "algo.router_aux_loss_coef=0.1"], "algo.router_aux_loss"),
])
def test_refused_combinations(overrides, msg):
    with pytest.raises(ValueError, match=msg):
        load_config(None, overrides)


def test_fp8_rollout_with_the_gates_kept_out_is_allowed():
    cfg = load_config(None, ["model.router_dtype=fp64", "rollout.quantization=fp8", "rollout.fp8_router=false"])
    assert cfg.model.router_dtype == "fp64"
