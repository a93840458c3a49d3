"""The transformers engine fed by the learner's weight stream (names checked up front, tensors one by one)."""

from __future__ import annotations

import pytest
import torch

from moe_gspo.mcore.model import build_gpt_model
from moe_gspo.mcore.parallel import destroy_distributed, init_distributed
from moe_gspo.mcore.weight_stream import HFWeightStream, WeightSpec
from moe_gspo.mcore.weights import load_hf_model_into_megatron
from moe_gspo.rollout.hf_engine import HFEngine
from moe_gspo.tiny import build_tiny_model, tiny_qwen3_moe_config


@pytest.fixture(scope="module")
def learner_model():
    init_distributed(ep_size=1, num_experts=8, seed=0)
    cfg = tiny_qwen3_moe_config()
    model = build_gpt_model(cfg, ep_size=1, enable_routing_replay=False)
    load_hf_model_into_megatron(model, build_tiny_model(cfg, seed=9))
    yield model
    destroy_distributed()


class _CountingStream:
    """A stream stand-in with `specs` that counts the tensors read from it."""

    def __init__(self, items, specs):
        self.items, self.specs, self.read = items, specs, 0

    def __iter__(self):
        for item in self.items:
            self.read += 1
            yield item


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_stream_loads_the_learners_weights(learner_model, layout):
    engine = HFEngine(build_tiny_model(seed=1), dtype="bfloat16", device="cpu")
    want = build_tiny_model(seed=9).state_dict()
    engine.update_weights(HFWeightStream(learner_model, layout=layout))
    got = engine.model.state_dict()
    for name, w in want.items():
        assert torch.equal(got[name], w.to(torch.bfloat16)), name


def test_bad_specs_are_refused_before_any_tensor_is_read():
    engine = HFEngine(build_tiny_model(seed=1), dtype="float32", device="cpu")
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    name = "model.norm.weight"
    for specs, msg in (([WeightSpec(name, (64,)), WeightSpec("model.layers.7.x.weight", (2,))], "unknown weight name"),
                       ([WeightSpec(name, (3,))], "shape mismatch")):
        stream = _CountingStream([(name, torch.zeros(64))], specs)
        with pytest.raises(ValueError, match=msg):
            engine.update_weights(stream)
        assert stream.read == 0
    for k, v in engine.model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_a_tensor_that_breaks_its_spec_raises_after_draining_the_stream():
    engine = HFEngine(build_tiny_model(seed=1), dtype="float32", device="cpu")
    specs = [WeightSpec("model.norm.weight", (64,)), WeightSpec("lm_head.weight", tuple(engine.model.lm_head.weight.shape))]
    items = [("model.norm.weight", torch.full((64,), 2.0)), ("lm_head.weight", torch.zeros(3, 3)),
             ("model.norm.weight", torch.zeros(64))]
    stream = _CountingStream(items, specs)
    with pytest.raises(ValueError, match="lm_head.weight"):
        engine.update_weights(stream)
    assert stream.read == 3  # drained: a real stream's remaining collectives still run
    assert torch.equal(engine.model.model.norm.weight, torch.full((64,), 2.0))  # written before the bad one
