"""Seeds for experiment 5 (the mechanism matrix, docs/paper_claims.md): the power of its pre-registered primary
family (PC, T1-T6 of `analysis.mechanism_tests`: per seed an exponent, across seeds a two-sided one-sample t-test,
Holm over the family at alpha 0.05) at n seeds, simulated from the pilot's per-seed endpoints
(reports/mechanism_pilot: seeds 900-903, never reused by experiment 5).

Three scenarios, SIMS simulations per n each; a simulated test counts when Holm decides it with the claimed sign (> 0):
- "as observed": the pilot's per-seed endpoint vectors resampled jointly, with replacement (their correlation kept):
  the pilot's own effects, from 4 seeds;
- "SESOI, resampled": the same vectors, each endpoint centred on 0 and shifted to the smallest effect of interest
  (an exponent of +`SESOI`: +7% per doubling of the axis);
- "SESOI, conservative": independent normals with mean `SESOI` and the pilot's SD at its 80% upper confidence limit
  (chi-square, 3 df: 1.73x the SD). The design's n is the smallest whose power here is >= 0.8 on every primary test.
The pilot's grid is smaller than experiment 5's (lengths 16-32, depths 2-4, doses 0.1-0.4; experiment 5: 16-128, 2-8,
0-0.4), so its per-seed exponents carry more fitting noise: the SDs, and so the seeds, are if anything overstated.

    python -m benchmarks.phase_pilot.power_mechanism [reports/mechanism_pilot/mechanism.jsonl.gz]
"""

from __future__ import annotations

import sys

import numpy as np
from scipy import stats
from statsmodels.stats.multitest import multipletests

from analysis.mechanism_tests import ALPHA, ENDPOINTS, load_rows, per_seed

SEEDS = (4, 6, 8, 10, 12, 16, 20)
SIMS = 2000
SESOI = 0.1
SD_UPPER_LEVEL = 0.8
CPU_S_PER_SEED = 900
"""Experiment 5's CPU seconds per seed (36 settings, N = 16, 7 methods): the first run's 692 s for 36 settings and 5
methods (reports/mechanism/, docs/mechanism.md) x 1.3 for the two unclipped methods."""


def pilot_endpoints(source: str) -> tuple[list[str], np.ndarray]:
    """(the primary endpoints' ids, [pilot seeds, endpoints] of their per-seed values)."""
    ids = [e.id for e in ENDPOINTS if e.primary]
    values = per_seed(load_rows(source), [e for e in ENDPOINTS if e.primary])
    seeds = sorted(set.intersection(*(set(s for s, v in values[i].items() if np.isfinite(v)) for i in ids)))
    return ids, np.asarray([[values[i][s] for i in ids] for s in seeds])


def decided(d: np.ndarray) -> np.ndarray:
    """[sims, tests] bool: Holm (statsmodels) decides the test with a positive mean; `d` is [sims, n, tests]."""
    p = stats.ttest_1samp(d, 0.0, axis=1).pvalue
    p = np.nan_to_num(p, nan=1.0)
    adj = np.stack([multipletests(row, alpha=ALPHA, method="holm")[1] for row in p])
    return (adj < ALPHA) & (d.mean(axis=1) > 0)


def simulate(pilot: np.ndarray, n: int, scenario: str, rng: np.random.Generator) -> np.ndarray:
    """[tests] power at n seeds in `scenario` (module docstring)."""
    if scenario == "as observed":
        d = pilot[rng.integers(0, len(pilot), (SIMS, n))]
    elif scenario == "SESOI, resampled":
        d = (pilot - pilot.mean(axis=0) + SESOI)[rng.integers(0, len(pilot), (SIMS, n))]
    else:
        df = len(pilot) - 1
        sd = pilot.std(axis=0, ddof=1) * np.sqrt(df / stats.chi2.ppf(1 - SD_UPPER_LEVEL, df))
        d = rng.normal(SESOI, sd, (SIMS, n, pilot.shape[1]))
    return decided(d).mean(axis=0)


SCENARIOS = ("as observed", "SESOI, resampled", "SESOI, conservative")


def main(argv: list[str]) -> int:
    source = argv[0] if argv else "reports/mechanism_pilot/mechanism.jsonl.gz"
    ids, pilot = pilot_endpoints(source)
    print(f"pilot {source}: {len(pilot)} seeds")
    print("| endpoint | pilot mean | pilot SD | SD, 80% upper limit |")
    print("|---|---|---|---|")
    df = len(pilot) - 1
    upper = np.sqrt(df / stats.chi2.ppf(1 - SD_UPPER_LEVEL, df))
    for j, i in enumerate(ids):
        sd = pilot[:, j].std(ddof=1)
        print(f"| {i} | {pilot[:, j].mean():+.3f} | {sd:.3f} | {sd * upper:.3f} |")
    chosen = None
    for scenario in SCENARIOS:
        print(f"\npower, {scenario} (Holm over {len(ids)}, alpha {ALPHA}, claimed sign; {SIMS} simulations per n)")
        print("| seeds | " + " | ".join(ids) + " | CPU-hours |")
        print("|---" * (len(ids) + 2) + "|")
        for n in SEEDS:
            pw = simulate(pilot, n, scenario, np.random.default_rng([n, SCENARIOS.index(scenario)]))
            print(f"| {n} | " + " | ".join(f"{x:.2f}" for x in pw) + f" | {n * CPU_S_PER_SEED / 3600:.1f} |")
            if scenario == SCENARIOS[-1] and chosen is None and pw.min() >= 0.8:
                chosen = n
    if chosen is None:
        print(f"\nno n up to {SEEDS[-1]} gives power >= 0.8 on every primary test at an exponent of {SESOI} "
              "(conservative SD)")
    else:
        print(f"\nchosen: {chosen} seeds (the smallest n with power >= 0.8 on every primary test, conservative "
              f"scenario); {chosen * CPU_S_PER_SEED / 3600:.1f} CPU-hours")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
