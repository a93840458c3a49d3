"""The learner passes around the update (moe_gspo.run.learner_passes and the train_step arguments
they use): the optimizer-step hook, rollout-correction weights, rejection masks and OPSM in the update,
the frozen reference policy (initial weights, replay routing, isolation from upstream's class-level
RouterReplay list), the update-drift probe."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _learner_common import make_batch, make_learner, old_pass, tiny_pair
from moe_gspo.config import AlgoConfig, Config
from moe_gspo.config_load import load_config
from moe_gspo.run.learner_passes import ReferencePolicy, UpdateDriftProbe, fuse_old_pass

pytestmark = pytest.mark.usefixtures("dist")


def test_correction_weights_and_rejection_in_the_update(dist):
    batch = make_batch(8, seed=12)
    algo = AlgoConfig(name="gspo", clip_low=0.2, clip_high=0.2)
    runs = {}
    for name, w in {"plain": None, "twos": 2 * torch.ones(8, batch.seq_len_padded)}.items():
        cfg, _, model = tiny_pair()
        learner = make_learner(model, cfg, dist, algo=algo, grad_clip=0.0)
        runs[name] = learner.train_step(batch, old_pass(batch.rollout_logp_BS, is_weights_BS=w))
    assert runs["twos"]["loss/policy"] == pytest.approx(2 * runs["plain"]["loss/policy"], rel=1e-6)
    assert runs["twos"]["grad/norm"] == pytest.approx(2 * runs["plain"]["grad/norm"], rel=1e-5)
    # rejecting sequences 4..7 entirely = training on sequences 0..3 alone (same gradient; Adam's
    # first step is ~lr * sign(grad), so compare log-probs after the step, not weights)
    keep = torch.zeros(8, batch.seq_len_padded, dtype=torch.bool)
    keep[:4] = True
    cfg, _, model = tiny_pair()
    masked = make_learner(model, cfg, dist, algo=algo)
    m_keep = masked.train_step(batch, old_pass(batch.rollout_logp_BS, rs_keep_BS=keep))
    half = batch.select(range(4))
    twin = make_learner(tiny_pair()[2], cfg, dist, algo=algo)
    m_half = twin.train_step(half, old_pass(half.rollout_logp_BS))
    assert m_keep["ratio/num_seqs"] == 4 and m_keep["loss/policy"] == pytest.approx(m_half["loss/policy"], rel=1e-6)
    assert m_keep["grad/norm"] == pytest.approx(m_half["grad/norm"], rel=1e-5)
    assert (masked.compute_logprobs(half).logp_BS - twin.compute_logprobs(half).logp_BS).abs().max() <= 1e-4
    with pytest.raises(ValueError, match="rs_keep_BS has shape"):
        make_learner(tiny_pair()[2], cfg, dist).train_step(batch, old_pass(batch.rollout_logp_BS,
                                                                           rs_keep_BS=keep[:, :2]))


def test_opsm_masks_the_drifted_negative_sequences_in_the_update(dist):
    """algo.opsm = a 0/1 weight on the policy-gradient term of each negative-advantage sequence whose drift
    mean_t(rollout_logp - current logp) exceeds delta: the same update as those weights given by hand, with
    the normalisation unchanged. The batch's rollout log-probs (uniform in [-3, -0.1]) are far above the
    random tiny model's (~log 1/51), so every negative sequence drifts by more than 1e-4."""
    batch = make_batch(8, seed=15)
    neg_B = batch.advantages_B < 0
    assert 0 < int(neg_B.sum()) < 8
    runs = {}
    for name, algo, w in (
            ("opsm", AlgoConfig(name="gspo", clip_low=0.2, clip_high=0.2, opsm=True), None),
            ("opsm_micro", AlgoConfig(name="gspo", clip_low=0.2, clip_high=0.2, opsm=True), None),
            ("by_hand", AlgoConfig(name="gspo", clip_low=0.2, clip_high=0.2),
             (~neg_B).float()[:, None].expand(8, batch.seq_len_padded)),
            ("far_delta", AlgoConfig(name="gspo", clip_low=0.2, clip_high=0.2, opsm=True, opsm_delta=1e9), None),
            ("plain", AlgoConfig(name="gspo", clip_low=0.2, clip_high=0.2), None)):
        cfg, _, model = tiny_pair()
        learner = make_learner(model, cfg, dist, algo=algo, grad_clip=0.0,
                               micro_batch_size=3 if name == "opsm_micro" else 0)
        old = learner.compute_logprobs(batch).logp_BS
        runs[name] = learner.train_step(batch, old_pass(old, is_weights_BS=w))
    # in micro-batches (the logged metrics recomputed on the whole mini-batch): the same numbers
    for k in ("loss/policy", "grad/norm", "rollout_corr/opsm_masked_seq_frac", "rollout_corr/opsm_kl_mean"):
        assert runs["opsm_micro"][k] == pytest.approx(runs["opsm"][k], rel=1e-5), k
    assert runs["opsm"]["loss/policy"] == pytest.approx(runs["by_hand"]["loss/policy"], rel=1e-6)
    assert runs["opsm"]["grad/norm"] == pytest.approx(runs["by_hand"]["grad/norm"], rel=1e-5)
    assert runs["opsm"]["ratio/num_seqs"] == 8  # masked sequences stay in the normalisation
    assert runs["opsm"]["rollout_corr/opsm_masked_seq_frac"] == pytest.approx(float(neg_B.float().mean()))
    assert runs["far_delta"]["rollout_corr/opsm_masked_seq_frac"] == 0.0
    assert runs["far_delta"]["grad/norm"] == pytest.approx(runs["plain"]["grad/norm"], rel=1e-6)
    assert runs["opsm"]["grad/norm"] != pytest.approx(runs["plain"]["grad/norm"], rel=1e-3)
    assert runs["opsm"]["rollout_corr/opsm_kl_mean"] > 1.0
    assert "rollout_corr/opsm_kl_mean" not in runs["plain"]


@pytest.mark.parametrize("replay", ["none", "r3"])
def test_reference_policy_is_the_frozen_initial_policy(dist, replay):
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    from moe_gspo.mcore.model import moe_routers

    batch = make_batch(6, seed=13, with_routes=True)
    hf_cfg, _, model = tiny_pair()
    learner = make_learner(model, hf_cfg, dist, replay=replay, algo=AlgoConfig(name="grpo", routing_replay=replay))
    cfg = Config(algo=AlgoConfig(name="grpo", routing_replay=replay, kl_coef=0.1))
    ref = ReferencePolicy(cfg, dist, learner)
    # upstream's class-level list cannot reach the reference model's routers
    ref_replays = [r.router_replay for r in moe_routers(ref.learner.model) if r.router_replay is not None]
    assert len(ref_replays) == (2 if replay == "r3" else 0)
    assert not any(r in RouterReplay.global_router_replay_instances for r in ref_replays)
    RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
    try:
        assert all(r.router_replay_action is None for r in ref_replays)
    finally:
        RouterReplay.clear_global_router_replay_action()
    # same log-probs as the policy's pass under the same routing (rollout routes under R3)
    old = learner.compute_logprobs(batch, record_routes=True, no_replay=True)
    pi_old = learner.compute_logprobs(batch).logp_BS
    plan = learner.plan_replay(batch, old_pass_routes=old.routes)  # the step's plan, made once
    ref_logp = ref.logprobs(batch, plan)
    assert (ref_logp - pi_old).abs().max() <= 1e-6
    if replay == "r3":  # and the R3 reference really replays: it differs from natural routing here
        assert (ref_logp - old.logp_BS).abs().max() > 1e-4
    # frozen: policy updates do not move it
    learner.train_step(batch, old_pass(pi_old, ref_logp_BS=ref_logp))
    assert (ref.logprobs(batch, plan) - ref_logp).abs().max() == 0.0
    assert (learner.compute_logprobs(batch).logp_BS - pi_old).abs().max() > 1e-4
    assert not any(p.requires_grad for p in ref.learner.model.parameters())


def test_update_drift_probe_after_the_first_and_after_all_minibatches(dist):
    from moe_gspo.routing.drift_metrics import policy_update_drift

    hf_cfg, _, model = tiny_pair()
    algo = AlgoConfig(name="grpo")
    learner = make_learner(model, hf_cfg, dist, num_minibatches=4, lr=1e-2, algo=algo)
    batch = make_batch(8, seed=14)
    old = learner.compute_logprobs(batch, record_routes=True, no_replay=True)
    probe = UpdateDriftProbe(learner, batch, old.routes, num_experts=8)
    calls = []

    def hook(index, applied):  # the train_step hook: after each optimizer step, on every rank
        calls.append((index, applied, learner.num_updates))
        probe.after_optimizer_step(index, applied)

    learner.train_step(batch, old_pass(old.logp_BS), after_optimizer_step=hook)
    assert calls == [(0, True, 1), (1, True, 2), (2, True, 3), (3, True, 4)]
    assert probe.last is None
    probe.finish()
    m = probe.metrics()
    assert set(m) == {f"{p}{k}" for p in ("update/", "update_all_minibatches/")
                      for k in ("layer_change", "any_layer_change", "expert_change_frac")}
    # update_all_minibatches/ = the routing after the whole step
    after = learner.compute_logprobs(batch, record_routes=True, no_replay=True)
    assert m == {**m, **policy_update_drift(old.routes, after.routes, batch.response_mask_BS, num_experts=8,
                                            prefix="update_all_minibatches/")}
    # update/ = the routing after the first mini-batch's step only: a twin that trains on that
    # mini-batch (sequences 0-1, same padded length) alone lands on the same routing
    twin = make_learner(tiny_pair()[2], hf_cfg, dist, num_minibatches=1, lr=1e-2, algo=algo)
    twin.train_step(batch.select([0, 1]), old_pass(old.logp_BS[:2]))
    first = twin.compute_logprobs(batch, record_routes=True, no_replay=True)
    expected = policy_update_drift(old.routes, first.routes, batch.response_mask_BS, num_experts=8)
    assert m["update/expert_change_frac"] == expected["update/expert_change_frac"] > 0
    assert m["update/expert_change_frac"] != m["update_all_minibatches/expert_change_frac"]
    assert np.isfinite(m["update/any_layer_change"])


@pytest.mark.parametrize("overrides,fused", [
    (["train.fuse_old_logp_pass=true"], True),
    (["train.fuse_old_logp_pass=true", "algo.routing_replay=r2"], True),
    (["train.fuse_old_logp_pass=true", "algo.entropy_coef=0.01"], True),  # the kept pass has the entropies
    (["train.fuse_old_logp_pass=false"], False),
    (["train.fuse_old_logp_pass=true", "algo.routing_replay=r3"], False),  # the update replays rollout routes
    (["train.fuse_old_logp_pass=true", "train.micro_batch_size=2"], False),  # the old pass runs in pieces
    (["train.fuse_old_logp_pass=true", "model.recompute=true"], False),
])
def test_fused_old_pass_applies_only_where_the_maths_allows(overrides, fused):
    assert fuse_old_pass(load_config(None, overrides)) is fused
