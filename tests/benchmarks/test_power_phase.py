"""benchmarks.phase_pilot.power_phase: the exact signed-rank p is the analysis's, the simulated outcomes are the
committed bistable ones, power rises with the effect and counts only the claimed direction, and the Fisher
numbers the page quotes come from the saved metrics."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from analysis.phase_runs import load_phase, load_runs
from analysis.phase_stats import arms
from analysis.stats import wilcoxon_p
from benchmarks.phase_pilot import power_phase as pp

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def by():
    return arms(load_phase(load_runs(ROOT / "reports" / "phase" / "metrics.jsonl.gz")))


def test_the_vectorised_exact_p_is_the_analysis_wilcoxon():
    rng = np.random.default_rng(0)
    d = np.round(rng.normal(size=(12, 10)), 1)  # rounded: ties and zeros, as resampled outcomes have
    d[0] = 0.0
    d[1, :4] = 0.0
    got = pp.wilcoxon_exact_p(d)
    want = [wilcoxon_p(row) for row in d]
    np.testing.assert_allclose(got, want, atol=1e-12)


def test_the_pools_are_the_bistable_outcomes(by):
    pl = pp.pools(by)
    assert (pl["stalled"][:, 0] < pp.STALL).all() and (pl["grpo-none"][:, 0] >= pp.STALL).all()
    assert len(pl["stalled"]) + len(pl["grpo-none"]) == 60  # GRPO's six dial arms, 10 seeds each
    assert len(pl["p0"]) == 10 and len(pl["pos"]) == 10
    runs = pp.draw(np.random.default_rng(0), pl["grpo-none"], pl["stalled"], 1.0, (50,))
    assert (runs[:, 0] < pp.STALL).all()  # q = 1: every run drawn from the stalled pool, whole


def test_power_rises_with_the_effect_and_counts_one_direction(by):
    pl = pp.pools(by)
    g, s = pl["grpo-none"], pl["stalled"]
    rng = lambda: np.random.default_rng(1)  # noqa: E731
    none = pp.power_paired(rng(), 400, g, s, 0.1, g, s, 0.1, "final_reward", claim="lower")
    big = pp.power_paired(rng(), 400, g, s, 0.9, g, s, 0.1, "final_reward", claim="lower")
    wrong = pp.power_paired(rng(), 400, g, s, 0.9, g, s, 0.1, "final_reward", claim="higher")
    assert none[0] < 0.1 and big[0] > 0.8 and big[1] <= big[0]
    assert wrong == (0.0, 0.0)  # decided, but the other way: not power


def test_the_fisher_numbers_the_page_quotes(by):
    (line,) = pp.fisher_lines(by)
    assert "11/30 vs 0/10: p 0.038" in line and "11/30 vs 1/10: p 0.231" in line and "(1005, 0.773" in line


def test_3s_n4_arms_are_experiment_3s_p0_runs_again():
    lines = pp.rerun_lines(ROOT / "reports" / "phase" / "metrics.jsonl.gz",
                           ROOT / "reports" / "phase_staleness" / "metrics.jsonl.gz")
    same = [line for line in lines if "identical to" in line]
    assert len(lines) == 15 and len(same) == 10  # GRPO's and GSPO's 5 seeds each; GRPO+R2 was not in experiment 3
    assert all(line.startswith(("grpo-none-", "gspo-none-")) for line in same)
