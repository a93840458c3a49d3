"""Issue 20, claim 1: resuming must never hand back the initial weights.

Megatron's `DistributedOptimizer.load_state_dict` runs `HybridDeviceOptimizer.dummy_step()` on a fresh
CPU-offloaded optimizer; its step hook copies the fp32 masters it cloned from the weights at build back
into the model. On CPU the same effect is reproduced by an optimizer whose `load_state_dict` first writes
the build-time weights into the model: the learner must load the weights after the optimizer state.
"""

from __future__ import annotations

import io

import torch

from _learner_common import make_batch, make_learner, old_pass, tiny_pair


def _on_disk(state: dict) -> dict:
    """What a checkpoint file gives back (torch.save + torch.load, as `moe_gspo.run.checkpoint` does)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, map_location="cpu", weights_only=True)


def _params(model) -> dict[str, torch.Tensor]:
    return {k: p.detach().clone() for k, p in model.named_parameters()}


def test_loaded_weights_survive_an_optimizer_load_that_writes_the_model(dist):
    batch = make_batch(6, seed=4)
    cfg, _, model = tiny_pair()
    learner = make_learner(model, cfg, dist)
    learner.train_step(batch, old_pass(batch.rollout_logp_BS))
    learner.train_step(batch, old_pass(batch.rollout_logp_BS))
    state = _on_disk(learner.state_dict())
    saved = _params(model)
    learner.train_step(batch, old_pass(batch.rollout_logp_BS))
    expected_next = _params(model)

    cfg2, _, model2 = tiny_pair()  # a fresh run: the initial weights, as after a restart
    fresh = make_learner(model2, cfg2, dist)
    at_build = _params(model2)
    assert any(not torch.equal(at_build[k], saved[k]) for k in saved)
    real_load = fresh.optimizer.opt.load_state_dict

    def load_like_megatron_hdo(sd):
        with torch.no_grad():  # the dummy step's hook: build-time masters back into the model
            for k, p in model2.named_parameters():
                p.copy_(at_build[k])
        real_load(sd)

    fresh.optimizer.opt.load_state_dict = load_like_megatron_hdo
    fresh.load_state_dict(state)
    assert all(torch.equal(p, saved[k]) for k, p in model2.named_parameters())
    fresh.train_step(batch, old_pass(batch.rollout_logp_BS))  # the same Adam state and weights: the same next step
    assert max((p - expected_next[k]).abs().max().item() for k, p in model2.named_parameters()) <= 1e-7


def test_a_checkpoint_before_any_optimizer_step_round_trips(dist):
    """Issue 20, claim 8 (on CPU, torch's AdamW): 0 updates so far is a valid checkpoint."""
    batch = make_batch(6, seed=5)
    cfg, _, model = tiny_pair()
    learner = make_learner(model, cfg, dist)
    state = _on_disk(learner.state_dict())
    assert state["num_updates"] == 0
    learner.train_step(batch, old_pass(batch.rollout_logp_BS))
    after_one = _params(model)
    cfg2, _, model2 = tiny_pair()
    fresh = make_learner(model2, cfg2, dist)
    fresh.load_state_dict(state)
    fresh.train_step(batch, old_pass(batch.rollout_logp_BS))
    assert max((p - after_one[k]).abs().max().item() for k, p in model2.named_parameters()) <= 1e-7
