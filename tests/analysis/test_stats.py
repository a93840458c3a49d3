"""analysis.stats: own bootstrap streams, paired / unpaired comparisons, Holm, Clopper-Pearson rates,
power, Kaplan-Meier / log-rank, and the rounding helper; against hand values and the libraries."""

from __future__ import annotations

import math

import numpy as np
import pytest
from rliable import metrics
from scipy.stats import mannwhitneyu, wilcoxon
from statsmodels.stats.multitest import multipletests
from statsmodels.stats.power import TTestPower

from analysis import stats as st
from analysis.seed_stats import arm_estimates, compare_arms


def test_stream_seed_is_stable_and_distinct():
    assert st.stream_seed(0, "final_reward", "a") == st.stream_seed(0, "final_reward", "a")
    seeds = {st.stream_seed(b, k, a) for b in (0, 1) for k in ("x", "y") for a in ("a", "b")}
    assert len(seeds) == 8 and all(0 <= s < 2 ** 63 for s in seeds)
    # a fixed value: SHA-256, not Python's salted hash()
    assert st.stream_seed(0, "k") == int.from_bytes(__import__("hashlib").sha256(b"0\0k").digest()[:8], "little") >> 1


def test_bootstrap_replayed_by_hand():
    x = np.asarray([0.1, 0.9, 0.3, 0.35, 0.6, 0.2])
    e = st.bootstrap_ci(x, reps=400, seed=7)
    rng = np.random.default_rng(7)
    stats = [metrics.aggregate_iqm(x[rng.integers(0, 6, 6)][:, None]) for _ in range(400)]
    assert (e.lo, e.hi) == pytest.approx(tuple(np.percentile(stats, [2.5, 97.5])))
    assert e.point == pytest.approx(metrics.aggregate_iqm(x[:, None])) and e.num_seeds == 6


def test_a_ci_does_not_depend_on_what_else_is_computed():
    rng = np.random.default_rng(0)
    a = {"final_reward": rng.normal(size=8), "reward_auc": rng.normal(size=8)}
    b = {"final_reward": rng.normal(size=8), "reward_auc": rng.normal(size=8)}
    alone = arm_estimates({"final_reward": a["final_reward"]}, arm="A", reps=500)["final_reward"]
    together = arm_estimates(a, arm="A", reps=500)["final_reward"]
    assert (alone.lo, alone.hi) == (together.lo, together.hi)
    other_arm = arm_estimates({"final_reward": a["final_reward"]}, arm="B", reps=500)["final_reward"]
    assert (other_arm.lo, other_arm.hi) != (alone.lo, alone.hi)  # its own stream
    one = compare_arms("A", "B", {"final_reward": a["final_reward"]}, {"final_reward": b["final_reward"]}, reps=500)
    both = compare_arms("A", "B", a, b, reps=500)
    assert (one[0].diff.lo, one[0].diff.hi, one[0].poi.lo) == (both[0].diff.lo, both[0].diff.hi, both[0].poi.lo)


def test_paired_comparison_by_hand():
    a = {0: 0.9, 1: 0.8, 2: 0.7, 3: 0.95, 4: 0.6}
    b = {0: 0.5, 1: 0.6, 2: 0.65, 3: 0.5, 4: 0.65}
    d = st.compare(a, b, reps=300, seed=3)
    diffs = np.asarray([a[s] - b[s] for s in range(5)])
    assert d.paired and d.test == "Wilcoxon signed-rank"
    assert d.p == pytest.approx(wilcoxon(diffs).pvalue)
    assert d.diff.point == pytest.approx(metrics.aggregate_iqm(diffs[:, None]))
    rng = np.random.default_rng(3)
    boots = [metrics.aggregate_iqm(diffs[rng.integers(0, 5, 5)][:, None]) for _ in range(300)]
    assert (d.diff.lo, d.diff.hi) == pytest.approx(tuple(np.percentile(boots, [2.5, 97.5])))


def test_unpaired_where_seeds_differ():
    a, b = {0: 0.9, 1: 0.8, 2: 0.7}, {0: 0.5, 1: 0.6, 5: 0.65}
    d = st.compare(a, b, reps=200)
    assert not d.paired and d.test == "Mann-Whitney U"
    assert d.p == pytest.approx(mannwhitneyu([0.9, 0.8, 0.7], [0.5, 0.6, 0.65]).pvalue)
    assert d.diff.point == pytest.approx(0.8 - np.mean([0.5, 0.6, 0.65]))  # 3 seeds: the IQM trims none
    assert not st.compare([1.0, 2.0], [1.0, 2.0], reps=50).paired  # plain sequences: unpaired
    assert st.compare({0: 1.0, 1: 1.0}, {0: 1.0, 1: 1.0}, reps=50).p == 1.0


def test_holm_matches_statsmodels_and_keeps_nan():
    p = [0.01, 0.04, math.nan, 0.03, 0.5]
    got = st.holm(p)
    want = multipletests([0.01, 0.04, 0.03, 0.5], method="holm")[1]
    assert [got[i] for i in (0, 1, 3, 4)] == pytest.approx(list(want)) and math.isnan(got[2])
    assert got[0] == pytest.approx(0.04)  # 4 tests: 0.01 * 4


def test_clopper_pearson_rates():
    r = st.rate(0, 8)
    assert (r.point, r.lo) == (0.0, 0.0) and r.hi == pytest.approx(1 - 0.025 ** (1 / 8))  # 0.369
    assert st.fmt_rate(r) == "0/8 (0 %, 95% CI 0–37 %)"
    r = st.rate(8, 8)
    assert r.lo == pytest.approx(0.025 ** (1 / 8)) and r.hi == 1.0
    assert st.fmt_rate(st.rate(1, 20)) == "1/20 (5 %, 95% CI 0.1–25 %)"
    assert st.fmt_ci(st.rate(2, 8)) == st.fmt_rate(st.rate(2, 8))


def test_seeds_for_power():
    d = np.asarray([0.1, 0.3, 0.2, 0.0, 0.25])
    n = st.seeds_for_power(d)
    es = d.mean() / d.std(ddof=1)
    eng = TTestPower()
    assert eng.power(es, n, 0.05) >= 0.8 > eng.power(es, n - 1, 0.05)
    assert n == math.ceil(eng.solve_power(es, power=0.8, alpha=0.05))
    assert n > math.ceil(eng.solve_power(es, power=0.5, alpha=0.05))  # more than the 50%-power figure
    assert st.seeds_for_power([0.0, 0.0, 0.0]) is None
    assert st.seeds_for_power([1e-4, -1e-4, 1.01e-4, -1e-4]) == st.MAX_SEEDS + 1  # d ~ 0.004
    a, b = np.asarray([1.0, 2.0, 3.0, 4.0]), np.asarray([2.0, 3.0, 4.0, 5.0])
    m = st.seeds_for_power(a, b, paired=False)  # d = 1 / 1.29: about 27 per arm
    assert 20 < m < 35


def test_kaplan_meier_and_logrank():
    from lifelines import KaplanMeierFitter
    from lifelines.statistics import logrank_test

    a = st.survival([10, 20, 30, 99, 99], [True, True, True, False, False])
    assert a.median == 30.0
    km = KaplanMeierFitter().fit([10, 20, 30, 99, 99], [1, 1, 1, 0, 0])
    assert a.survival[-1] == pytest.approx(float(km.survival_function_.iloc[-1, 0])) == pytest.approx(0.4)
    assert st.survival([13] * 4 + [39] * 4, [True] * 4 + [False] * 4).median == 13.0  # S = 0.5 exactly
    assert st.survival([13, 13, 39, 39], [True, True, False, False]).median == 13.0
    b = st.survival([99] * 5, [False] * 5)
    assert b.median == math.inf
    lr = st.logrank(a, b)
    assert lr.p == pytest.approx(logrank_test([10, 20, 30, 99, 99], [99] * 5, [1, 1, 1, 0, 0], [0] * 5).p_value)
    # expected failures of A: at t=10 1*5/10, t=20 1*4/9, t=30 1*3/8
    assert lr.observed_minus_expected == pytest.approx(3 - (0.5 + 4 / 9 + 3 / 8))
    assert st.logrank(b, b).p == 1.0 and math.isnan(st.logrank(a, st.survival([], [])).p)


@pytest.mark.parametrize("e,text", [
    (st.Estimate(0.7301, 0.5952, 0.9401, 8), "0.73 [0.60, 0.94]"),  # bounds differ in the 1st decimal
    (st.Estimate(0.03206, 0.03029, 0.03328, 8), "0.0321 [0.0303, 0.0333]"),
    (st.Estimate(2.497, 2.093, 3.535, 8), "2.5 [2.1, 3.5]"),
    (st.Estimate(2.3e-4, 1.171e-4, 3.897e-4, 8), "2.3e-04 [1.2e-04, 3.9e-04]"),
    (st.Estimate(-4.676e-05, -1.321e-4, -2.19e-05, 8), "-5e-05 [-1.3e-04, -2e-05]"),  # width 1.1e-4: to 1e-5
    (st.Estimate(1234.5, 1000.0, 1500.0, 8), "1230 [1000, 1500]"),
    (st.Estimate(0.4, 0.4, 0.4, 5), "0.4 [0.4, 0.4]"),
    (st.Estimate(0.14999999999999997, 0.14999999999999991, 0.15000000000000002, 8), "0.15 [0.15, 0.15]"),  # rounding
    (st.Estimate(0.925, math.nan, math.nan, 1), "0.925 (1 seed)"),
    (st.Estimate(math.nan, math.nan, math.nan, 0), "n/a"),
])
def test_fmt_ci_prints_the_digits_the_ci_supports(e, text):
    assert st.fmt_ci(e) == text


def test_fmt_p():
    assert [st.fmt_p(p) for p in (0.012345, 1.0, 3e-6, math.nan)] == ["0.012", "1", "< 0.0001", "n/a"]


def test_fmt_seeds_needed():
    assert st.fmt_seeds_needed(12, 8) == "~12 seeds per arm for 80% power"
    assert st.fmt_seeds_needed(None, 8) == "no effect measured"
    assert st.fmt_seeds_needed(5000, 8) == "> 1000 seeds per arm for 80% power"
    assert st.fmt_seeds_needed(2, 8).startswith("a t-test would have 80% power at ~2 seeds per arm, but the rank "
                                                "test with Holm's correction does not decide it at 8")
