"""benchmarks.phase_pilot.power_middle: experiment 4's seed count comes from experiment 3's per-seed differences,
and its power counts only simulations where both tests are decided with the middle lower."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from benchmarks.phase_pilot import power_middle as pm

ROOT = Path(__file__).resolve().parents[2]


def test_the_differences_are_experiment_3s_post_hoc_ones():
    d = pm.per_seed_differences(str(ROOT / "reports" / "phase" / "metrics.jsonl.gz"))
    assert d.shape == (10, 2)
    assert d[:, 0].mean() == pytest.approx(-0.078, abs=5e-4)  # the page's exploratory per-seed mean drop
    assert (d[:, 0] < -0.05).sum() == 6  # the seeds that carry it


def test_power_needs_both_tests_decided_the_claimed_way(monkeypatch):
    monkeypatch.setattr(pm, "SIMS", 200)
    rng = np.random.default_rng(0)
    lower = np.column_stack([-0.1 - 0.01 * rng.random(10), -0.1 - 0.01 * rng.random(10)])
    assert pm.power(lower, 15, keep=1.0, rng=np.random.default_rng(1)) == 1.0
    assert pm.power(-lower, 15, keep=1.0, rng=np.random.default_rng(1)) == 0.0  # decided, the wrong way
    mixed = lower.copy()
    mixed[:, 1] *= -1  # the middle below zero but above the top dose: no inverted U
    assert pm.power(mixed, 15, keep=1.0, rng=np.random.default_rng(1)) == 0.0
    assert pm.power(lower, 15, keep=0.5, rng=np.random.default_rng(1)) < 1.0  # thinning costs power
