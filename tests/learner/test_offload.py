"""`train.offload_during_rollout=grads` on CPU: gradient buffers are released between updates (storage
freed through Megatron's buffer offload) and the updates are unchanged."""

from __future__ import annotations

import torch

from _learner_common import make_batch, make_learner, old_pass, tiny_pair
from moe_gspo.config import AlgoConfig


def grad_storage_bytes(learner) -> int:
    bufs = list(learner.ddp.buffers) + list(learner.ddp.expert_parallel_buffers)
    return sum(b.grad_data.untyped_storage().nbytes() for b in bufs)


def test_released_gradients_give_the_same_updates(dist):
    batch = make_batch(8, seed=7)
    algo = AlgoConfig(name="gspo", clip_low=0.2, clip_high=0.2)
    results = []
    for mode in ("none", "grads"):
        cfg, _, model = tiny_pair()
        learner = make_learner(model, cfg, dist, algo=algo, offload_during_rollout=mode, num_minibatches=2)
        full = sum(p.numel() for p in model.parameters()) * 4
        assert grad_storage_bytes(learner) == (0 if mode == "grads" else full)
        steps = []
        for _ in range(2):
            learner.offload_for_rollout()
            learner.reload_after_rollout()
            m = learner.train_step(batch, old_pass(batch.rollout_logp_BS))
            assert grad_storage_bytes(learner) == (0 if mode == "grads" else full)
            steps.append(m["grad/norm"])
        results.append((learner.compute_logprobs(batch).logp_BS, steps))
    assert torch.equal(results[0][0], results[1][0])
    assert results[0][1] == results[1][1]
