"""Issue 41 deliverable 4, learner side: the router-policy axes (model.freeze_router, model.router_dtype,
algo.router_aux_loss / router_aux_loss_coef) on the Megatron learner (docs/algorithms.md, "Router policy
during RL")."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _learner_common import make_batch, make_learner, old_pass, params_snapshot
from moe_gspo.config import AlgoConfig
from moe_gspo.mcore.model import (build_gpt_model, freeze_routers, moe_routers, router_policy_overrides,
                                  transformer_config_from_hf)
from moe_gspo.mcore.weights import load_hf_model_into_megatron
from moe_gspo.tiny import build_tiny_model, tiny_qwen3_moe_config


def _pair(**overrides):
    cfg = tiny_qwen3_moe_config()
    hf = build_tiny_model(cfg, seed=0)
    model = build_gpt_model(cfg, enable_routing_replay=True, **overrides)
    load_hf_model_into_megatron(model, hf)
    return cfg, model


def _router_names(model) -> set[str]:
    ids = {id(p) for r in moe_routers(model) for p in r.parameters()}
    return {k for k, p in model.named_parameters() if id(p) in ids}


def test_frozen_router_stays_bit_identical_while_the_rest_trains(dist):
    cfg, model = _pair()
    assert freeze_routers(model) == 2  # one gate weight per MoE layer of the tiny model
    learner = make_learner(model, cfg, dist, lr=1e-2)
    before = params_snapshot(model)
    routers = _router_names(model)
    assert routers and all(not p.requires_grad for r in moe_routers(model) for p in r.parameters())
    for seed in (1, 2):  # two train steps
        batch = make_batch(8, seed=seed)
        learner.train_step(batch, old_pass(batch.rollout_logp_BS))
    after = params_snapshot(model)
    for k in routers:
        assert torch.equal(before[k], after[k]), k
    changed = [k for k in before if k not in routers and not torch.equal(before[k], after[k])]
    others = [k for k in before if k not in routers]
    assert any("experts" in k for k in changed) and any("self_attention" in k for k in changed)
    assert len(changed) == len(others)  # every trainable tensor moved


def test_routers_train_by_default(dist):
    cfg, model = _pair()
    learner = make_learner(model, cfg, dist, lr=1e-2)
    before = params_snapshot(model)
    batch = make_batch(8, seed=1)
    learner.train_step(batch, old_pass(batch.rollout_logp_BS))
    after = params_snapshot(model)
    assert all(not torch.equal(before[k], after[k]) for k in _router_names(model))


def test_router_policy_overrides_keep_the_default_mapping():
    cfg = tiny_qwen3_moe_config()
    assert router_policy_overrides() == {}
    base = transformer_config_from_hf(cfg)
    assert (base.moe_router_dtype, base.moe_router_load_balancing_type, base.moe_aux_loss_coeff) == ("fp32", "none", 0.0)
    over = router_policy_overrides(router_dtype="fp64", aux_loss="seq_aux_loss", aux_loss_coef=1e-3)
    tc = transformer_config_from_hf(cfg, **over)
    assert (tc.moe_router_dtype, tc.moe_router_load_balancing_type, tc.moe_aux_loss_coeff) == ("fp64", "seq_aux_loss", 1e-3)
    with pytest.raises(ValueError, match="coefficient"):
        router_policy_overrides(aux_loss="aux_loss", aux_loss_coef=0.0)
    with pytest.raises(ValueError, match="router_dtype"):
        router_policy_overrides(router_dtype="bf16")


def test_fp64_router_computes_logits_in_fp64_and_trains(dist):
    cfg, model = _pair(moe_router_dtype="fp64")
    seen = []
    hooks = [r.register_forward_hook(lambda m, a, out: seen.append(out[0].dtype)) for r in moe_routers(model)]
    learner = make_learner(model, cfg, dist, lr=1e-2)
    batch = make_batch(8, seed=1)
    old = learner.compute_logprobs(batch)
    m = learner.train_step(batch, old_pass(old.logp_BS, natural=old, fused=old.fused))
    for h in hooks:
        h.remove()
    assert seen and set(seen) == {torch.float64}  # the routing probabilities (Megatron's router dtype)
    assert old.logp_BS.dtype == torch.float32 and torch.isfinite(old.logp_BS).all()
    assert m["grad/norm"] > 0
    # same routing as the fp32 router up to rounding: log-probs agree closely
    cfg2, model2 = _pair()
    ref = make_learner(model2, cfg2, dist, lr=1e-2).compute_logprobs(batch)
    assert (ref.logp_BS - old.logp_BS).abs().max() < 1e-4


@pytest.mark.parametrize("kind", ["aux_loss", "seq_aux_loss"])
def test_aux_loss_changes_only_the_update_and_reaches_the_router(dist, kind):
    """The load-balancing loss adds a router gradient in the update; the no-grad old-policy pass is the same
    as without it (Megatron adds it only in training forwards with autograd)."""
    batch = make_batch(8, seed=3)
    batch.advantages_B.zero_()  # no policy gradient: only the aux loss moves the weights
    grads = {}
    for name, over in (("none", {}), (kind, router_policy_overrides(aux_loss=kind, aux_loss_coef=0.1))):
        cfg, model = _pair(**over)
        algo = AlgoConfig(name="gspo", router_aux_loss=name, router_aux_loss_coef=0.1 if over else 0.0)
        learner = make_learner(model, cfg, dist, algo=algo, lr=1e-2, micro_batch_size=4, grad_clip=0.0)
        old = learner.compute_logprobs(batch)
        m = learner.train_step(batch, old_pass(old.logp_BS, natural=old, fused=old.fused))
        grads[name] = (m["grad/norm"], old.logp_BS)
    assert grads["none"][0] == 0.0
    assert grads[kind][0] > 0.0
    assert torch.equal(grads["none"][1], grads[kind][1])


def test_aux_loss_gradient_is_the_mean_over_micro_batches(dist):
    """1 / micro-batches scale: with 2 micro-batches of identical halves the aux gradient equals that of
    one micro-batch over one half."""
    half = make_batch(4, seed=3)
    doubled = make_batch(4, seed=3).select(np.array([0, 1, 2, 3, 0, 1, 2, 3]))
    norms = []
    for b, mbs in ((half, 0), (doubled, 4)):
        b.advantages_B.zero_()
        cfg, model = _pair(**router_policy_overrides(aux_loss="aux_loss", aux_loss_coef=0.1))
        algo = AlgoConfig(name="gspo", router_aux_loss="aux_loss", router_aux_loss_coef=0.1)
        learner = make_learner(model, cfg, dist, algo=algo, lr=1e-2, micro_batch_size=mbs, grad_clip=0.0)
        norms.append(learner.train_step(b, old_pass(b.rollout_logp_BS))["grad/norm"])
    assert norms[0] > 0 and norms[1] == pytest.approx(norms[0], rel=1e-5)


def _switch_aux_loss(model, batch) -> float:
    """GShard/Switch load-balancing loss by hand from the routers' logits of one forward over `batch` (all
    positions): E / (T K) * sum_e tokens_e * mean_t softmax_e, averaged over the MoE layers."""
    from moe_gspo.mcore.model import forward_logits

    vals = []

    def hook(router, args, out):
        x = args[0].reshape(-1, args[0].shape[-1])
        logits = torch.nn.functional.linear(x.float(), router.weight.float())
        probs = torch.softmax(logits, -1)
        E, K, T = probs.shape[1], router.topk, probs.shape[0]
        counts = torch.zeros(E).index_add_(0, logits.topk(K, -1).indices.reshape(-1), torch.ones(T * K))
        vals.append(float(E / (T * K) * (counts * probs.mean(0)).sum()))

    hooks = [r.register_forward_hook(hook) for r in moe_routers(model)]
    with torch.no_grad():
        forward_logits(model, batch.input_ids_BS)
    for h in hooks:
        h.remove()
    return float(np.mean(vals))


@pytest.mark.parametrize("recompute", [False, True])
def test_router_aux_metric_is_the_hand_computed_loss(dist, recompute):
    batch = make_batch(8, seed=3)
    cfg, model = _pair(recompute=recompute, **router_policy_overrides(aux_loss="aux_loss", aux_loss_coef=0.1))
    expected = _switch_aux_loss(model, batch)
    algo = AlgoConfig(name="gspo", router_aux_loss="aux_loss", router_aux_loss_coef=0.1)
    learner = make_learner(model, cfg, dist, algo=algo, lr=1e-2, recompute=recompute)
    m = learner.train_step(batch, old_pass(batch.rollout_logp_BS))
    assert m["loss/router_aux"] == pytest.approx(expected, rel=1e-4)
    cfg, model = _pair()
    assert "loss/router_aux" not in make_learner(model, cfg, dist).train_step(batch, old_pass(batch.rollout_logp_BS))


def test_aux_loss_with_recompute_and_with_the_fused_old_pass(dist):
    """The same aux-only gradient with activation recomputation, and the same loss/router_aux when the first
    mini-batch back-propagates through the kept old-policy pass (train.fuse_old_logp_pass)."""
    batch = make_batch(8, seed=3)
    batch.advantages_B.zero_()
    over = router_policy_overrides(aux_loss="aux_loss", aux_loss_coef=0.1)
    algo = AlgoConfig(name="gspo", router_aux_loss="aux_loss", router_aux_loss_coef=0.1)
    out = {}
    for name, kw in (("plain", {}), ("recompute", {"recompute": True}), ("fused", {})):
        cfg, model = _pair(recompute=kw.get("recompute", False), **over)
        learner = make_learner(model, cfg, dist, algo=algo, lr=1e-2, grad_clip=0.0, num_minibatches=2,
                               fuse_old_logp_pass=name == "fused", **kw)
        old = learner.compute_logprobs(batch, keep_graph=name == "fused")
        m = learner.train_step(batch, old_pass(old.logp_BS, natural=old, fused=old.fused))
        out[name] = (m["grad/norm"], m["loss/router_aux"])
    assert out["plain"][0] > 0
    for name in ("recompute", "fused"):
        assert out[name][0] == pytest.approx(out["plain"][0], rel=1e-4), name
        assert out[name][1] == pytest.approx(out["plain"][1], rel=1e-5), name
