"""Seeds for experiment 5 (the mechanism matrix, docs/paper_claims.md): the power of its pre-registered primary
family (PC, T1-T6 of `analysis.mechanism_tests`: per seed an exponent, across seeds a two-sided one-sample t-test,
Holm over the family at alpha 0.05) at n seeds, simulated from the pilot's per-seed endpoints
(reports/mechanism_pilot: seeds 900-903 on a reduced grid, never reused by experiment 5).

Three scenarios, SIMS simulations per n each; a simulated test counts when Holm decides it with the claimed sign (> 0):
- "as observed": the pilot's per-seed endpoint vectors resampled jointly, with replacement (their correlation
  kept): the pilot's own effects and spread, on the pilot's grid; a decision of either sign counts (`AS_OBSERVED`);
- "SESOI, pilot's grid": independent normals, mean each endpoint's smallest effect of interest (`Endpoint.sesoi`),
  SD the pilot's at its 80% upper confidence limit (chi-square, 3 df: 1.73x);
- "SESOI, experiment 5's grid": the same, with the SD projected onto experiment 5's grid (`projected_sd`): the
  pilot's per-seed spread split into the seeds' own heterogeneity and the cells' fitting noise, the latter scaled
  by the design (more lengths, depths and doses, over a wider range, fit the slope more tightly); both parts at
  their 80% upper confidence limits. The design's n is the smallest whose power here is >= 0.8 on every primary
  test but those of `AS_OBSERVED`, whose power as observed is >= 0.8.

    python -m benchmarks.phase_pilot.power_mechanism [reports/mechanism_pilot/mechanism.jsonl.gz] [--as-observed T1]

Experiment 5R (docs/paper_claims.md) takes experiment 5's rows as its pilot, on experiment 5's own grid, with every
test powered at its SESOI (`--as-observed ""`: experiment 5's T1, -0.11, lies inside the SESOI, unlike the pilot's):

    python -m benchmarks.phase_pilot.power_mechanism reports/mechanism_exp5/mechanism.jsonl.gz --as-observed ""
"""

from __future__ import annotations

import math
import sys

import numpy as np
from scipy import stats
from statsmodels.stats.multitest import multipletests

from analysis.mechanism_tests import ALPHA, ENDPOINTS, _cells, _fit_rows, _formula, _frame, load_rows, per_seed

SEEDS = (4, 6, 8, 10, 12, 16, 20, 24)
SIMS = 2000
SD_UPPER_LEVEL = 0.8
GRID = {"length": (16, 32, 64, 128), "depth": (2, 4, 8), "dose": (0.0, 0.1, 0.4), "k": tuple(range(1, 16))}
"""Experiment 5's grid."""
CPU_S_PER_SEED = 900
"""Experiment 5's CPU seconds per seed (36 settings, N = 16, 7 methods): the first run's 692 s for 36 settings and 5
methods (reports/mechanism/, docs/mechanism.md) x 1.3 for the two unclipped methods."""


def pilot_endpoints(source: str) -> tuple[list[str], np.ndarray]:
    """(the primary endpoints' ids, [pilot seeds, endpoints] of their per-seed values)."""
    ids = [e.id for e in ENDPOINTS if e.primary]
    values = per_seed(load_rows(source), [e for e in ENDPOINTS if e.primary])
    seeds = sorted(set.intersection(*(set(s for s, v in values[i].items() if np.isfinite(v)) for i in ids)))
    return ids, np.asarray([[values[i][s] for i in ids] for s in seeds])


def _upper(df: int) -> float:
    """The factor of a variance's 80% upper confidence limit with `df` degrees of freedom (chi-square)."""
    return df / stats.chi2.ppf(1 - SD_UPPER_LEVEL, df)


def _cell_fit(g, e):
    """The OLS fit (statsmodels) of one seed's cell means for endpoint `e` (a difference: of the two methods' logs)."""
    import statsmodels.formula.api as smf

    d = _cells(_fit_rows(g, e, e.method), e)
    if e.minus is not None:
        keys = ["k"] if e.against == "k" else ["length", "depth", "dose"]
        b = _cells(_fit_rows(g, e, e.minus), e).rename(columns={e.metric: "minus"})
        d = d.merge(b, on=keys)
        d[e.metric] = np.exp(np.log(d[e.metric]) - np.log(d["minus"]))  # the fit's log is the difference of logs
    return smf.ols(_formula(d, e), data=d).fit()


def _design_factor(e, cells) -> float:
    """[(X'X)^-1] at the slope for the cells `cells` (a DataFrame of the axes) under the endpoint's formula."""
    import statsmodels.formula.api as smf

    d = cells.assign(**{e.metric: 1.0 + np.arange(len(cells))})
    res = smf.ols(_formula(d, e), data=d).fit()
    name = f"np.log({e.against})"
    return float(res.normalized_cov_params.loc[name, name])


def projected_sd(rows: list[dict], e) -> tuple[float, float]:
    """(the pilot's per-seed SD at its 80% upper limit, the SD projected onto experiment 5's grid at its upper limit).
    Var(per-seed exponent) = tau^2 (the seeds' own spread) + sigma^2 c, c the design factor of the slope and sigma^2
    the cells' residual variance (pooled over the pilot's seeds); tau^2 = the pilot's variance at its upper limit
    minus sigma^2 c_pilot (>= 0). For an exponent on k the cells are the same k in both grids: no projection."""
    import pandas as pd

    df = _frame(rows)
    fits = [_cell_fit(g, e) for _, g in df.groupby("seed", sort=True)]
    name = f"np.log({e.against})"
    b = np.asarray([f.params[name] for f in fits])
    var_u = b.var(ddof=1) * _upper(len(b) - 1)
    if e.against == "k":
        return math.sqrt(var_u), math.sqrt(var_u)
    ssr, dof = sum(f.ssr for f in fits), sum(f.df_resid for f in fits)
    sigma2 = ssr / dof if dof > 0 else 0.0
    c_pilot = float(np.mean([f.normalized_cov_params.loc[name, name] for f in fits]))
    tau2 = max(0.0, var_u - sigma2 * c_pilot)
    doses = [p for p in GRID["dose"] if p > 0] if e.against == "dose" else GRID["dose"]
    cells = pd.DataFrame([{"length": L, "depth": D, "dose": p} for L in GRID["length"] for D in GRID["depth"]
                          for p in doses])
    sigma2_u = sigma2 * _upper(int(dof)) if dof > 0 else 0.0
    return math.sqrt(var_u), math.sqrt(tau2 + sigma2_u * _design_factor(e, cells))


def decided(d: np.ndarray, *, either: bool = False) -> np.ndarray:
    """[sims, tests] bool: Holm decides the test with a positive mean (`either`: with either sign); `d` is
    [sims, n, tests]."""
    p = stats.ttest_1samp(d, 0.0, axis=1).pvalue
    p = np.nan_to_num(p, nan=1.0)
    return (holm_rows(p) < ALPHA) & ((d.mean(axis=1) > 0) | either)


def holm_rows(p: np.ndarray) -> np.ndarray:
    """Holm-adjusted p-values of each row of `p` [sims, tests], vectorised (statsmodels' `multipletests(method=
    'holm')` row by row gives the same numbers, ~1,000x slower: checked by the test)."""
    m = p.shape[1]
    order = np.argsort(p, axis=1, kind="stable")
    ranked = np.take_along_axis(p, order, axis=1) * (m - np.arange(m))
    adj = np.minimum(np.maximum.accumulate(ranked, axis=1), 1.0)
    out = np.empty_like(adj)
    np.put_along_axis(out, order, adj, axis=1)
    return out


def simulate(pilot: np.ndarray, n: int, scenario: str, rng: np.random.Generator, *, sesoi=None, sd=None) -> np.ndarray:
    """[tests] power at n seeds in `scenario` (module docstring): resampled pilot vectors, or normals(sesoi, sd)."""
    if scenario == "as observed":
        d = pilot[rng.integers(0, len(pilot), (SIMS, n))]
    else:
        d = rng.normal(sesoi, sd, (SIMS, n, len(sesoi)))
    return decided(d, either=scenario == "as observed").mean(axis=0)


SCENARIOS = ("as observed", "SESOI, pilot's grid", "SESOI, experiment 5's grid")
AS_OBSERVED = ("T1",)
"""Tests powered for a decision (either sign) at the pilot's own effect, not at their SESOI: T1, whose pilot exponent
(-1.05, SD 0.41) is far from 0 on the side opposite the claim, and which at +0.25 would need ~50 seeds."""


def main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m benchmarks.phase_pilot.power_mechanism",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("source", nargs="?", default="reports/mechanism_pilot/mechanism.jsonl.gz",
                    help="the pilot's rows")
    ap.add_argument("--as-observed", default=",".join(AS_OBSERVED), metavar="IDS",
                    help="comma-separated tests powered for a decision at the pilot's own effect (either sign) instead "
                         f"of at their SESOI (default {','.join(AS_OBSERVED)}; \"\" for none)")
    args = ap.parse_args(argv)
    source = args.source
    as_observed = tuple(x for x in args.as_observed.split(",") if x)
    known = [e.id for e in ENDPOINTS if e.primary]
    if any(x not in known for x in as_observed):
        ap.error(f"--as-observed={args.as_observed!r}: the primary tests are {', '.join(known)}")
    rows = load_rows(source)
    primary = [e for e in ENDPOINTS if e.primary]
    ids, pilot = pilot_endpoints(source)
    sesoi = np.asarray([e.sesoi for e in primary])
    sds = [projected_sd(rows, e) for e in primary]
    print(f"pilot {source}: {len(pilot)} seeds")
    print("| endpoint | pilot mean | pilot SD | SESOI | SD at 80% upper limit, pilot's grid | projected, "
          "experiment 5's grid |")
    print("|---|---|---|---|---|---|")
    for j, e in enumerate(primary):
        print(f"| {e.id} | {pilot[:, j].mean():+.3f} | {pilot[:, j].std(ddof=1):.3f} | {e.sesoi:g} | {sds[j][0]:.3f} | "
              f"{sds[j][1]:.3f} |")
    chosen, observed = None, {}
    for k, scenario in enumerate(SCENARIOS):
        sd = np.asarray([x[min(k, 2) - 1] for x in sds]) if k else None
        sign = "either sign" if k == 0 else "claimed sign"
        print(f"\npower, {scenario} (Holm over {len(ids)}, alpha {ALPHA}, {sign}; {SIMS} simulations per n)")
        print("| seeds | " + " | ".join(ids) + " | CPU-hours |")
        print("|---" * (len(ids) + 2) + "|")
        for n in SEEDS:
            pw = simulate(pilot, n, scenario, np.random.default_rng([n, k]), sesoi=sesoi, sd=sd)
            print(f"| {n} | " + " | ".join(f"{x:.2f}" for x in pw) + f" | {n * CPU_S_PER_SEED / 3600:.1f} |")
            if k == 0:
                observed[n] = pw
            target = np.asarray([observed[n][j] if i in as_observed else pw[j] for j, i in enumerate(ids)])
            if k == 2 and chosen is None and target.min() >= 0.8:
                chosen = n
    if chosen is None:
        print(f"\nno n up to {SEEDS[-1]} gives power >= 0.8 on every primary test at its SESOI (experiment 5's grid)")
    else:
        print(f"\nchosen: {chosen} seeds (the smallest n with power >= 0.8 on every primary test: at its SESOI on "
              f"experiment 5's grid" + (f", {', '.join(as_observed)} as observed" if as_observed else "")
              + f"); {chosen * CPU_S_PER_SEED / 3600:.1f} CPU-hours")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
