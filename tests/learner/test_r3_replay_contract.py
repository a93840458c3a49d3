"""Issue 41: the R3 replay contract in the learner's forward (`moe_gspo.run.learner_passes.old_policy_pass`,
`check_replay_contract`): a working replay logs r3/replay_mismatch_frac = 0, a deliberately wrong replay
(permuted expert ids reach the routers) is detected, and algo.r3_max_mismatch stops the run naming the step."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from _learner_common import make_learner, make_samples, tiny_pair
from moe_gspo.config import AlgoConfig, Config
from moe_gspo.learner.batch import PackedBatch
from moe_gspo.learner.learner import Learner
from moe_gspo.run.learner_passes import old_policy_pass

pytestmark = pytest.mark.usefixtures("dist")


def _setup(dist, max_mismatch=None):
    cfg = Config()
    cfg.algo = AlgoConfig(name="grpo", routing_replay="r3", r3_max_mismatch=max_mismatch)
    hf_cfg, _, model = tiny_pair()
    learner = make_learner(model, hf_cfg, dist, replay="r3", algo=cfg.algo)
    samples = make_samples(6, seed=21, with_routes=True)
    samples[1].routes_TLK = None  # one sequence falls back to natural routing: not counted
    batch = PackedBatch.from_samples(samples, np.linspace(-1, 1, 6).astype(np.float32), pad_id=0)
    return cfg, SimpleNamespace(learner=learner, num_experts=learner.num_experts), batch, samples


def _permuting(monkeypatch):
    """A broken replay: the routers receive every replayed expert id e as (e + 1) % E."""
    original = Learner.replay_context

    def replay_context(self, routes, seq_lens, seq_len):
        if routes is not None:
            routes = [((np.asarray(r).astype(np.int64) + 1) % self.num_experts).astype(np.asarray(r).dtype)
                      for r in routes]
        return original(self, routes, seq_lens, seq_len)

    monkeypatch.setattr(Learner, "replay_context", replay_context)


def test_working_replay_logs_zero_mismatch(dist):
    cfg, policy, batch, samples = _setup(dist, max_mismatch=0.0)
    old, metrics = old_policy_pass(cfg, policy, batch, samples, step=0)
    assert metrics["r3/replay_mismatch_frac"] == 0.0
    assert metrics["r3/fallback_rows_missing"] > 0  # the fallback sequence exists, and is not counted
    assert old.replayed_logp_BS is not None


def test_permuted_replay_is_detected(dist, monkeypatch):
    cfg, policy, batch, samples = _setup(dist)
    _permuting(monkeypatch)
    _, metrics = old_policy_pass(cfg, policy, batch, samples, step=0)
    # every counted row's every layer ran the shifted set, which never equals the replayed one
    assert metrics["r3/replay_mismatch_frac"] == 1.0


def test_threshold_stops_the_run_naming_step_and_share(dist, monkeypatch):
    cfg, policy, batch, samples = _setup(dist, max_mismatch=0.01)
    _permuting(monkeypatch)
    with pytest.raises(ValueError, match=r"^step 7: R3 replay contract broken: 100\.00% .*"
                                         r"r3/replay_mismatch_frac=1 > algo\.r3_max_mismatch=0\.01"):
        old_policy_pass(cfg, policy, batch, samples, step=7)


def test_threshold_must_be_a_share():
    from moe_gspo.config_checks import validate

    cfg = Config()
    cfg.algo.r3_max_mismatch = 1.5
    with pytest.raises(ValueError, match=r"algo\.r3_max_mismatch=1\.5 must be in \[0, 1\]"):
        validate(cfg)
