"""Seeds for experiment 4 (the inverted U, docs/paper_claims.md): the power of its two pre-registered tests
(11: GRPO's mean final reward over the middle doses p = 5, 10, 20% vs p = 0; 12: the same vs p = 40%; paired
Wilcoxon, Holm over the two, both must be decided with the middle lower) at n seeds, simulated from experiment 3's
per-seed differences (its seeds 1000-1009; those runs are never reused by experiment 4).

Three scenarios, 2,000 simulations per n each: "as observed" resamples experiment 3's ten per-seed difference pairs
(mid − p0, mid − p40) with replacement: the post-hoc estimate, likely inflated (the grouping was chosen after seeing
the data); "3/4" and "1/2 of the effect" keep each resampled seed's pair with probability 3/4 or 1/2 and otherwise
give that seed no effect (differences drawn from N(0, 0.003), the spread of experiment 3's near-zero differences).
A simulation counts when both tests are decided and both differences' interquartile means are below 0. The Wilcoxon p here
is scipy's normal approximation, vectorised over the simulations (the analysis uses a 9,999-draw permutation null:
the same test; the approximation is close at these n).

    python -m benchmarks.phase_pilot.power_middle [reports/phase/metrics.jsonl.gz]
"""

from __future__ import annotations

import sys

import numpy as np
from scipy.stats import trim_mean, wilcoxon

from analysis.phase_runs import load_phase, load_runs
from analysis.phase_stats import GRPO, ZERO_DOSE, arms

MIDDLE, TOP = ("p5", "p10", "p20"), "p40"
SEEDS = (10, 15, 20, 25, 30, 40)
KEEP = (1.0, 0.75, 0.5)
SIMS = 2000
NULL_SD = 0.003


def per_seed_differences(source: str) -> np.ndarray:
    """(num_seeds, 2): per seed, mean final reward over MIDDLE minus p0's, and minus the top dose's."""
    grpo = arms(load_phase(load_runs(source)))[GRPO]
    seeds = sorted(set.intersection(*(set(grpo[d]) for d in (ZERO_DOSE, TOP, *MIDDLE))))
    f = lambda d, s: grpo[d][s].scores["final_reward"]  # noqa: E731
    mid = np.asarray([np.mean([f(d, s) for d in MIDDLE]) for s in seeds])
    return np.stack([mid - [f(ZERO_DOSE, s) for s in seeds], mid - [f(TOP, s) for s in seeds]], axis=1)


def power(diffs: np.ndarray, n: int, *, keep: float, rng: np.random.Generator, alpha: float = 0.05) -> float:
    d = diffs[rng.integers(0, len(diffs), (SIMS, n))]  # (SIMS, n, 2)
    if keep < 1:
        off = rng.random((SIMS, n)) >= keep
        d[off] = rng.normal(0.0, NULL_SD, (int(off.sum()), 2))
    p = np.stack([wilcoxon(d[:, :, j], axis=1, method="approx", zero_method="zsplit").pvalue for j in range(2)], 1)
    p = np.nan_to_num(p, nan=1.0)
    lo, hi = p.min(axis=1), p.max(axis=1)
    lower = np.all(trim_mean(d, 0.25, axis=1) < 0, axis=1)  # both differences point the claimed way (IQM)
    return float(np.mean((lo <= alpha / 2) & (hi <= alpha) & lower))  # Holm over two


def main(argv: list[str]) -> int:
    source = argv[0] if argv else "reports/phase/metrics.jsonl.gz"
    diffs = per_seed_differences(source)
    print(f"experiment 3, {len(diffs)} seeds: mid − p0 mean {diffs[:, 0].mean():+.3f} (SD {diffs[:, 0].std(ddof=1):.3f}), "
          f"mid − p40 mean {diffs[:, 1].mean():+.3f} (SD {diffs[:, 1].std(ddof=1):.3f})")
    print("| seeds per arm | power, as observed | power, 3/4 of the effect | power, 1/2 of the effect |")
    print("|---|---|---|---|")
    for n in SEEDS:
        cells = [power(diffs, n, keep=k, rng=np.random.default_rng([n, int(100 * k)])) for k in KEEP]
        print(f"| {n} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
