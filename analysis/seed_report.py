"""The comparison report's seed-statistics part: per-run scalars from loaded runs, and the tables
and definitions of `analysis.seed_stats`' per-arm estimates and pairwise verdicts
(`analysis.compare` puts them in the report)."""

from __future__ import annotations

import math
from collections.abc import Mapping

from analysis.load import ReportInputError, RunData, headline_numbers, series
from analysis.report import Table, fmt_number
from analysis.seed_stats import (
    DEFAULT_COLLAPSE_DROP, DEFAULT_REPS, DEFAULT_REWARD_THRESHOLD, QUANTITIES, QUANTITY, Estimate,
    RunQuantities, SeedStatistics, UnknownArmError, reward_quantities, seed_statistics,
)


def run_quantities(run: RunData, reward_threshold: float = DEFAULT_REWARD_THRESHOLD,
                   collapse_drop: float = DEFAULT_COLLAPSE_DROP) -> RunQuantities:
    """The seed statistics' per-run scalars (`analysis.seed_stats.reward_quantities`) of one run."""
    h = headline_numbers(run.records)
    return reward_quantities(series(run.records, "reward/mean")[1], h["reward_last10_mean"], h["k3_kl_mean"],
                             reward_threshold=reward_threshold, collapse_drop=collapse_drop)


def arm_seed_statistics(arm_runs: Mapping[str, list[tuple[int, RunData]]], *,
                        reward_threshold: float = DEFAULT_REWARD_THRESHOLD,
                        collapse_drop: float = DEFAULT_COLLAPSE_DROP, pairs: list[tuple[str, str]] | None = None,
                        reps: int = DEFAULT_REPS) -> SeedStatistics:
    """`seed_statistics` of loaded runs per arm (arms without a readable run are left out). Raises
    `ReportInputError` when `pairs` names an arm that is not among them."""
    runs = {arm: [run_quantities(run, reward_threshold, collapse_drop) for _, run in seeds]
            for arm, seeds in arm_runs.items() if seeds}
    try:
        return seed_statistics(runs, pairs=pairs, reps=reps)
    except UnknownArmError as e:
        raise ReportInputError(str(e)) from e


def fmt_estimate(e: Estimate) -> str:
    """'point [lo, hi]'; without a CI (one seed) 'point (1 seed)'; 'n/a' without a value."""
    if e.num_seeds == 0 or not math.isfinite(e.point):
        return "n/a"
    if not (math.isfinite(e.lo) and math.isfinite(e.hi)):
        return f"{fmt_number(e.point)} ({e.num_seeds} seed{'s' if e.num_seeds != 1 else ''})"
    return f"{fmt_number(e.point)} [{fmt_number(e.lo)}, {fmt_number(e.hi)}]"


def seed_tables(stats: SeedStatistics) -> list[Table]:
    """The per-arm seed statistics and the pairwise verdicts."""
    rows = []
    for arm, est in stats.arms.items():
        cells = {q.key: fmt_estimate(est[q.key]) for q in QUANTITIES}
        misses = sum(not r.reached_threshold for r in stats.runs[arm] if math.isfinite(r.steps_to_threshold))
        if misses:  # censored runs: the arm's value is a lower bound
            cells["steps_to_threshold"] += f"; {misses}/{est['steps_to_threshold'].num_seeds} not reached"
        rows.append([arm, str(len(stats.runs[arm]))] + list(cells.values()))
    pct = f"{stats.confidence:.0%}"
    pair_rows = [[f"{c.arm_a} vs {c.arm_b}", QUANTITY[c.key].label, fmt_estimate(c.diff), fmt_estimate(c.poi),
                  c.verdict] for c in stats.pairs]
    return [Table(f"Seed statistics (IQM [{pct} CI] over seeds, rliable stratified bootstrap)",
                  ["arm", "seeds"] + [q.label for q in QUANTITIES], rows),
            Table("Pairwise verdicts", ["pair (A vs B)", "quantity", f"IQM difference A − B [{pct} CI]",
                                        f"P(A better) [{pct} CI]", "verdict"], pair_rows)]


def seed_notes(stats: SeedStatistics, reward_threshold: float, collapse_drop: float) -> list[str]:
    """Intro lines that define the seed statistics."""
    return [
        "Seed statistics, per run: final reward = mean reward/mean over the last 10% of steps; reward AUC = "
        "mean reward/mean over all steps; steps to threshold = steps until the reward's moving average over "
        f"10% of the run's steps first reaches {reward_threshold:g} (a run that never does counts as its "
        "steps + 1: censored, so the arm's value is a lower bound); collapsed = that moving average ends "
        f"≥ {collapse_drop:g} below its running best; mismatch k3 KL = mean mismatch/k3_kl (rollout engine "
        "vs learner). Lower is better for the last three.",
        f"Per arm: interquartile mean over seeds (collapse: the rate, a plain mean) with a "
        f"{stats.confidence:.0%} percentile stratified-bootstrap CI (rliable, {stats.reps} resamples, seed "
        f"{stats.seed}); pairs: IQM difference and probability of improvement (> 0.5: A better) with CIs, "
        "each arm resampled on its own. With few seeds (≤ 5) bootstrap CIs tend to cover less than their nominal level.",
    ]
