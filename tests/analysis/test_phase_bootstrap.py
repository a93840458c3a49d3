"""Issue 60, mutant 3: the shared bootstrap of the phase page (`analysis.phase_stats.shared_boot_seeds`) resamples
seeds WITH replacement. Drawn without replacement, every row is a permutation of the seeds, every resample has
the same mean, and the CI of x* collapses to a point."""

from __future__ import annotations

import math

import numpy as np

from analysis.phase import fits
from analysis.phase_runs import PhaseRun
from analysis.phase_stats import arms, shared_boot_seeds

SEEDS = range(6)
X = {"p0": 0.0, "p5": 0.05, "p20": 0.2, "p80": 0.8}
MEAN_DROP = {"p0": 0.0, "p5": -0.02, "p20": -0.15, "p80": -0.4}


def _run(method: str, dose: str, seed: int, final: float) -> PhaseRun:
    scores = {"final_reward": final, "layer_disagree": X[dose]}
    return PhaseRun(f"{method}-{dose}-s{seed}", method, dose, seed, scores, 40.0, False, 40.0, False)


def _matrix() -> list[PhaseRun]:
    """GRPO's drop differs from seed to seed (±0.06 around the mean at every dose): x* is reached, with spread."""
    out = []
    for seed in SEEDS:
        spread = 0.024 * (seed - 2.5)
        for dose, drop in MEAN_DROP.items():
            out.append(_run("grpo-none", dose, seed, 0.9 + (drop + spread * (dose != "p0"))))
    return out


def test_bootstrap_rows_resample_with_replacement():
    by = arms(_matrix())
    rows = shared_boot_seeds(by, reps=400, seed=0)
    assert rows.shape == (400, len(SEEDS)) and set(np.unique(rows)) <= set(SEEDS)
    with_repeats = np.mean([len(set(r.tolist())) < len(r) for r in rows])
    n = len(SEEDS)
    assert with_repeats > 0.9, with_repeats  # expected 1 - n!/n^n = 0.985; a permutation never repeats
    assert abs(with_repeats - (1 - math.factorial(n) / n ** n)) < 0.03


def test_a_reached_critical_mismatch_has_a_ci_of_positive_width():
    fit = fits(arms(_matrix()), reps=300, seed=0)["grpo-none"]
    assert fit.critical.kind == "interpolated"
    lo, hi = fit.ci_log10
    assert math.isfinite(lo) and math.isfinite(hi) and lo < hi
    assert 10 ** lo <= fit.critical.value <= 10 ** hi
