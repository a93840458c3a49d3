"""Same-support log-probs end to end at EP=1: the transformers rollout engine samples with top-p or top-k
and records each token's support; the Megatron learner's old-policy and update passes renormalise over it
(moe_gspo.algos.support). fp32 on both sides, so the two must agree to float rounding."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from _learner_common import make_learner, old_pass, tiny_pair
from moe_gspo.config import AlgoConfig
from moe_gspo.learner.batch import PackedBatch
from moe_gspo.rollout.base import SamplingParams
from moe_gspo.rollout.hf_engine import HFEngine

pytestmark = pytest.mark.usefixtures("dist")

PROMPTS = [[2, 5, 6, 7], [2, 9], [2, 10, 11, 12, 13]]
SAMPLINGS = {"top_p=0.8": dict(top_p=0.8), "top_k=3": dict(top_k=3)}


@pytest.fixture(scope="module")
def pair():
    return tiny_pair()


def _batch(pair, seed=1, **sampling) -> PackedBatch:
    engine = HFEngine(pair[1], dtype="float32", device="cpu")
    samples = engine.generate(PROMPTS, SamplingParams(n=4, max_new_tokens=8, seed=seed, **sampling))
    adv = np.random.default_rng(seed).standard_normal(len(samples)).astype(np.float32)
    return PackedBatch.from_samples(samples, adv, pad_id=0)


def _full_vocabulary(batch: PackedBatch) -> PackedBatch:
    return dataclasses.replace(batch, support_sizes_BS=None, support_ids=None)


@pytest.mark.parametrize("sampling", SAMPLINGS.values(), ids=SAMPLINGS.keys())
def test_rollout_and_learner_log_probs_agree_over_the_sampled_support(dist, pair, sampling):
    cfg, _, model = pair
    learner = make_learner(model, cfg, dist)
    batch = _batch(pair, **sampling)
    mask = batch.response_mask_BS
    sizes = batch.support_sizes_BS[mask]
    assert (sizes >= 1).all() and (sizes < cfg.vocab_size).all()
    if "top_k" in sampling:
        assert (sizes == 3).all()
    else:  # the nucleus differs from token to token
        assert sizes.unique().numel() > 1
    for mbs in (0, 5):
        res = learner.compute_logprobs(batch, micro_batch_size=mbs)
        assert (res.logp_BS - batch.rollout_logp_BS)[mask].abs().max() <= 1e-5
    # every support left out some mass: both sides lie strictly above the full-softmax log-prob
    # the same micro-batches as `res` (the loop's last, 5): matmuls of other shapes need not round alike (on CPUs
    # with AMX tiles oneDNN's float32 GEMMs do not), and prompt positions are compared bit for bit
    full = learner.compute_logprobs(_full_vocabulary(batch), micro_batch_size=5).logp_BS
    assert (res.logp_BS[mask] > full[mask]).all() and (batch.rollout_logp_BS[mask] > full[mask] + 1e-3).all()
    assert (res.logp_BS[~mask] == full[~mask]).all()  # prompt positions keep the full softmax


def test_the_update_pass_uses_the_same_support(dist, pair):
    """With pi_old from the old-policy pass, the first mini-batch's ratios are exactly 1 (the update's
    forward renormalises over the same supports); over the full vocabulary they would be far from it."""
    batch = _batch(pair, top_p=0.8, seed=2)
    cfg = pair[0]
    _, _, model = tiny_pair()
    learner = make_learner(model, cfg, dist, num_minibatches=1, micro_batch_size=3)
    m = learner.train_step(batch, old_pass(learner.compute_logprobs(batch).logp_BS))
    assert m["ratio/token_mean"] == pytest.approx(1.0, abs=1e-6)
    assert m["ratio/token_var"] <= 1e-10
    _, _, model = tiny_pair()
    learner = make_learner(model, cfg, dist, num_minibatches=1, micro_batch_size=3)
    m = learner.train_step(batch, old_pass(learner.compute_logprobs(_full_vocabulary(batch)).logp_BS))
    assert m["ratio/token_mean"] > 1.2  # pi_old over the full vocabulary: a different distribution


@pytest.mark.parametrize("fuse", [False, True], ids=["plain", "fused-old-pass"])
def test_micro_batches_and_the_fused_pass_give_the_full_batch_update(dist, pair, fuse):
    cfg, _, _ = pair
    batch = _batch(pair, top_k=3, seed=3)
    after = []
    for mbs in (0, 2):
        if fuse and mbs:
            continue
        _, _, model = tiny_pair()
        learner = make_learner(model, cfg, dist, algo=AlgoConfig(name="grpo"), micro_batch_size=mbs, grad_clip=0.0)
        old = learner.compute_logprobs(batch, keep_graph=fuse)
        m = learner.train_step(batch, old_pass(old.logp_BS, fused=old.fused))
        after.append((learner.compute_logprobs(batch).logp_BS, m["grad/norm"]))
    if fuse:  # compare with the plain update of the same batch
        _, _, model = tiny_pair()
        learner = make_learner(model, cfg, dist, algo=AlgoConfig(name="grpo"), grad_clip=0.0)
        m = learner.train_step(batch, old_pass(learner.compute_logprobs(batch).logp_BS))
        after.append((learner.compute_logprobs(batch).logp_BS, m["grad/norm"]))
    (lp_a, norm_a), (lp_b, norm_b) = after
    assert norm_a > 0 and norm_a == pytest.approx(norm_b, rel=1e-5)
    assert (lp_a - lp_b).abs().max() <= 3e-5
    assert not torch.equal(lp_a, batch.rollout_logp_BS)  # the step changed the policy
