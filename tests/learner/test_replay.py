"""RoutingReplayDriver on upstream RouterReplay: R3 replay is exact, state never leaks, recompute."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _learner_common import flip_fraction, make_batch, make_learner, old_pass, params_snapshot, tiny_pair, valid_mask
from moe_gspo.learner.logprobs import token_logprobs
from moe_gspo.learner.replay import RoutingReplayDriver
from moe_gspo.learner.router_hooks import MegatronRouterRecorder
from moe_gspo.mcore.model import forward_logits, moe_routers
from moe_gspo.routing.align import build_replay_topk

pytestmark = pytest.mark.usefixtures("dist")


def _replay_state(model):
    return [(r.router_replay.router_replay_action, r.router_replay.target_topk_idx,
             len(r.router_replay.replay_backward_list)) for r in moe_routers(model)]


def test_driver_needs_replay_enabled_model(dist):
    _, _, model = tiny_pair(enable_routing_replay=False)
    with pytest.raises(ValueError, match="enable_routing_replay=True"):
        RoutingReplayDriver(model)
    with pytest.raises(ValueError, match="enable_routing_replay=True"):
        make_learner(model, model.hf_config, dist, replay="r3")


def test_r3_replays_given_routing_exactly(dist):
    """A random valid routing, replayed through the learner (3 micro-batches of different padded
    lengths), is exactly what the router hooks see for every real token."""
    cfg, _, model = tiny_pair()
    batch = make_batch(8, seed=1, with_routes=True)
    learner = make_learner(model, cfg, dist, replay="r3")
    res = learner.compute_logprobs(batch, record_routes=True, micro_batch_size=3)
    for got, want in zip(res.routes, batch.rollout_routes):
        T = want.shape[0]
        assert got.shape[0] == T + 1  # the learner also routes the last token
        np.testing.assert_array_equal(np.sort(got[:T], -1), np.sort(want, -1))
    # the model's own routing and log-probs differ: the replay really changed the forward
    model.eval()
    with MegatronRouterRecorder(model, record_probs=False) as rec, torch.no_grad():
        plain_logp = token_logprobs(forward_logits(model, batch.input_ids_BS), batch.input_ids_BS)[0]
        free = rec.to_sequences(batch.seq_lens_B.tolist(), batch.num_seqs, batch.seq_len_padded)
    assert flip_fraction([r[:-1] for r in free], batch.rollout_routes) > 0.5
    valid = valid_mask(batch)
    assert (torch.where(valid, res.logp_BS - plain_logp, 0.0)).abs().max() > 1e-3
    assert _replay_state(model) == [(None, None, 0), (None, None, 0)]


def test_driver_clears_state_even_on_error_and_recording_matches_hooks(dist):
    cfg, _, model = tiny_pair()
    model.eval()
    driver = RoutingReplayDriver(model)
    ids = torch.tensor([[3, 4, 5, 6], [7, 8, 9, 10]])
    topk = build_replay_topk([np.ones((4, 2, 2), np.int64) * [[0, 5]]] * 2, [4, 4], 4, num_experts=8, top_k=2)
    with pytest.raises(RuntimeError, match="boom"):
        with driver.replaying(topk):
            assert _replay_state(model)[0][2] == 1
            raise RuntimeError("boom")
    assert _replay_state(model) == [(None, None, 0), (None, None, 0)]
    for _ in range(3):  # nothing accumulates over repeated micro-batches
        with driver.replaying(topk), torch.no_grad():
            forward_logits(model, ids)
        assert _replay_state(model) == [(None, None, 0), (None, None, 0)]
    with pytest.raises(ValueError, match="layers"):
        with driver.replaying(topk[:1]):
            pass
    with MegatronRouterRecorder(model, record_probs=False) as rec, driver.recording() as recorded, torch.no_grad():
        forward_logits(model, ids)
    assert len(recorded) == 2
    for layer in range(2):
        assert torch.equal(recorded[layer], rec.topk_ids()[layer])


@pytest.fixture
def cpu_recompute(monkeypatch):
    """Megatron's activation checkpointing saves the CUDA RNG state; on a CPU-only torch the
    `cuda_rng_state_io` shim of `moe_gspo.mcore.shims` makes that a no-op."""
    from moe_gspo.mcore.shims import apply_shims

    if not torch.cuda.is_available():
        assert "cuda_rng_state_io" in apply_shims()


def test_replay_survives_activation_recomputation(dist, cpu_recompute):
    """With full recomputation the backward re-runs each layer's router; REPLAY_BACKWARD must feed it
    the replayed routing. A random routing makes any slip visible in the updated weights."""
    batch = make_batch(6, seed=2, with_routes=True)
    after = {}
    for recompute in (False, True):
        cfg, _, model = tiny_pair(recompute=recompute)
        learner = make_learner(model, cfg, dist, replay="r3", recompute=recompute, micro_batch_size=2)
        old = learner.compute_logprobs(batch).logp_BS
        learner.train_step(batch, old_pass(old - 0.05))
        after[recompute] = params_snapshot(model)
        assert _replay_state(model) == [(None, None, 0), (None, None, 0)]
    before = params_snapshot(tiny_pair()[2])
    assert max((after[True][k] - before[k]).abs().max() for k in before) > 1e-3
    for k in after[False]:
        torch.testing.assert_close(after[True][k], after[False][k], atol=1e-6, rtol=0)
