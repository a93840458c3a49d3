"""Issue 49 (a gap a mutation check found): with train.shuffle_minibatches every `train_step` deals the batch
into mini-batches in an order of its own, the one it trains on, and a resumed learner (its state loaded) deals
the order the uninterrupted one would have dealt next. A shuffle that reused the same order every step survived
every other learner test."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from _learner_common import make_batch, make_learner, old_pass, tiny_pair
from moe_gspo.config import AlgoConfig
from moe_gspo.learner.batch import PackedBatch

pytestmark = pytest.mark.usefixtures("dist")
ALGO = AlgoConfig(name="gspo", clip_low=0.2, clip_high=0.2)


def _learner(dist):
    cfg, _, model = tiny_pair()
    return make_learner(model, cfg, dist, algo=ALGO, num_minibatches=2, shuffle_minibatches=True, seed=5)


def test_each_step_deals_a_new_order_and_a_resume_continues_it(dist):
    learner, batch = _learner(dist), make_batch(8, seed=21)
    dealt, used, states = [], [], []
    select = PackedBatch.select
    for _ in range(3):
        dealt.append([m.tolist() for m in learner.minibatch_indices(batch.num_seqs)])
        states.append(copy.deepcopy(learner.state_dict()))
        old = old_pass(learner.compute_logprobs(batch).logp_BS)
        seen = []  # the rows each optimizer step trained on: the mini-batches train_step cut from the whole batch

        def spy(self, idx, _seen=seen):
            if self.num_seqs == batch.num_seqs:
                _seen.append(np.asarray(idx).tolist())
            return select(self, idx)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(PackedBatch, "select", spy)
            learner.train_step(batch, old)
        used.append(seen)
    assert used == dealt  # the order dealt is the one trained on
    for order in dealt:
        assert sorted(i for m in order for i in m) == list(range(8)) and [len(m) for m in order] == [4, 4]
    flat = [tuple(i for m in order for i in m) for order in dealt]
    assert len(set(flat)) == 3 and tuple(range(8)) not in flat  # a new order every step, none the rollout order
    resumed = _learner(dist)  # as --resume builds it, then loads the checkpoint written after step 1
    resumed.load_state_dict(states[1])
    assert [m.tolist() for m in resumed.minibatch_indices(batch.num_seqs)] == dealt[1]
    resumed.load_state_dict(states[2])
    assert [m.tolist() for m in resumed.minibatch_indices(batch.num_seqs)] == dealt[2]
