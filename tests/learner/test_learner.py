"""Learner at EP=1 in process: log-probs vs transformers, R2, GSPO progress, NaN guard, checkpoints."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _learner_common import (flip_fraction, hf_token_logprobs, make_batch, make_learner, old_pass, params_snapshot,
                            surrogate_objective, tiny_pair, valid_mask)
from moe_gspo.config import AlgoConfig
from moe_gspo.learner.old_pass import OldPolicyPass
from moe_gspo.learner.router_hooks import MegatronRouterRecorder
from moe_gspo.mcore.model import moe_routers

pytestmark = pytest.mark.usefixtures("dist")


def _max_change(a, b):
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_logprobs_match_transformers(dist):
    cfg, hf, model = tiny_pair()
    learner = make_learner(model, cfg, dist)
    batch = make_batch(7, seed=4)
    ref = hf_token_logprobs(hf, batch)
    for mbs in (0, 3):
        res = learner.compute_logprobs(batch, micro_batch_size=mbs)
        assert res.logp_BS.shape == (7, batch.seq_len_padded) and res.routes is None
        assert (res.logp_BS - ref).abs().max() <= 1e-4
        assert (res.logp_BS[~valid_mask(batch)] == 0).all()


@pytest.mark.parametrize("algo", [
    AlgoConfig(name="gspo", clip_low=0.2, clip_high=0.2),
    AlgoConfig(name="grpo", aggregation="token_mean"),
    AlgoConfig(name="sapo", loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=4.0),
    AlgoConfig(name="gspo", entropy_coef=0.05),
], ids=["gspo", "grpo-token-mean", "sapo-sum-norm", "gspo-entropy-bonus"])
def test_micro_batches_accumulate_to_the_full_batch_gradient(dist, algo):
    """Each aggregation unit (sequences; tokens; sequences with Dr. GRPO's constant): 4 micro-batches of 2
    give the same update as one of 8."""
    batch = make_batch(8, seed=5)
    after = []
    for mbs in (0, 2):
        cfg, _, model = tiny_pair()
        learner = make_learner(model, cfg, dist, algo=algo, micro_batch_size=mbs, grad_clip=0.0)
        m = learner.train_step(batch, old_pass(batch.rollout_logp_BS))
        after.append((learner.compute_logprobs(batch).logp_BS, m))
    # Adam's first step is ~lr * sign(grad), so weights can differ by up to ~lr where a gradient
    # is ~0; the log-probs after the step are the meaningful comparison (1.07e-5 measured with
    # the head_dim-32 tiny geometry).
    assert (after[0][0] - after[1][0]).abs().max() <= 3e-5
    assert after[0][1]["grad/norm"] == pytest.approx(after[1][1]["grad/norm"], rel=1e-5)
    assert after[0][1]["loss/total"] == pytest.approx(after[1][1]["loss/total"], rel=1e-5)
    assert ("loss/entropy" in after[0][1]) == (algo.entropy_coef > 0)


def test_entropy_bonus_raises_the_policy_entropy(dist):
    """With zero advantages the policy gradient vanishes and the entropy bonus alone moves the weights:
    the policy's entropy over the response tokens goes up (and loss/entropy is the old entropy)."""
    batch = make_batch(8, seed=5)
    batch.advantages_B.zero_()
    cfg, _, model = tiny_pair()
    learner = make_learner(model, cfg, dist, algo=AlgoConfig(name="gspo", entropy_coef=1.0), lr=1e-4)
    before = learner.compute_logprobs(batch, with_entropy=True).entropy_BS[batch.response_mask_BS].mean()
    m = learner.train_step(batch, old_pass(batch.rollout_logp_BS))
    after = learner.compute_logprobs(batch, with_entropy=True).entropy_BS[batch.response_mask_BS].mean()
    assert after > before + 1e-4  # Adam's first step, ~lr * sign(grad): a first-order increase
    assert m["loss/policy"] == 0.0 and m["loss/total"] == pytest.approx(-m["loss/entropy"], rel=1e-6)


def test_r2_replays_old_routing_while_the_router_still_learns(dist):
    cfg, _, model = tiny_pair()
    learner = make_learner(model, cfg, dist, replay="r2", lr=5e-2, micro_batch_size=4,
                           algo=AlgoConfig(name="grpo"))
    batch = make_batch(8, seed=6)
    with pytest.raises(ValueError, match="r2 replays the old-policy pass's routes"):
        learner.train_step(batch, old_pass(batch.rollout_logp_BS))  # log-probs alone: no routes to replay
    old = learner.compute_logprobs(batch)
    assert old.routes is not None and len(old.routes) == batch.num_seqs  # R2 always records them
    with pytest.raises(ValueError, match="another batch"):
        learner.train_step(batch.select(range(4)), OldPolicyPass(logp_BS=old.logp_BS[:4], natural=old))
    router_grads = []
    handles = [r.weight.register_hook(lambda g: router_grads.append(float(g.abs().sum()))) for r in moe_routers(model)]
    learner.train_step(batch, old_pass(old.logp_BS, natural=old))  # the pass itself: its routes are replayed
    # without replay the updated policy routes differently ...
    new = learner.compute_logprobs(batch, record_routes=True)
    assert flip_fraction(old.routes, new.routes) > 0.02
    # ... a re-evaluation that replays the old routing sees exactly the old experts ...
    replayed = learner.compute_logprobs(batch, record_routes=True, replay_routes=old.routes)
    assert flip_fraction(old.routes, replayed.routes) == 0.0
    # ... and so does the forward of a second R2 update on the same rollout batch
    with MegatronRouterRecorder(model, record_probs=False) as rec:
        learner.train_step(batch, old_pass(old.logp_BS, natural=old))
        seen = [rec.to_sequences(batch.seq_lens_B[i:i + 4].tolist(), 4, mb_len, call=c)
                for c, (i, mb_len) in enumerate([(0, int(batch.seq_lens_B[:4].max())),
                                                 (4, int(batch.seq_lens_B[4:].max()))])]
    assert rec.num_calls() == 2
    assert flip_fraction([r for part in seen for r in part], new.routes) > 0.02
    assert flip_fraction([r for part in seen for r in part], old.routes) == 0.0
    for h in handles:
        h.remove()
    assert len(router_grads) == 2 * 2 * 2 and all(g > 0 for g in router_grads)  # 2 layers x 2 mb x 2 steps


def test_gspo_steps_improve_the_objective(dist):
    """Three on-policy GSPO steps (paper clip range) raise mean_i A_i * mean_t logp_{i,t}."""
    cfg, _, model = tiny_pair()
    learner = make_learner(model, cfg, dist, algo=AlgoConfig(name="gspo"), lr=3e-3, num_minibatches=2)
    batch = make_batch(8, seed=7)
    objectives = []
    for _ in range(3):
        old = learner.compute_logprobs(batch).logp_BS
        objectives.append(surrogate_objective(old, batch))
        metrics = learner.train_step(batch, old_pass(old))
        assert metrics["train/skipped_steps"] == 0 and metrics["ratio/num_seqs"] == 4
        assert np.isfinite(metrics["grad/norm"]) and metrics["grad/norm"] > 0
    objectives.append(surrogate_objective(learner.compute_logprobs(batch).logp_BS, batch))
    assert all(b > a for a, b in zip(objectives, objectives[1:])), objectives
    assert objectives[-1] > objectives[0] + 0.3, objectives
    assert learner.num_updates == 6
    for key in ("loss/policy", "loss/total", "clip/token_frac_low", "clip/out_of_range_frac", "clip/token_frac", "ratio/seq_var", "train/lr"):
        assert key in metrics


def test_nan_loss_skips_the_step_and_training_continues(dist):
    cfg, _, model = tiny_pair()
    learner = make_learner(model, cfg, dist, num_minibatches=2)
    batch = make_batch(8, seed=8)
    old = learner.compute_logprobs(batch).logp_BS
    before = params_snapshot(model)
    poisoned = batch.select(range(8))
    poisoned.advantages_B = poisoned.advantages_B.clone()
    poisoned.advantages_B[1] = float("nan")  # mini-batch 0 only
    m = learner.train_step(poisoned, old_pass(old))
    assert m["train/skipped_steps"] == 1 and learner.num_updates == 1
    assert np.isfinite(m["loss/total"])  # averaged over the step that was taken
    after_one = params_snapshot(model)
    assert _max_change(before, after_one) > 0  # mini-batch 1 did update
    # the skipped step changed nothing: a fresh learner doing only mini-batch 1 lands on the same weights
    cfg2, _, model2 = tiny_pair()
    twin = make_learner(model2, cfg2, dist, num_minibatches=1)
    twin.train_step(batch.select(range(4, 8)), old_pass(old[4:]))
    assert _max_change(params_snapshot(model2), after_one) <= 1e-7
    m2 = learner.train_step(batch, old_pass(old))
    assert m2["train/skipped_steps"] == 1 and _max_change(after_one, params_snapshot(model)) > 0


def test_checkpoint_round_trip_and_hf_export(dist):
    cfg, hf, model = tiny_pair()
    learner = make_learner(model, cfg, dist)
    from moe_gspo.mcore.checkpoint import to_per_expert_layout

    hf_sd = learner.hf_state_dict()  # on-disk per-expert names, what the rollout engines load
    ref = to_per_expert_layout(hf.state_dict(), cfg)
    assert set(hf_sd) == set(ref) and all(torch.equal(hf_sd[k], ref[k]) for k in ref)
    batch = make_batch(6, seed=9)
    learner.train_step(batch, old_pass(batch.rollout_logp_BS))
    state = {k: v for k, v in learner.state_dict().items()}
    state = torch.utils._pytree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, state)
    learner.train_step(batch, old_pass(batch.rollout_logp_BS))
    target = params_snapshot(model)
    learner.load_state_dict(state)
    assert _max_change(params_snapshot(model), target) > 0
    learner.train_step(batch, old_pass(batch.rollout_logp_BS))  # same Adam state -> same second step
    assert _max_change(params_snapshot(model), target) <= 1e-7


def test_kl_penalty_and_argument_errors(dist):
    cfg, _, model = tiny_pair()
    learner = make_learner(model, cfg, dist, algo=AlgoConfig(name="grpo", kl_coef=0.1))
    batch = make_batch(4, seed=10)
    old = learner.compute_logprobs(batch).logp_BS
    with pytest.raises(ValueError, match="ref_logp_BT"):
        learner.train_step(batch, old_pass(old))
    with pytest.raises(ValueError, match="old_logp_BS has shape"):
        learner.train_step(batch, old_pass(old[:, :-1]))
    m = learner.train_step(batch, old_pass(old, ref_logp_BS=old - 0.5))
    assert m["loss/kl"] > 0 and m["loss/total"] == pytest.approx(m["loss/policy"] + 0.1 * m["loss/kl"], rel=1e-6)
    r3 = make_learner(tiny_pair()[2], cfg, dist, replay="r3")
    with pytest.raises(ValueError, match="rollout_routes"):
        r3.compute_logprobs(batch)
    with pytest.raises(ValueError, match="recompute"):
        make_learner(tiny_pair()[2], cfg, dist, recompute=True)


def test_old_policy_pass_entropy_matches_transformers(dist):
    """`with_entropy`: each token's predictive entropy, aligned like the log-probs, equals the entropy
    of transformers' softmax on the same weights (also with micro-batches)."""
    cfg, hf, model = tiny_pair()
    learner = make_learner(model, cfg, dist)
    batch = make_batch(7, seed=8)
    with torch.no_grad():
        logp_V = torch.log_softmax(hf(batch.input_ids_BS).logits.float(), -1)
    ref = torch.cat([torch.zeros(7, 1), -(logp_V.exp() * logp_V).sum(-1)[:, :-1]], 1)
    valid = valid_mask(batch) & (torch.arange(batch.seq_len_padded)[None] > 0)
    for mbs in (0, 3):
        res = learner.compute_logprobs(batch, micro_batch_size=mbs, with_entropy=True)
        assert (res.entropy_BS[valid] - ref[valid]).abs().max() <= 1e-4
        assert (res.entropy_BS[~valid_mask(batch)] == 0).all() and float(res.entropy_BS[valid].min()) > 0
    assert learner.compute_logprobs(batch).entropy_BS is None


def test_batched_experts_train_like_the_loop_without_copying_their_weights(dist):
    """Issue 31: the learner (Megatron DDP, its optimizer, micro-batches) on grouped expert GEMMs makes the
    loop's update, and every forward viewed the experts' weights in place (no copy)."""
    from moe_gspo.mcore.batched_experts import BatchedSequentialMLP, stacked_view

    after = []
    for batched in (False, True):
        cfg, _, model = tiny_pair(enable_routing_replay=False, batched_experts=batched)
        learner = make_learner(model, cfg, dist, num_minibatches=2, micro_batch_size=2)
        batch = make_batch(8, seed=3)
        learner.train_step(batch, old_pass(learner.compute_logprobs(batch).logp_BS))
        after.append(params_snapshot(model))
        experts = [m for m in model.modules() if isinstance(m, BatchedSequentialMLP)]
        assert len(experts) == (2 if batched else 0)
        for m in experts:
            assert m.num_weight_copies == 0
            assert stacked_view([e.linear_fc1.weight for e in m.local_experts]) is not None
    assert _max_change(after[0], after[1]) <= 1e-6 and _max_change(after[0], params_snapshot(tiny_pair()[2])) > 1e-4
