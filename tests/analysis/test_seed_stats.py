"""analysis.seed_stats (and analysis.seed_report's per-run scalars): per-run quantities on hand-made
reward curves, rliable IQM / probability of improvement, the stratified bootstrap replayed by hand,
verdicts and the pairs compared."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
from rliable import metrics

from analysis.load import load_run
from analysis.seed_report import run_quantities
from analysis.seed_stats import (
    Estimate, RunQuantities, UnknownArmError, arm_estimates, arm_pairs, collapsed, compare_arms, iqm_columns,
    poi_columns, reward_quantities, seed_statistics, seeds_needed, smoothed, smoothing_window,
    steps_to_threshold, verdict,
)
from synth_run import recompute_headline, write_synthetic_run


# --------------------------------------------------------------------------- per run

@pytest.mark.parametrize("n,w", [(1, 1), (4, 1), (5, 1), (12, 1), (15, 2), (20, 2), (25, 3), (150, 15)])
def test_smoothing_window_is_ten_percent_rounded_half_up(n, w):
    assert smoothing_window(n) == w


def test_smoothed_is_a_trailing_full_window_mean():
    r = np.arange(20, dtype=float)  # window 2
    np.testing.assert_allclose(smoothed(r), np.arange(19) + 0.5)


def test_steps_to_threshold_by_hand():
    r = np.zeros(20)  # window 2
    r[2:] = [0.5, 0.7] + [0.9] * 16
    # smoothed: ..., (0.5+0.7)/2 = 0.6 ending at step 4, (0.7+0.9)/2 = 0.8 ending at step 5
    assert steps_to_threshold(r, 0.8) == (5, True)
    assert steps_to_threshold(r, 0.6) == (4, True)
    assert steps_to_threshold(r, 0.95) == (21, False)  # censored: steps + 1


def test_a_one_step_spike_does_not_reach_the_threshold():
    r = np.zeros(20)
    r[10] = 0.9  # window 2: the smoothed curve peaks at 0.45
    assert steps_to_threshold(r, 0.8) == (21, False)
    assert steps_to_threshold(np.r_[r[:19], 0.9], 0.8) == (21, False)


@pytest.mark.parametrize("curve,expected", [
    ([0.2, 0.6, 1.0, 0.9, 0.5], True),  # ends 0.5 below the best 1.0
    ([0.2, 0.6, 1.0, 0.5, 0.9], False),  # fell 0.5 but recovered
    ([0.2, 0.6, 1.0, 0.9, 0.75], False),  # ends only 0.25 below
    ([0.9, 0.8, 0.7, 0.6], True),  # 0.3 below its first (best) value: ≥ 0.3 counts
    ([0.0, 0.0, 0.0], False),
])
def test_collapse_by_hand(curve, expected):
    assert collapsed(np.asarray(curve), 0.3) is expected


def test_collapse_uses_the_smoothed_reward():
    r = np.r_[np.ones(18), 0.0, 1.0]  # window 2: the last smoothed value is 0.5, the best 1.0
    assert collapsed(r, 0.3) and not collapsed(r, 0.6)
    assert not collapsed(np.r_[np.ones(19), 0.0], 0.6)  # one bad step: smoothed ends at 0.5


def test_reward_quantities_auc_and_missing_values():
    q = reward_quantities(np.asarray([0.0, 0.5, math.nan, 1.0, 1.0]), 1.0, 2e-3, reward_threshold=0.9)
    assert q.reward_auc == pytest.approx(0.625)  # NaN step dropped: (0 + .5 + 1 + 1) / 4
    assert (q.steps_to_threshold, q.reached_threshold, q.collapsed) == (3.0, True, 0.0)
    assert (q.final_reward, q.mismatch_kl) == (1.0, 2e-3)
    empty = reward_quantities(np.asarray([math.nan]), math.nan, math.nan)
    assert all(math.isnan(empty.value(k)) for k in ("final_reward", "reward_auc", "steps_to_threshold",
                                                    "collapsed", "mismatch_kl"))


def test_run_quantities_of_a_run_directory(tmp_path):
    run_dir = write_synthetic_run(tmp_path / "a-s0", seed=3, with_traces=False)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward/mean"] for r in rows]
    q = run_quantities(load_run(run_dir), reward_threshold=0.5)
    expected = recompute_headline(run_dir / "metrics.jsonl")
    assert q.final_reward == pytest.approx(expected["reward_last10_mean"])
    assert q.mismatch_kl == pytest.approx(expected["k3_kl_mean"])
    assert q.reward_auc == pytest.approx(sum(rewards) / len(rewards))
    first = next(i for i, v in enumerate(rewards) if v >= 0.5)  # 12 steps: window 1
    assert (q.steps_to_threshold, q.reached_threshold) == (first + 1, True)


# --------------------------------------------------------------------------- rliable statistics

def test_iqm_by_hand():
    assert arm_estimates({"final_reward": np.arange(8.0)})["final_reward"].point == 3.5  # mean of 2..5
    assert arm_estimates({"final_reward": [0.0, 1.0, 2.0, 100.0]})["final_reward"].point == 1.5
    assert arm_estimates({"collapsed": [0, 0, 0, 0, 0, 0, 1, 1]})["collapsed"].point == 0.25  # a rate


@pytest.mark.parametrize("n,m", [(1, 1), (2, 3), (3, 3), (5, 4), (8, 8), (9, 2)])
def test_numpy_statistics_match_rliable(n, m):
    rng = np.random.default_rng(n * 10 + m)
    a, b = rng.integers(0, 4, (n, 3)).astype(float), rng.integers(0, 4, (m, 3)).astype(float)  # ties
    a[:, 2] = rng.normal(size=n)
    for j in range(3):
        assert iqm_columns(a)[j] == pytest.approx(metrics.aggregate_iqm(a[:, [j]]))
        assert poi_columns(a, b)[j] == pytest.approx(metrics.probability_of_improvement(a[:, [j]], b[:, [j]]))
    assert poi_columns(a, a) == pytest.approx(0.5)


def _iqm(x):
    return metrics.aggregate_iqm(x[:, None])


def test_arm_ci_is_rliables_stratified_bootstrap_replayed_by_hand():
    """rliable resamples from numpy's global stream: seed it and draw the same indices."""
    x = np.asarray([0.1, 0.9, 0.3, 0.35, 0.6, 0.2])
    y = np.asarray([5.0, 1.0, 3.0, 2.0, 4.0, 8.0])
    got = arm_estimates({"final_reward": x, "reward_auc": y}, reps=300, seed=7)
    np.random.seed(7)
    stats = []
    for _ in range(300):
        idx = np.random.choice(6, (6, 2), replace=True)  # one column of run indices per quantity
        stats.append([_iqm(x[idx[:, 0]]), _iqm(y[idx[:, 1]])])
    lo, hi = np.percentile(np.asarray(stats), [2.5, 97.5], axis=0)
    for j, key in enumerate(("final_reward", "reward_auc")):
        assert (got[key].lo, got[key].hi) == pytest.approx((lo[j], hi[j]))
        assert got[key].num_seeds == 6


def test_pair_ci_resamples_each_arm_on_its_own():
    a, b = np.asarray([0.5, 0.7, 0.2, 0.9, 0.4]), np.asarray([0.3, 0.6, 0.1, 0.45])
    (c,) = compare_arms("A", "B", {"final_reward": a}, {"final_reward": b}, reps=300, seed=2)
    np.random.seed(2)
    diffs, pois = [], []
    for _ in range(300):
        ia, ib = np.random.choice(5, (5, 1), replace=True), np.random.choice(4, (4, 1), replace=True)
        diffs.append(_iqm(a[ia[:, 0]]) - _iqm(b[ib[:, 0]]))
        pois.append(metrics.probability_of_improvement(a[ia], b[ib]))
    assert (c.diff.lo, c.diff.hi) == pytest.approx(tuple(np.percentile(diffs, [2.5, 97.5])))
    assert (c.poi.lo, c.poi.hi) == pytest.approx(tuple(np.percentile(pois, [2.5, 97.5])))
    assert c.diff.point == pytest.approx(_iqm(a) - _iqm(b))
    assert c.poi.point == pytest.approx(metrics.probability_of_improvement(a[:, None], b[:, None]))


def test_ci_properties_and_reproducibility():
    x = np.random.default_rng(0).normal(size=7)
    e = arm_estimates({"reward_auc": x}, reps=500)["reward_auc"]
    assert x.min() <= e.lo <= e.point <= e.hi <= x.max() and e.lo < e.hi
    again = arm_estimates({"reward_auc": x}, reps=500)["reward_auc"]
    other = arm_estimates({"reward_auc": x}, reps=500, seed=1)["reward_auc"]
    assert (again.lo, again.hi) == (e.lo, e.hi) and (other.lo, other.hi) != (e.lo, e.hi)
    const = arm_estimates({"reward_auc": [0.4] * 5}, reps=200)["reward_auc"]
    assert (const.point, const.lo, const.hi) == pytest.approx((0.4, 0.4, 0.4))


def test_bootstrap_leaves_the_global_numpy_stream_as_it_was():
    np.random.seed(123)
    expected = np.random.rand()
    np.random.seed(123)
    arm_estimates({"reward_auc": [0.1, 0.2, 0.4]}, reps=50)
    assert np.random.rand() == expected


def test_non_finite_seeds_are_left_out_and_one_seed_has_no_ci():
    got = arm_estimates({"final_reward": [0.2, math.nan, 0.4], "mismatch_kl": [math.nan, 1e-3, math.nan],
                         "reward_auc": [math.nan] * 3}, reps=100)
    assert got["final_reward"].num_seeds == 2 and got["final_reward"].point == pytest.approx(0.3)
    m = got["mismatch_kl"]
    assert (m.point, m.num_seeds, math.isnan(m.lo), math.isnan(m.hi)) == (1e-3, 1, True, True)
    assert got["reward_auc"].num_seeds == 0 and math.isnan(got["reward_auc"].point)


# --------------------------------------------------------------------------- verdicts

def _scores(**kw):
    return {k: np.asarray(v, float) for k, v in kw.items()}


def test_separated_arms_are_decided():
    a = _scores(final_reward=[0.9, 0.95, 1.0, 0.92], steps_to_threshold=[10, 12, 11, 13])
    b = _scores(final_reward=[0.1, 0.2, 0.15, 0.3], steps_to_threshold=[40, 51, 45, 60])
    got = {c.key: c for c in compare_arms("A", "B", a, b, reps=500)}
    for key in ("final_reward", "steps_to_threshold"):  # higher better; lower better
        assert got[key].poi.point == 1.0 and (got[key].poi.lo, got[key].poi.hi) == (1.0, 1.0)
        assert got[key].verdict == "A better than B: the 95% CI of the difference excludes 0"
    assert got["steps_to_threshold"].diff.point < 0 < got["final_reward"].diff.point
    back = {c.key: c for c in compare_arms("B", "A", b, a, reps=500)}
    assert back["steps_to_threshold"].verdict.startswith("A better than B")
    assert back["final_reward"].poi.point == 0.0


def test_overlapping_arms_are_not_decided():
    a = _scores(final_reward=[0.1, 0.5, 0.9, 0.3, 0.7])
    b = _scores(final_reward=[0.05, 0.45, 0.25, 0.65, 0.35])  # IQM 0.35 vs 0.5
    (c,) = compare_arms("A", "B", a, b, reps=1000)
    assert c.diff.lo < 0 < c.diff.point < c.diff.hi and c.poi.lo < 0.5 < c.poi.point <= c.poi.hi
    m = seeds_needed(c.diff.point, c.diff.lo, c.diff.hi, 5)
    assert 5 < m < 1000 and c.verdict == f"not decided at 5 seeds; ~{m} seeds per arm might decide it"


def test_degenerate_pairs_do_not_crash():
    same = compare_arms("A", "B", _scores(reward_auc=[0.5] * 3), _scores(reward_auc=[0.5] * 3), reps=100)[0]
    assert (same.diff.point, same.diff.lo, same.diff.hi, same.poi.point) == (0.0, 0.0, 0.0, 0.5)
    assert same.verdict == "not decided at 3 seeds; no difference measured"
    one = compare_arms("A", "B", _scores(reward_auc=[0.9]), _scores(reward_auc=[0.1, 0.2]), reps=100)[0]
    assert one.verdict == "not decided: fewer than 2 seeds" and math.isnan(one.diff.lo)
    assert one.diff.point == pytest.approx(0.75) and one.poi.point == 1.0
    assert compare_arms("A", "B", _scores(mismatch_kl=[math.nan] * 2), _scores(mismatch_kl=[1.0, 2.0])) == []
    shifted = compare_arms("A", "B", _scores(collapsed=[0, 0, 0]), _scores(collapsed=[1, 1, 1]), reps=100)[0]
    assert shifted.verdict.startswith("A better than B")  # constant but different: the CI is [-1, -1]


def test_seeds_needed_by_hand():
    assert seeds_needed(0.1, -0.1, 0.3, 4) == 16  # (0.2 / 0.1)^2 * 4
    assert seeds_needed(0.1, -0.02, 0.2, 4) == 6  # asymmetric CI: the end on zero's side, ceil(5.76)
    assert seeds_needed(-0.1, -0.3, 0.1, 4) == 16
    assert seeds_needed(0.1, 0.0, 0.2, 4) == 5  # at least one more seed
    assert seeds_needed(0.0, -0.1, 0.1, 4) is None


def test_verdict_wording():
    undecided = Estimate(0.001, -0.5, 0.5, 3)
    assert verdict("A", "B", undecided, 3, 3, True) == "not decided at 3 seeds; > 1000 seeds per arm"
    assert verdict("A", "B", Estimate(0.1, -0.1, 0.3, 3), 3, 5, True) == \
        "not decided at 3 and 5 seeds; ~20 seeds per arm might decide it"
    assert verdict("A", "B", Estimate(-0.2, -0.3, -0.1, 3), 3, 3, True).startswith("B better than A")
    assert verdict("A", "B", Estimate(-0.2, -0.3, -0.1, 3), 3, 3, False).startswith("A better than B")


# --------------------------------------------------------------------------- pairs

def test_all_pairs_up_to_six_arms_then_one_component_apart():
    assert arm_pairs(["a", "b", "c"]) == [("a", "b"), ("a", "c"), ("b", "c")]
    arms = ["-".join(c) for c in itertools.product(["gspo", "grpo"], ["none", "r3"], ["base", "lr_high"])]
    pairs = arm_pairs(arms + ["custom"])
    assert len(pairs) == 12  # 3 components x 4 pairs each
    assert ("gspo-none-base", "grpo-none-base") in pairs and ("gspo-none-base", "grpo-r3-base") not in pairs
    assert all(sum(x != y for x, y in zip(a.split("-"), b.split("-"))) == 1 for a, b in pairs)


def _runs(finals):
    return [RunQuantities(f, f, 5.0, True, 0.0, math.nan) for f in finals]


def test_seed_statistics_pairs_and_unknown_arms():
    runs = {"a": _runs([0.9, 0.8, 0.85]), "b": _runs([0.1, 0.2, 0.3]), "c": _runs([0.5, 0.4])}
    stats = seed_statistics(runs, reps=100)
    assert [(c.arm_a, c.arm_b) for c in stats.pairs if c.key == "final_reward"] == [("a", "b"), ("a", "c"),
                                                                                    ("b", "c")]
    assert {c.key for c in stats.pairs} == {"final_reward", "reward_auc", "steps_to_threshold", "collapsed"}
    assert stats.arms["c"]["final_reward"].num_seeds == 2 and math.isnan(stats.arms["a"]["mismatch_kl"].point)
    only = seed_statistics(runs, pairs=[("c", "a")], reps=100)
    assert {(c.arm_a, c.arm_b) for c in only.pairs} == {("c", "a")}
    with pytest.raises(UnknownArmError, match="unknown arm"):
        seed_statistics(runs, pairs=[("a", "zzz")])
