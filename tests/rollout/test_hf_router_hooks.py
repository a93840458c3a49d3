"""Tests of the forward-hook router recorder on a tiny transformers Qwen3-MoE."""

from __future__ import annotations

import gc
import math

import pytest
import torch

from moe_gspo.rollout.hf_router_hooks import HFRouterRecorder, find_routers, topk_from_router_logits
from moe_gspo.tiny import build_tiny_model, tiny_qwen3_moe_config


def _input_ids(batch=2, seq=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 51, (batch, seq), generator=g)


def _num_hooks(model):
    return sum(len(m._forward_hooks) for m in model.modules())


def _expected_moe_layers(config):
    return [i for i in range(config.num_hidden_layers)
            if i not in config.mlp_only_layers and (i + 1) % config.decoder_sparse_step == 0]


def test_topk_from_router_logits_hand_computed():
    logits = torch.tensor([[0.0, math.log(2.0), math.log(4.0)], [math.log(3.0), 0.0, 0.0]])
    ids, probs = topk_from_router_logits(logits, 2)
    assert ids[0].tolist() == [2, 1]
    assert ids[1, 0].item() == 0
    torch.testing.assert_close(probs[0], torch.tensor([4 / 7, 2 / 7]))
    torch.testing.assert_close(probs[1], torch.tensor([3 / 5, 1 / 5]))
    with pytest.raises(ValueError, match="k=4"):
        topk_from_router_logits(logits, 4)


def test_layer_ids_match_config(model):
    with HFRouterRecorder(model) as rec:
        assert rec.layer_ids == _expected_moe_layers(model.config)
        assert rec.top_k == model.config.num_experts_per_tok
        assert rec.num_experts == model.config.num_experts
    cfg = tiny_qwen3_moe_config(num_hidden_layers=4, mlp_only_layers=[], decoder_sparse_step=2)
    other = build_tiny_model(cfg)
    with HFRouterRecorder(other.model) as rec:  # the bare Qwen3MoeModel works too
        assert rec.layer_ids == _expected_moe_layers(cfg)
        assert rec.layer_ids != _expected_moe_layers(model.config)


def test_capture_equals_topk_of_router_inputs_and_logits(model):
    """Hook capture == top-k recomputed from the router's inputs and from its returned logits."""
    routers = [r for _, r in find_routers(model)]
    inputs, scores = [], []
    extra = [r.register_forward_pre_hook(lambda m, args: inputs.append(args[0].detach()))
             for r in routers]
    extra += [r.register_forward_hook(lambda m, args, out: scores.append(out[1].detach()))
              for r in routers]
    ids = _input_ids()
    try:
        with HFRouterRecorder(model) as rec, torch.no_grad():
            out = model(ids, output_router_logits=True)
            (call,) = rec.pop()
    finally:
        for h in extra:
            h.remove()
    num_tokens = ids.numel()
    assert call.topk_ids_NLK.shape == (num_tokens, len(routers), model.config.num_experts_per_tok)
    assert call.topk_ids_NLK.dtype == torch.int16
    for l, router in enumerate(routers):
        # independent recomputation: softmax(W h) over all experts, then top-k
        logits = inputs[l].reshape(-1, router.hidden_dim) @ router.weight.T
        probs_NE = torch.softmax(logits.float(), dim=-1)
        want_probs, want_ids = probs_NE.topk(router.top_k, dim=-1)
        assert torch.equal(call.topk_ids_NLK[:, l].long(), want_ids)
        torch.testing.assert_close(call.probs_NLK[:, l], want_probs, rtol=1e-5, atol=1e-6)
        # the logits transformers itself returns give the same ids
        ids_from_logits, _ = topk_from_router_logits(out.router_logits[l], router.top_k)
        assert torch.equal(call.topk_ids_NLK[:, l].long(), ids_from_logits)
        # recorded probs are pre-renormalisation: renormalising gives the router's weights
        renorm = call.probs_NLK[:, l] / call.probs_NLK[:, l].sum(-1, keepdim=True)
        torch.testing.assert_close(renorm, scores[l].float())
        assert (call.probs_NLK[:, l].sum(-1) < 1.0).all()


def test_bf16_capture_equals_router_indices():
    model = build_tiny_model(seed=1, dtype=torch.bfloat16)
    routers = [r for _, r in find_routers(model)]
    returned = []
    extra = [r.register_forward_hook(lambda m, a, out: returned.append(out[2])) for r in routers]
    with HFRouterRecorder(model, record_probs=False) as rec, torch.no_grad():
        model(_input_ids(seed=3))
        (call,) = rec.pop()
    for h in extra:
        h.remove()
    assert call.probs_NLK is None
    for l in range(len(routers)):
        assert torch.equal(call.topk_ids_NLK[:, l].long(), returned[l])


def test_pop_groups_calls_and_empties(model):
    with HFRouterRecorder(model) as rec, torch.no_grad():
        model(_input_ids(batch=2, seq=5))
        model(_input_ids(batch=3, seq=1))
        assert rec.num_pending() == 2
        calls = rec.pop()
        assert [c.topk_ids_NLK.shape[0] for c in calls] == [10, 3]
        assert rec.pop() == []


def test_disabled_records_nothing(model):
    with HFRouterRecorder(model, enabled=False) as rec, torch.no_grad():
        model(_input_ids())
        assert rec.pop() == []
        rec.enabled = True
        model(_input_ids())
        assert len(rec.pop()) == 1


def test_remove_leaves_no_hooks(model):
    before = _num_hooks(model)
    rec = HFRouterRecorder(model)
    assert _num_hooks(model) == before + rec.num_moe_layers
    rec.remove()
    rec.remove()  # idempotent
    assert _num_hooks(model) == before
    assert not rec.active
    with HFRouterRecorder(model):
        assert _num_hooks(model) > before
    assert _num_hooks(model) == before
    with torch.no_grad():
        model(_input_ids())
    assert rec.pop() == []


def test_dropped_recorder_takes_its_hooks_off(model):
    before = _num_hooks(model)
    rec = HFRouterRecorder(model)
    assert _num_hooks(model) > before
    del rec
    gc.collect()
    assert _num_hooks(model) == before


def test_model_without_moe_layers_is_rejected():
    dense = build_tiny_model(tiny_qwen3_moe_config(mlp_only_layers=[0, 1, 2]))
    with pytest.raises(ValueError, match="no MoE router"):
        HFRouterRecorder(dense)
