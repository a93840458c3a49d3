"""The comparison report's seed-statistics part: per-run scalars from loaded runs, and the tables
and definitions of `analysis.seed_stats`' per-arm estimates and pairwise verdicts
(`analysis.compare` puts them in the report)."""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from analysis.load import ReportInputError, RunData, headline_numbers, series
from analysis.report import Table
from analysis.seed_stats import (
    DEFAULT_COLLAPSE_DROP, DEFAULT_REPS, DEFAULT_REWARD_THRESHOLD, QUANTITIES, QUANTITY, Estimate,
    RunQuantities, SeedStatistics, UnknownArmError, reward_quantities, seed_statistics,
)
from analysis.stats import fmt_ci, fmt_p


def reward_and_zero_std(run: RunData) -> tuple[np.ndarray, np.ndarray]:
    """reward/mean per step and reward/frac_zero_std at the same steps (NaN where not logged)."""
    steps, reward = series(run.records, "reward/mean")
    zs_steps, zs = series(run.records, "reward/frac_zero_std")
    by_step = dict(zip(zs_steps.tolist(), zs.tolist()))
    return reward, np.asarray([by_step.get(s, math.nan) for s in steps.tolist()], np.float64)


def run_quantities(run: RunData, reward_threshold: float = DEFAULT_REWARD_THRESHOLD,
                   collapse_drop: float = DEFAULT_COLLAPSE_DROP, seed: int | None = None) -> RunQuantities:
    """The seed statistics' per-run scalars (`analysis.seed_stats.reward_quantities`) of one run,
    the failure detector seeing both reward/mean and reward/frac_zero_std."""
    h = headline_numbers(run.records)
    reward, zero_std = reward_and_zero_std(run)
    return reward_quantities(reward, h["reward_last10_mean"], h["k3_kl_mean"], reward_threshold=reward_threshold,
                             collapse_drop=collapse_drop, zero_std=zero_std, seed=seed)


def arm_seed_statistics(arm_runs: Mapping[str, list[tuple[int, RunData]]], *,
                        reward_threshold: float = DEFAULT_REWARD_THRESHOLD,
                        collapse_drop: float = DEFAULT_COLLAPSE_DROP, pairs: list[tuple[str, str]] | None = None,
                        reps: int = DEFAULT_REPS) -> SeedStatistics:
    """`seed_statistics` of loaded runs per arm (arms without a readable run are left out). Raises
    `ReportInputError` when `pairs` names an arm that is not among them."""
    runs = {arm: [run_quantities(run, reward_threshold, collapse_drop, seed) for seed, run in seeds]
            for arm, seeds in arm_runs.items() if seeds}
    try:
        return seed_statistics(runs, pairs=pairs, reps=reps)
    except UnknownArmError as e:
        raise ReportInputError(str(e)) from e


def fmt_estimate(e: Estimate) -> str:
    """`analysis.stats.fmt_ci`: 'point [lo, hi]' with the digits the CI supports; a rate
    'k/n (r %, 95% CI lo–hi %)'; without a CI 'point (n seeds)'; 'n/a' without a value."""
    return fmt_ci(e)


def _design(c) -> str:
    return f"paired by seed (n={c.diff.num_seeds})" if c.paired else "unpaired"


def seed_tables(stats: SeedStatistics) -> list[Table]:
    """The per-arm seed statistics and the pairwise verdicts (Holm-adjusted over the whole table)."""
    rows = []
    for arm, est in stats.arms.items():
        cells = {q.key: fmt_estimate(est[q.key]) for q in QUANTITIES}
        misses = sum(not r.reached_threshold for r in stats.runs[arm] if math.isfinite(r.steps_to_threshold))
        if misses:  # censored runs: the arm's value is a lower bound
            cells["steps_to_threshold"] += f"; {misses}/{est['steps_to_threshold'].num_seeds} not reached"
        rows.append([arm, str(len(stats.runs[arm]))] + list(cells.values()))
    pct = f"{stats.confidence:.0%}"
    pair_rows = [[f"{c.arm_a} vs {c.arm_b}", QUANTITY[c.key].label, _design(c), fmt_estimate(c.diff),
                  fmt_estimate(c.poi), f"{fmt_p(c.p)} ({c.test})" if c.test else "n/a", fmt_p(c.p_holm), c.verdict]
                 for c in stats.pairs]
    return [Table(f"Seed statistics (IQM [{pct} bootstrap CI] over seeds; failure rate: k/n with the exact "
                  "Clopper–Pearson CI)", ["arm", "seeds"] + [q.label for q in QUANTITIES], rows),
            Table("Pairwise verdicts", ["pair (A vs B)", "quantity", "design", f"difference A − B [{pct} CI]",
                                        f"P(A better) [{pct} CI]", "p (test)", "Holm-adjusted p", "verdict"],
                  pair_rows)]


def seed_notes(stats: SeedStatistics, reward_threshold: float, collapse_drop: float) -> list[str]:
    """Intro lines that define the seed statistics."""
    return [
        "Seed statistics, per run: final reward = mean reward/mean over the last 10% of steps; reward AUC = "
        "mean reward/mean over all steps; steps to threshold = steps until the reward's moving average over "
        f"10% of the run's steps first reaches {reward_threshold:g} (a run that never does counts as its "
        "steps + 1: censored, so the arm's value is a lower bound); failed = the run collapsed (10-step trailing "
        f"mean reward ≥ {collapse_drop:g} below its running best to the end) or stalled (trailing share of "
        "groups with all-equal rewards ≥ 0.9, staying ≥ 0.75, reward < 0.9 to the end), at least 20 steps "
        "before the end (moe_gspo.algos.collapse.detect_failure); mismatch k3 KL = mean mismatch/k3_kl "
        "(rollout engine vs learner). Lower is better for the last three.",
        f"Per arm: interquartile mean over seeds with a {stats.confidence:.0%} percentile bootstrap CI "
        f"({stats.reps} resamples; each arm and quantity its own stream seeded from {stats.seed}, the quantity "
        "and the arm); failure rate: k/n with the exact Clopper–Pearson CI. Pairs: arms with the same "
        "train.seed values are paired by seed (IQM of the per-seed differences, CI over seeds, Wilcoxon "
        "signed-rank p), others unpaired (IQM difference, each arm resampled on its own, Mann–Whitney U p); "
        "probability of improvement (> 0.5: A better). Verdicts use Holm-adjusted p-values over every test "
        "of the table (alpha 0.05); undecided pairs give the seeds per arm a two-sided test would need for "
        "80% power at the observed effect size. With few seeds (≤ 5) bootstrap CIs tend to cover less "
        "than their nominal level.",
    ]
