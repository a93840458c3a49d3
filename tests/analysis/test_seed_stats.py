"""analysis.seed_stats (and analysis.seed_report's per-run scalars): per-run quantities on hand-made
reward curves, rliable IQM / probability of improvement, each quantity's own bootstrap stream replayed
by hand, Clopper-Pearson failure rates, paired / unpaired pairs, Holm-adjusted verdicts and the pairs
compared."""

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
    PairComparison, RunQuantities, UnknownArmError, arm_estimates, arm_pairs, collapsed, compare_arms,
    iqm_columns, poi_columns, reward_quantities, seed_statistics, smoothed, smoothing_window,
    steps_to_threshold, verdict,
)
from analysis.stats import Estimate, stream_seed
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


def test_collapsed_is_the_failure_detector():
    """Now `moe_gspo.algos.collapse.detect_failure`: 10-step trailing mean, ≥ 20 steps before the end."""
    peak = np.r_[np.full(10, 0.9), np.full(30, 0.4)]  # trailing mean 0.3 below its best from step 15
    assert collapsed(peak, 0.3) and collapsed(peak, 0.5) and not collapsed(peak, 0.6)
    assert not collapsed(np.r_[np.full(10, 0.9), np.full(30, 0.4), np.full(15, 0.9)], 0.3)  # recovered
    assert not collapsed(np.r_[np.full(30, 0.9), np.full(15, 0.4)], 0.3)  # too late: censored
    stalled = np.full(40, 0.6)
    assert not collapsed(stalled) and collapsed(stalled, zero_std=np.full(40, 0.95))


def test_reward_quantities_auc_and_missing_values():
    q = reward_quantities(np.asarray([0.0, 0.5, math.nan, 1.0, 1.0]), 1.0, 2e-3, reward_threshold=0.9)
    assert q.reward_auc == pytest.approx(0.625)  # NaN step dropped: (0 + .5 + 1 + 1) / 4
    assert (q.steps_to_threshold, q.reached_threshold, q.collapsed) == (3.0, True, 0.0)
    assert (q.failure_kind, q.failure_step, q.censored_at) == (None, None, 3)
    r = np.r_[np.full(10, 0.9), math.nan, np.full(30, 0.4)]
    z = np.r_[np.zeros(10), 5.0, np.zeros(30)]  # zero_std of the NaN-reward step is dropped with it
    q2 = reward_quantities(r, 0.4, math.nan, zero_std=z, seed=4)  # 0.3 below 0.9 from step 15:
    assert (q2.collapsed, q2.failure_kind, q2.failure_step, q2.censored_at, q2.seed) == (1.0, "collapse", 15, 39, 4)
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
    r = arm_estimates({"collapsed": [0, 0, 0, 0, 0, 0, 1, 1]})["collapsed"]  # a rate: k/n, Clopper-Pearson
    assert (r.point, r.events, r.num_seeds) == (0.25, 2, 8) and r.lo == pytest.approx(0.0318, abs=1e-4)
    z = arm_estimates({"collapsed": [0.0] * 8})["collapsed"]
    assert (z.lo, round(z.hi, 4)) == (0.0, 0.3694)  # not "0 [0, 0]"


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


def test_arm_ci_is_its_own_stream_replayed_by_hand():
    x = np.asarray([0.1, 0.9, 0.3, 0.35, 0.6, 0.2])
    y = np.asarray([5.0, 1.0, 3.0, 2.0, 4.0, 8.0])
    got = arm_estimates({"final_reward": x, "reward_auc": y}, reps=300, seed=7, arm="A")
    for key, v in (("final_reward", x), ("reward_auc", y)):
        rng = np.random.default_rng(stream_seed(7, key, "A"))
        stats = [_iqm(v[rng.integers(0, 6, 6)]) for _ in range(300)]
        assert (got[key].lo, got[key].hi) == pytest.approx(tuple(np.percentile(stats, [2.5, 97.5])))
        assert got[key].num_seeds == 6


def test_unpaired_pair_ci_resamples_each_arm_on_its_own():
    a, b = np.asarray([0.5, 0.7, 0.2, 0.9, 0.4]), np.asarray([0.3, 0.6, 0.1, 0.45])
    (c,) = compare_arms("A", "B", {"final_reward": a}, {"final_reward": b}, reps=300, seed=2)
    rng = np.random.default_rng(stream_seed(2, "final_reward", "A", "B"))
    ia, ib = rng.integers(0, 5, (300, 5)), rng.integers(0, 4, (300, 4))
    diffs = [_iqm(a[ia[i]]) - _iqm(b[ib[i]]) for i in range(300)]
    assert not c.paired and c.test == "Mann-Whitney U"
    assert (c.diff.lo, c.diff.hi) == pytest.approx(tuple(np.percentile(diffs, [2.5, 97.5])))
    assert c.diff.point == pytest.approx(_iqm(a) - _iqm(b))
    assert c.poi.point == pytest.approx(metrics.probability_of_improvement(a[:, None], b[:, None]))


def test_pairs_with_the_same_seeds_are_paired():
    a, b = [0.9, 0.5, 0.7, 0.8, 0.6, 0.75], [0.8, 0.45, 0.6, 0.72, 0.58, 0.7]  # A higher on every seed
    (c,) = compare_arms("A", "B", {"final_reward": a}, {"final_reward": b}, seeds_a=range(6), seeds_b=range(6),
                        reps=300)
    assert c.paired and c.test == "Wilcoxon signed-rank" and c.p == pytest.approx(1 / 32)  # exact: 2 / 2^6
    assert c.verdict == "A better than B (Holm-adjusted p = 0.031)"
    (u,) = compare_arms("A", "B", {"final_reward": a}, {"final_reward": b}, seeds_a=range(6),
                        seeds_b=[0, 1, 2, 3, 4, 9], reps=300)
    assert not u.paired and u.verdict.startswith("not decided (Holm-adjusted p = ")


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


def test_separated_arms_are_decided_after_holm():
    a = _scores(final_reward=[0.9, 0.95, 1.0, 0.92, 0.97, 0.93], steps_to_threshold=[10, 12, 11, 13, 9, 14])
    b = _scores(final_reward=[0.1, 0.2, 0.15, 0.3, 0.25, 0.22], steps_to_threshold=[40, 51, 45, 60, 44, 50])
    got = {c.key: c for c in compare_arms("A", "B", a, b, reps=500)}
    for key in ("final_reward", "steps_to_threshold"):  # higher better; lower better
        c = got[key]
        assert c.poi.point == 1.0 and (c.poi.lo, c.poi.hi) == (1.0, 1.0)
        assert c.p == pytest.approx(0.002165, abs=1e-5)  # exact: 2 / C(12, 6), complete separation
        assert c.p_holm == pytest.approx(2 * c.p)  # two tests in the family
        assert c.verdict == "A better than B (Holm-adjusted p = 0.0043)"
    assert got["steps_to_threshold"].diff.point < 0 < got["final_reward"].diff.point
    back = {c.key: c for c in compare_arms("B", "A", b, a, reps=500)}
    assert back["steps_to_threshold"].verdict.startswith("A better than B")
    assert back["final_reward"].poi.point == 0.0


def test_overlapping_arms_are_not_decided():
    a = _scores(final_reward=[0.1, 0.5, 0.9, 0.3, 0.7])
    b = _scores(final_reward=[0.05, 0.45, 0.25, 0.65, 0.35])
    (c,) = compare_arms("A", "B", a, b, reps=1000)
    assert c.diff.lo < 0 < c.diff.point < c.diff.hi and c.poi.lo < 0.5 < c.poi.point <= c.poi.hi
    assert 5 < c.seeds_needed < 1000
    assert c.verdict == f"not decided (Holm-adjusted p = {c.p_holm:.2g}; ~{c.seeds_needed} seeds per arm for 80% power)"


def test_degenerate_pairs_do_not_crash():
    same = compare_arms("A", "B", _scores(reward_auc=[0.5] * 3), _scores(reward_auc=[0.5] * 3), reps=100)[0]
    assert (same.diff.point, same.diff.lo, same.diff.hi, same.poi.point) == (0.0, 0.0, 0.0, 0.5)
    assert same.verdict == "not decided (Holm-adjusted p = 1; no difference measured)"
    one = compare_arms("A", "B", _scores(reward_auc=[0.9]), _scores(reward_auc=[0.1, 0.2]), reps=100)[0]
    assert one.verdict == "not decided: fewer than 2 seeds" and math.isnan(one.diff.lo)
    assert one.diff.point == pytest.approx(0.75) and one.poi.point == 1.0
    assert compare_arms("A", "B", _scores(mismatch_kl=[math.nan] * 2), _scores(mismatch_kl=[1.0, 2.0])) == []
    shifted = compare_arms("A", "B", _scores(collapsed=[0, 0, 0]), _scores(collapsed=[1, 1, 1]), reps=100)[0]
    assert shifted.diff.point == -1.0 and shifted.p == pytest.approx(0.1)  # exact: 2 / C(6, 3); never < 0.05
    assert shifted.verdict.startswith("not decided")


def test_verdict_wording():
    c = PairComparison("A", "B", "final_reward", Estimate(-0.2, -0.3, -0.1, 3), Estimate(0.0, 0, 0, 3), "",
                       p=0.01, p_holm=0.03, seeds_needed=4)
    assert verdict("A", "B", c, higher_is_better=True) == "B better than A (Holm-adjusted p = 0.03)"
    assert verdict("A", "B", c, higher_is_better=False) == "A better than B (Holm-adjusted p = 0.03)"
    c.p_holm = 0.2
    assert verdict("A", "B", c) == "not decided (Holm-adjusted p = 0.2; ~4 seeds per arm for 80% power)"
    c.seeds_needed = 5000
    assert verdict("A", "B", c) == "not decided (Holm-adjusted p = 0.2; > 1000 seeds per arm for 80% power)"


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
    # Holm over every pair and quantity of the report together
    from analysis.stats import holm
    assert [c.p_holm for c in stats.pairs] == pytest.approx(holm([c.p for c in stats.pairs]), nan_ok=True)
    assert stats.arms["c"]["final_reward"].num_seeds == 2 and math.isnan(stats.arms["a"]["mismatch_kl"].point)
    only = seed_statistics(runs, pairs=[("c", "a")], reps=100)
    assert {(c.arm_a, c.arm_b) for c in only.pairs} == {("c", "a")}
    with pytest.raises(UnknownArmError, match="unknown arm"):
        seed_statistics(runs, pairs=[("a", "zzz")])


def test_an_arms_and_a_pairs_cis_do_not_depend_on_the_other_arms():
    runs = {"a": _runs([0.9, 0.8, 0.85, 0.7]), "b": _runs([0.1, 0.2, 0.3, 0.25]), "c": _runs([0.5, 0.4])}
    two = seed_statistics({k: runs[k] for k in ("a", "b")}, reps=300)
    three = seed_statistics(runs, reps=300)
    for key in ("final_reward", "reward_auc"):
        assert (two.arms["a"][key].lo, two.arms["a"][key].hi) == (three.arms["a"][key].lo, three.arms["a"][key].hi)
    pick = lambda s: next(c for c in s.pairs if (c.arm_a, c.arm_b, c.key) == ("a", "b", "final_reward"))  # noqa: E731
    assert (pick(two).diff.lo, pick(two).diff.hi, pick(two).p) == (pick(three).diff.lo, pick(three).diff.hi,
                                                                    pick(three).p)
    assert pick(three).p_holm >= pick(two).p_holm  # only the Holm family grows


def test_runs_with_seeds_are_paired_in_the_report():
    seeded = {arm: [RunQuantities(f, f, 5.0, True, 0.0, math.nan, seed=s) for s, f in enumerate(finals)]
              for arm, finals in {"a": [0.9, 0.8, 0.85], "b": [0.1, 0.2, 0.3]}.items()}
    (c, *_) = seed_statistics(seeded, reps=100).pairs
    assert c.paired and c.test == "Wilcoxon signed-rank" and c.diff.num_seeds == 3
