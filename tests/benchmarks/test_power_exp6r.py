"""benchmarks.phase_pilot.power_exp6r: experiment 6R's pilot is experiment 6's committed runs, the simulated sign-flip
test matches the analysis' exact p, it decides only the claimed way, and the config has the pre-registered arms."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from analysis.staleness_exploratory import sign_flip_p
from benchmarks.phase_pilot import power_exp6r as pe

ROOT = Path(__file__).resolve().parents[2]


def test_the_simulated_sign_flip_p_is_the_analysis_p():
    rng = np.random.default_rng(0)
    d = np.asarray([[0.22] * 4 + [-0.01] * 6, [0.3, -0.1, 0.05, 0.0, 0.2, -0.02, 0.1, 0.01, -0.05, 0.07]])
    p = pe.sign_flip_pvalues(d, 20000, rng)
    assert abs(p[0] - 0.125) < 0.01  # exact: 128 of the 1024 sign patterns
    assert abs(p[1] - sign_flip_p(d[1])) < 0.01
    assert pe.sign_flip_pvalues(np.zeros((1, 8)), 100, rng)[0] == 1.0


def test_decided_only_the_claimed_way():
    rng = np.random.default_rng(1)
    up = 0.1 + 0.01 * rng.random((50, 12))
    assert pe.decided(up, 999, rng).all() and not pe.decided(-up, 999, rng).any()
    assert pe.decided(-up, 999, rng, -1.0).all()


def test_the_pilot_and_the_printed_power(capsys):
    assert pe.main(["--sims", "200", "--flips", "200", "--seeds", "10,50"]) == 0
    out = capsys.readouterr().out
    assert "GRPO stalled 9/40, GSPO 0/40; stalled pool 23 runs" in out
    row = next(line for line in out.splitlines() if line.startswith("| as observed"))
    low, high = (float(c) for c in row.strip("|").split("|")[1:])
    assert low < high and high > 0.8  # more seeds, more power; 50 seeds decide the observed effect


def test_the_config_has_the_preregistered_arms():
    from moe_gspo.run.ablation_arms import expand_arms
    from moe_gspo.run.ablation_spec import load_spec

    spec = load_spec(str(ROOT / "configs/ablation_training_exp6r.yaml"))
    arms = {}
    for arm in expand_arms(spec, warn=False):
        arms.setdefault(arm.group, set()).add(arm.seed)
    primary, controls = set(range(6100, 6150)), set(range(6100, 6110))
    assert arms == {"grpo-none-mb16": primary, "gspo-none-mb16": primary, "grpo-none-mb1": controls,
                    "grpo-r2-mb1": controls, "grpo-none-mb4": controls, "grpo-none-pos": controls}
