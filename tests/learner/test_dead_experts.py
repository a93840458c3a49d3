"""Issue 41: `router/dead_experts` from the old-policy pass (`moe_gspo.run.learner_passes.old_policy_pass`):
recounted independently from the pass's routes, windowed over steps, and carried by the learner's checkpoint."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from _learner_common import make_batch, make_learner, make_samples, tiny_pair
from moe_gspo.config import AlgoConfig, Config
from moe_gspo.run.learner_passes import old_policy_pass

pytestmark = pytest.mark.usefixtures("dist")


def _used(old, batch) -> set[tuple[int, int]]:
    """(layer, expert) pairs of the response rows P-1 .. P+R-2 of the natural pass, recounted by hand."""
    used = set()
    for b, routes in enumerate(old.natural.routes):
        cols = np.flatnonzero(batch.response_mask_BS[b].numpy())
        for t in range(cols[0] - 1, cols[-1]):
            for layer in range(routes.shape[1]):
                used.update((layer, int(e)) for e in routes[t, layer])
    return used


def test_dead_experts_recounted_windowed_and_checkpointed(dist):
    cfg = Config()
    cfg.algo = AlgoConfig(name="gspo")
    cfg.logging.dead_expert_window = 2
    hf_cfg, _, model = tiny_pair()
    learner = make_learner(model, hf_cfg, dist, algo=cfg.algo)
    policy = SimpleNamespace(learner=learner, num_experts=8)
    pairs = {(layer, e) for layer in range(2) for e in range(8)}
    seen = []
    for step, n in enumerate((1, 2, 8)):  # tiny batches leave experts unused, a larger one fewer
        samples = make_samples(n, seed=40 + step)
        batch = make_batch(n, seed=40 + step)
        old, metrics = old_policy_pass(cfg, policy, batch, samples, step=step)
        seen.append(_used(old, batch))
        window = set().union(*seen[-2:])
        assert metrics["router/dead_experts"] == len(pairs - window), step
        if step == 0:
            assert metrics["router/dead_experts"] > 0  # one sequence cannot reach all 16 (layer, expert) pairs
        if step == 1:
            state = learner.state_dict()
    assert state["expert_usage"].shape[0] == 2
    # a learner resumed from the step-1 checkpoint counts step 2 as the uninterrupted one did
    _, _, model2 = tiny_pair()
    resumed = make_learner(model2, hf_cfg, dist, algo=cfg.algo)
    resumed.load_state_dict(state)
    samples, batch = make_samples(8, seed=42), make_batch(8, seed=42)
    _, m2 = old_policy_pass(cfg, SimpleNamespace(learner=resumed, num_experts=8), batch, samples, step=2)
    assert m2["router/dead_experts"] == metrics["router/dead_experts"]
