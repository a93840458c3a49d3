"""Safe R3 in the learner (`Learner.plan_replay`, `moe_gspo.routing.replay_checks`): rows whose
rollout routes are missing or malformed replay the learner's natural routing, valid rows replay exactly
the engine's routes, and nothing malformed ever reaches upstream's RouterReplay."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _learner_common import make_learner, make_samples, old_pass, tiny_pair, valid_mask
from moe_gspo.config import AlgoConfig
from moe_gspo.learner.batch import PackedBatch
from moe_gspo.learner.replay_plan import LearnerPass
from moe_gspo.mcore.model import moe_routers
from moe_gspo.routing.replay_checks import check_routes
from moe_gspo.run.learner_passes import ReferencePolicy

pytestmark = pytest.mark.usefixtures("dist")


def _sorted(a):
    return np.sort(np.asarray(a, dtype=np.int64), -1)


def _corrupted_batch():
    """6 samples with random valid routes, then: sample 0 loses its prompt prefix (rows 0 .. P-1 zeroed, as
    vLLM leaves rows it never wrote: duplicates), sample 1 has no routes at all, sample 2 has one row with
    expert id 8 = E; samples 3-5 stay valid."""
    samples = make_samples(6, seed=21, with_routes=True)
    P0 = len(samples[0].prompt_ids)
    samples[0].routes_TLK[:P0] = 0
    samples[1].routes_TLK = None
    P2 = len(samples[2].prompt_ids)
    samples[2].routes_TLK[P2, 1, 0] = 8
    adv = np.random.default_rng(5).standard_normal(6).astype(np.float32)
    return PackedBatch.from_samples(samples, adv, pad_id=0), P0, P2


def test_fallback_rows_replay_natural_routes_and_valid_rows_the_engines(dist):
    cfg, _, model = tiny_pair()
    batch, P0, P2 = _corrupted_batch()
    learner = make_learner(model, cfg, dist, replay="r3", algo=AlgoConfig(name="grpo", routing_replay="r3"))
    natural = learner.compute_logprobs(batch, record_routes=True, no_replay=True)
    reasons, m = check_routes(batch.rollout_routes, batch.seq_lens_B.tolist(), num_layers=2, top_k=2, num_experts=8)
    lens = batch.seq_lens_B.tolist()
    # the replayed rows (n - 1 per sequence) and the failed ones: sample 0's P0 prefix rows, all of
    # sample 1's, one row of sample 2
    assert m["r3/num_rows"] == sum(n - 1 for n in lens)
    assert m["r3/fallback_rows_duplicate"] == P0 and m["r3/fallback_rows_missing"] == lens[1] - 1
    assert m["r3/fallback_rows_range"] == 1
    assert m["r3/fallback_token_frac"] == pytest.approx((P0 + lens[1] - 1 + 1) / m["r3/num_rows"])
    # the default R3 path (no routes given) checks them and runs the natural pass itself
    res = learner.compute_logprobs(batch, record_routes=True)
    for b, (got, want, nat, c) in enumerate(zip(res.routes, batch.rollout_routes, natural.routes, reasons)):
        n = lens[b]
        ok = np.flatnonzero(c[:n - 1] == 0)
        bad = np.flatnonzero(c[:n - 1] != 0)
        np.testing.assert_array_equal(_sorted(got[ok]), _sorted(np.asarray(want)[ok]), err_msg=f"sample {b}")
        np.testing.assert_array_equal(_sorted(got[bad]), _sorted(nat[bad]), err_msg=f"sample {b}")
    assert [len(np.flatnonzero(c[:-1])) for c in reasons] == [P0, lens[1] - 1, 1, 0, 0, 0]
    # a sample with no routes replays exactly its natural routing: the same log-probs as the natural pass;
    # samples with engine routes do not (the random routes really are replayed)
    diff_B = (torch.where(valid_mask(batch), res.logp_BS - natural.logp_BS, 0.0)).abs().amax(-1)
    assert diff_B[1] <= 1e-6
    assert (diff_B[3:] > 1e-3).all()
    # the explicit routes give the same pass, and the update replays them without error
    plan = learner.plan_replay(batch, old_pass_routes=natural.routes)
    routes, m2 = plan.routes(LearnerPass.PI_OLD), plan.metrics
    assert m2 == m and plan.routes(LearnerPass.UPDATE) is routes and plan.routes(LearnerPass.REFERENCE) is routes
    again = learner.compute_logprobs(batch, replay_routes=routes)
    assert torch.equal(again.logp_BS, res.logp_BS)
    metrics = learner.train_step(batch, old_pass(res.logp_BS))
    assert np.isfinite(metrics["loss/policy"]) and np.isfinite(metrics["grad/norm"])
    assert all(r.router_replay.target_topk_idx is None for r in moe_routers(model))


def test_reference_policy_replays_the_checked_routes(dist):
    hf_cfg, _, model = tiny_pair()
    batch, _, _ = _corrupted_batch()
    learner = make_learner(model, hf_cfg, dist, replay="r3", algo=AlgoConfig(name="grpo", routing_replay="r3"))
    from moe_gspo.config import Config

    ref = ReferencePolicy(Config(algo=AlgoConfig(name="grpo", routing_replay="r3", kl_coef=0.1)), dist, learner)
    old = learner.compute_logprobs(batch, record_routes=True, no_replay=True)
    plan = learner.plan_replay(batch, old_pass_routes=old.routes)
    pi_old = learner.compute_logprobs(batch, replay_routes=plan.routes(LearnerPass.PI_OLD)).logp_BS
    assert (ref.logprobs(batch, plan) - pi_old).abs().max() <= 1e-6
    # planned without the old pass's routes: the plan runs that pass itself for the fallback rows
    assert (ref.logprobs(batch, learner.plan_replay(batch)) - pi_old).abs().max() <= 1e-6
