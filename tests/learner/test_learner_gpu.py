"""The learner on CUDA with Megatron's distributed optimizer (the GPU default): its state survives a round trip
through a checkpoint payload (marked gpu, skipped without CUDA)."""

from __future__ import annotations

import io

import pytest
import torch

from _learner_common import make_batch, make_learner, old_pass, params_snapshot, tiny_pair

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.usefixtures("dist")]


def test_distributed_optimizer_state_round_trip(dist):
    """fp32 weights: the distributed optimizer's main params are views of them, so loading its state must not
    run under autograd (it once failed there with 'a view of a leaf Variable ... in-place operation')."""
    def learner_and_model():
        cfg, _, model = tiny_pair(enable_routing_replay=False)
        return make_learner(model, cfg, dist, num_minibatches=2), model

    batch = make_batch(8, seed=3)
    first, model = learner_and_model()
    assert first.optimizer.use_megatron and first.optimizer.options.distributed_optimizer
    first.train_step(batch, old_pass(first.compute_logprobs(batch).logp_BS))
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    second, model2 = learner_and_model()
    second.load_state_dict(torch.load(buf, map_location="cpu", weights_only=False))
    a, b = params_snapshot(model), params_snapshot(model2)
    assert all(torch.equal(a[k], b[k]) for k in a)
    for learner in (first, second):  # the optimizer state came along: the next update is the same
        learner.train_step(batch, old_pass(learner.compute_logprobs(batch).logp_BS))
    a, b = params_snapshot(model), params_snapshot(model2)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6
