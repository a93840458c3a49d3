"""Issue 41 deliverable 4, rollout side: model.router_dtype on the transformers engine
(moe_gspo/rollout/router_dtype.py): gate weights kept and routing computed in fp32 / fp64."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moe_gspo.rollout.base import SamplingParams
from moe_gspo.rollout.hf_engine import HFEngine
from moe_gspo.rollout.hf_router_hooks import find_routers
from moe_gspo.rollout.router_dtype import route_in_dtype
from moe_gspo.tiny import build_tiny_model

PROMPTS = [[2, 5, 6, 7, 8, 9, 10, 11], [2, 9, 12], [2, 17, 16, 15]]
SAMPLING = SamplingParams(n=4, max_new_tokens=8, seed=5)


@pytest.fixture(scope="module")
def model():
    return build_tiny_model(seed=1)


@pytest.mark.parametrize("router_dtype,torch_dtype", [("fp32", torch.float32), ("fp64", torch.float64)])
def test_gates_are_kept_in_the_router_dtype_and_the_sync_does_not_round_them(model, router_dtype, torch_dtype):
    engine = HFEngine(model, dtype="bfloat16", device="cpu", router_dtype=router_dtype)
    gates = [g for _, g in find_routers(engine.model)]
    assert gates and all(g.weight.dtype == torch_dtype for g in gates)
    assert engine.model.model.embed_tokens.weight.dtype == torch.bfloat16  # everything else stays in rollout.dtype
    src = {k: v.float() + 1e-4 * torch.randn_like(v.float()) for k, v in model.state_dict().items()}
    engine.update_weights(src.items())
    for (layer, gate) in find_routers(engine.model):
        exact = src[f"model.layers.{layer}.mlp.gate.weight"]
        assert torch.equal(gate.weight, exact.to(torch_dtype))  # fp32 learner weights, not rounded to bf16
    plain = HFEngine(model, dtype="bfloat16", device="cpu")  # without: the sync rounds the gates to bf16
    plain.update_weights(src.items())
    layer, gate = find_routers(plain.model)[0]
    assert gate.weight.dtype == torch.bfloat16 and not torch.equal(gate.weight.float(), src[f"model.layers.{layer}.mlp.gate.weight"])

def test_route_in_dtype_matches_a_hand_computation():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 16, generator=g).to(torch.bfloat16)
    w = torch.randn(8, 16, generator=g, dtype=torch.float64)
    logits, weights, ids = route_in_dtype(x, w, 2, True)
    ref_logits = x.double() @ w.T
    ref_top, ref_ids = torch.softmax(ref_logits, -1).topk(2, -1)
    assert logits.dtype == torch.float64 and torch.allclose(logits, ref_logits, rtol=0, atol=1e-12)
    assert torch.equal(ids, ref_ids)
    assert weights.dtype == torch.bfloat16
    assert torch.equal(weights, (ref_top / ref_top.sum(-1, keepdim=True)).to(torch.bfloat16))


@pytest.mark.parametrize("fp32_gemm", [True, False])
def test_compact_decode_and_transformers_route_alike_in_fp64(model, fp32_gemm):
    kw = dict(dtype="bfloat16", device="cpu", fp32_gemm=fp32_gemm, router_dtype="fp64")
    ref = HFEngine(model, compact_decode=False, **kw).generate(PROMPTS, SAMPLING)
    engine = HFEngine(model, **kw)
    assert engine.compact_decode
    ours = engine.generate(PROMPTS, SAMPLING)
    for a, b in zip(ref, ours):
        np.testing.assert_array_equal(a.response_ids, b.response_ids)
        np.testing.assert_array_equal(a.routes_TLK, b.routes_TLK)
        np.testing.assert_array_equal(a.response_logprobs, b.response_logprobs)
        np.testing.assert_array_equal(a.router_probs_TLK, b.router_probs_TLK)
        np.testing.assert_array_equal(a.router_margin_TL, b.router_margin_TL)


def test_fp64_routes_are_the_top_k_of_the_fp64_logits(model):
    """The recorded routes are those of the fp64 router: the top-k of fp64 logits of the same hidden states."""
    engine = HFEngine(model, dtype="bfloat16", device="cpu", router_dtype="fp64", compact_decode=False)
    seen = []
    hooks = [g.register_forward_hook(lambda m, a, out: seen.append((a[0], out))) for _, g in find_routers(engine.model)]
    engine.generate(PROMPTS[:1], SamplingParams(n=1, max_new_tokens=2, seed=0))
    for h in hooks:
        h.remove()
    assert seen
    gates = [g for _, g in find_routers(engine.model)]
    for i, (x, (logits, weights, ids)) in enumerate(seen):  # each forward calls the gates in layer order
        gate = gates[i % len(gates)]
        assert logits.dtype == torch.float64 and weights.dtype == torch.bfloat16
        ref = torch.nn.functional.linear(x.reshape(-1, x.shape[-1]).double(), gate.weight)
        assert torch.equal(ids, torch.softmax(ref, -1).topk(ids.shape[-1], -1).indices)


def test_an_fp8_router_is_refused(model):
    with pytest.raises(ValueError, match="fp8_router=False"):
        HFEngine(model, dtype="bfloat16", device="cpu", router_dtype="fp64", quantization="fp8")
    engine = HFEngine(model, dtype="bfloat16", device="cpu", router_dtype="fp64", quantization="fp8", fp8_router=False)
    assert all(g.weight.dtype == torch.float64 for _, g in find_routers(engine.model))
    engine.generate(PROMPTS[:1], SamplingParams(n=1, max_new_tokens=2, seed=0))
