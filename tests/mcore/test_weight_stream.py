"""The learner -> rollout weight stream at EP=1 (EP=2 runs in `_ep2_worker.py`)."""

from __future__ import annotations

import pytest
import torch

from moe_gspo.mcore.checkpoint import to_per_expert_layout
from moe_gspo.mcore.model import build_gpt_model
from moe_gspo.mcore.parallel import destroy_distributed, init_distributed
from moe_gspo.mcore.weight_stream import HFWeightStream, drain, hf_weight_specs
from moe_gspo.mcore.weights import gather_hf_state_dict, load_hf_model_into_megatron
from moe_gspo.tiny import build_tiny_model, tiny_qwen3_moe_config


@pytest.fixture(scope="module")
def megatron_model():
    init_distributed(ep_size=1, num_experts=8, seed=0)
    cfg = tiny_qwen3_moe_config()
    hf = build_tiny_model(cfg, seed=5)
    model = build_gpt_model(cfg, ep_size=1, enable_routing_replay=False, vocab_pad_multiple=16)
    load_hf_model_into_megatron(model, hf)
    yield cfg, hf, model
    destroy_distributed()


@pytest.mark.parametrize("tied", [False, True])
def test_specs_are_the_models_names_and_shapes(tied):
    cfg = tiny_qwen3_moe_config(tie_word_embeddings=tied)
    fused = {k: tuple(v.shape) for k, v in build_tiny_model(cfg, seed=0).state_dict().items()
             if not (tied and k == "lm_head.weight")}
    specs = hf_weight_specs(cfg, layout="fused")
    assert {s.name: s.shape for s in specs} == fused and len(specs) == len(fused)
    per_expert = {k: tuple(v.shape) for k, v in to_per_expert_layout(build_tiny_model(cfg, seed=0).state_dict(),
                                                                      cfg).items() if k in fused or ".experts." in k}
    assert {s.name: s.shape for s in hf_weight_specs(cfg)} == per_expert
    with pytest.raises(ValueError, match="layout"):
        hf_weight_specs(cfg, layout="sharded")


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_stream_equals_the_gathered_state_dict_in_spec_order(megatron_model, layout):
    cfg, _, model = megatron_model
    stream = HFWeightStream(model, layout=layout)
    got = list(stream)
    assert [n for n, _ in got] == [s.name for s in stream.specs] and len(stream) == len(got)
    want = gather_hf_state_dict(model, layout=layout)
    assert set(want) == {n for n, _ in got}
    for name, t in got:
        assert torch.equal(t, want[name]), name
    # one bucket per decoder layer plus the embedding and the tail
    assert stream.stats.num_buckets == cfg.num_hidden_layers + 2
    assert stream.stats.num_tensors == len(got)
    assert stream.stats.bytes_yielded == sum(t.numel() * t.element_size() for _, t in got)


def test_stream_memory_is_one_layer_not_the_model(megatron_model):
    cfg, _, model = megatron_model
    E, I, H = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    layer_experts = E * 3 * I * H * 4
    fused = HFWeightStream(model, layout="fused")
    drain(iter(fused))
    # EP=1, fused: one layer's experts staged once (plus q/k/v copies), never the whole model
    assert layer_experts <= fused.stats.peak_bucket_bytes < 2 * layer_experts
    assert fused.stats.peak_bucket_bytes < fused.stats.bytes_yielded / 3
    per_expert = HFWeightStream(model)
    drain(iter(per_expert))  # EP=1, per-expert: views of the parameters, only q/k/v are copied
    qkv_bytes = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim * H * 4
    assert per_expert.stats.peak_bucket_bytes == qkv_bytes


def test_yielded_tensors_follow_the_parameters(megatron_model):
    cfg, _, model = megatron_model
    before = dict(HFWeightStream(model))
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    ref = before[name].clone()
    param = dict(model.named_parameters())["decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight"]
    with torch.no_grad():
        param.add_(1.0)
    after = dict(HFWeightStream(model))
    assert torch.equal(after[name], ref + 1.0)
    with torch.no_grad():
        param.sub_(1.0)
