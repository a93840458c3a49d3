"""Hand counts of the short-lived allocations the plan adds (issue 20, claims 5 and 7) and where they land."""

from __future__ import annotations

import pytest

from moe_gspo.plan.params import Geometry
from moe_gspo.plan.transients import (export_transient_bytes, foreach_adam_bytes, sample_gather_bytes,
                                      sample_payload_bytes, sync_transient_bytes, vllm_module_params)
from tests.plan.test_plan_memory import cfg, plan30  # noqa: F401  (fixtures and helpers)
from tests.plan.test_plan_memory import hf30  # noqa: F401
from tests.plan.test_plan_params import geometry

GIB = float(1 << 30)


def test_foreach_adam_temporary_is_4_bytes_per_optimizer_parameter():
    assert foreach_adam_bytes(optimizer_params=1e9, fused_adam=False, precision_aware=False) == 4e9
    assert foreach_adam_bytes(optimizer_params=1e9, fused_adam=True, precision_aware=False) == 0
    assert foreach_adam_bytes(optimizer_params=1e9, fused_adam=False, precision_aware=True) == 0


def test_sync_transient_hand_count_30b():
    g = geometry("Qwen3-30B-A3B")
    qkv = 40 * 128 * 2048
    experts = 128 * 3 * 768 * 2048
    # EP=8, TP=8, bf16 both sides: q/k/v copies + all experts gathered, then the larger of the own-expert
    # staging (1/8 of the experts, while gathering) and vLLM's materialized module (the vocabulary shard
    # 151936/8 x 2048 beats the experts at I/8: 128 x 3 x 96 x 2048)
    assert vllm_module_params(g, tp=8) == max(18992 * 2048, 128 * 3 * 96 * 2048)
    tp8 = sync_transient_bytes(g, ep=8, tp=8, param_bytes=2, rollout_bytes=2, engine="vllm")
    assert tp8 == 2 * (qkv + experts) + max(2 * experts / 8, 2 * 18992 * 2048)
    # TP=1: vLLM re-materializes a whole MoE layer's experts
    tp1 = sync_transient_bytes(g, ep=8, tp=1, param_bytes=2, rollout_bytes=2, engine="vllm")
    assert tp1 == 2 * (qkv + experts) + 2 * experts
    # EP=1, transformers engine: the per-expert tensors are views, only q/k/v are copied
    assert sync_transient_bytes(g, ep=1, tp=1, param_bytes=2, rollout_bytes=2, engine="hf") == 2 * qkv
    assert export_transient_bytes(g, ep=8, param_bytes=2) == 2 * (qkv + experts) + 2 * experts / 8
    # fp32 learner -> bf16 engine: vLLM buffers the cast copies of the experts too
    mixed = sync_transient_bytes(g, ep=8, tp=1, param_bytes=4, rollout_bytes=2, engine="vllm")
    assert mixed == 4 * (qkv + experts) + max(4 * experts / 8, 2 * experts + 2 * experts)


def test_sample_gather_hand_count():
    g = geometry("Qwen3-30B-A3B")
    # 64 samples of 5120 tokens: ids (int64) + log-prob (fp32) + 48 layers x top-8 uint8 routes
    payload = sample_payload_bytes(g, num_seqs=64, seq_len=5120, record_routes=True, record_probs=False)
    assert payload == 64 * 5120 * (8 + 4 + 48 * 8)
    assert sample_gather_bytes(payload, world=8) == 9 * payload
    assert sample_gather_bytes(payload, world=1) == 0
    big = Geometry(**{**g.__dict__, "num_experts": 512})
    assert sample_payload_bytes(big, num_seqs=1, seq_len=1, record_routes=True, record_probs=True) == 12 + 48 * 8 * 4


def test_plan_places_the_new_terms(hf30):  # noqa: F811
    res = plan30(hf30, "rollout.tensor_parallel_size=1", "rollout.record_routes=true",
                 "train.offload_during_rollout=all", "rollout.kv_cache_gib=8")
    ph = {p.name: p.parts_gib for p in res.phases}
    assert [p.name for p in res.phases] == ["engine_startup", "rollout", "logprobs", "update", "optimizer_step",
                                            "weight_sync", "hf_export"]
    # the engine starts next to the learner's rollout-phase memory ("all": parameters on the host)
    assert "learner_params" not in ph["engine_startup"] and ph["engine_startup"]["rollout_kv"] == 8
    assert ph["rollout"]["sample_gather"] == pytest.approx(9 * 64 * 5120 * (12 + 48 * 8) / GIB)
    # a sync wakes the weights only: no KV cache next to the learner's weights
    assert ph["weight_sync"]["rollout_resident"] == pytest.approx(res.components_gib["rollout_weights_gib"] + 0.5)
    assert "rollout_kv" not in ph["weight_sync"] and ph["weight_sync"]["learner_params"] > 0
    assert ph["hf_export"]["export_transient"] == pytest.approx(res.components_gib["export_transient_gib"])
    no_export = plan30(hf30, "train.export_hf=false")
    assert "hf_export" not in [p.name for p in no_export.phases]


def test_foreach_adam_only_without_transformer_engine(hf30):  # noqa: F811
    base = ("train.precision_aware_optimizer=false", "train.optimizer_cpu_offload=false")
    kw = dict(hf_config=hf30, model_source="test")
    from moe_gspo.plan.from_config import plan_for_config

    te = plan_for_config(cfg("configs/qwen3_30b_a3b.yaml", *base), num_gpus=8, gpu_mem_gib=80, attention="flash", **kw)
    torch_adam = plan_for_config(cfg("configs/qwen3_30b_a3b.yaml", *base), num_gpus=8, gpu_mem_gib=80,
                                 attention="unfused", **kw)
    shard = te.params["optimizer_shard"]
    assert te.components_gib["optimizer_step_transient_gib"] == 0  # fp32 grads, fused Adam
    assert torch_adam.components_gib["optimizer_step_transient_gib"] == pytest.approx(4 * shard / GIB)
