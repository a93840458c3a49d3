"""What experiment 3's design could detect (issue 58, docs/paper_claims.md): the power of each of its nine
pre-registered tests at its 10 seeds per arm, simulated from the committed per-run outcomes, and the smallest
effect each reaches with 80% power; plus the numbers the page's corrections quote (the exploratory Fisher test
with seed 1005 at p = 0 counted either way, the coverage of a percentile bootstrap at 3-10 seeds, GSPO's slower
learning and experts changed per update at p = 0).

The outcome model is the one the runs show: bistable. A run either solves the task (final reward ~0.998) or stalls
on a ~0.77 plateau (final reward < 0.9; entropy collapsed). A simulated run draws a whole observed run (its final
reward, reward AUC and time to entropy collapse together) from the stalled pool with probability q and from the
solved pool otherwise:
- stalled pool: experiment 3's GRPO (no replay, no TIS) dial runs with final reward < 0.9, all doses;
- solved pool: the arm's method's own dial runs with final reward >= 0.9 (GRPO's for GRPO's arms and the
  positive control's comparator), so GSPO keeps its own slightly lower solved level (0.993 vs 0.998);
- q at zero drift: GRPO's observed stall rate at p = 0 (1/10); the effect Δ is a rise of the failure rate:
  test 1-3 p40 at q0 + Δ vs p0 at q0; test 4 six doses at q0 + Δ·rank/5; tests 5-7 GRPO at q0 + Δ vs the fix at
  q0 (a fix that removes the whole rise); test 9 R3 at q0 + Δ vs GRPO at q0 (any difference, either way);
  test 8 at the observed effect (the positive control's own runs resampled against p0's).
Seeds of a pair are drawn independently (the arms of one seed diverge within the first steps: pairing buys little;
experiment 3's GRPO+R3 at p = 0, a float-level perturbation of GRPO at p = 0, failed 2/10 with other seeds).
A simulation counts when the test's p is at or below the level and the estimate points the claimed way (test 9:
either way). Levels: α = 0.05 alone, and α/9 = 0.0056, Holm's first step in the family of nine (the least any test
needs when it is the only effect in the family). The Wilcoxon p is the exact signed-rank permutation p (all 2^n sign
patterns, zeros dropped, two-sided: the analysis's `analysis.stats.wilcoxon_p` at these n, vectorised here), the
log-rank p lifelines', the trend test statsmodels OLS with seed fixed effects. Seeded: every cell its own stream.

    python -m benchmarks.phase_pilot.power_phase [reports/phase/metrics.jsonl.gz] [--sims 2000]   # 4-7 min here
    python -m benchmarks.phase_pilot.power_phase --no-power       # all but the power table, in seconds
"""

from __future__ import annotations

import argparse
import itertools
import sys

import numpy as np
from scipy.stats import fisher_exact, rankdata, trim_mean

from analysis.phase_runs import load_phase, load_runs
from analysis.phase_stats import GRPO, POSITIVE, ZERO_DOSE, DIAL_DOSE, arms

SEEDS = 10
STALL = 0.9
"""Final reward below this: a stalled run (the ~0.77 plateau; every solved run ends above 0.97)."""
ALPHA, FAMILY = 0.05, 9
DELTAS = tuple(round(0.1 * i, 1) for i in range(10))
FIELDS = ("final_reward", "reward_auc", "collapse_step", "collapsed")


def _pool(runs) -> np.ndarray:
    return np.asarray([[r.scores["final_reward"], r.scores["reward_auc"], r.collapse_step, float(r.collapsed)]
                       for r in runs], np.float64).reshape(-1, len(FIELDS))


def pools(by) -> dict[str, np.ndarray]:
    """{'stalled': GRPO's stalled dial runs, method: that method's solved dial runs, 'pos', 'p0'} as [runs, 4]."""
    dial = lambda m: [r for d, arm in by[m].items() if DIAL_DOSE.match(d) for r in arm.values()]  # noqa: E731
    out = {"stalled": _pool([r for r in dial(GRPO) if r.scores["final_reward"] < STALL])}
    for m in by:
        out[m] = _pool([r for r in dial(m) if r.scores["final_reward"] >= STALL])
    out["pos"] = _pool(by[GRPO][POSITIVE].values())
    out["p0"] = _pool(by[GRPO][ZERO_DOSE].values())
    return out


def draw(rng, solved: np.ndarray, stalled: np.ndarray, q, shape) -> np.ndarray:
    """[*shape, 4] runs: stalled with probability q (broadcast over shape), else solved."""
    q = np.broadcast_to(np.asarray(q, np.float64), shape)
    s = solved[rng.integers(0, len(solved), shape)]
    f = stalled[rng.integers(0, len(stalled), shape)]
    return np.where((rng.random(shape) < q)[..., None], f, s)


_SIGNS = {}


def wilcoxon_exact_p(d: np.ndarray) -> np.ndarray:
    """Per row of d [sims, n], the two-sided exact signed-rank p: W+ against all 2^n sign patterns (zeros dropped,
    ties mid-ranked), as scipy's permutation null enumerates it; 1 when every difference is 0."""
    n = d.shape[1]
    if n not in _SIGNS:
        _SIGNS[n] = np.asarray(list(itertools.product([0.0, 1.0], repeat=n)))  # [2^n, n]
    signs = _SIGNS[n]
    a = np.abs(d)
    ranks = rankdata(np.where(a == 0, np.nan, a), axis=1, nan_policy="omit")
    ranks = np.nan_to_num(ranks, nan=0.0)
    obs = (ranks * (d > 0)).sum(axis=1)
    null = ranks @ signs.T  # [sims, 2^n]
    eps = 1e-9
    ge, le = (null >= obs[:, None] - eps).mean(axis=1), (null <= obs[:, None] + eps).mean(axis=1)
    p = np.minimum(1.0, 2 * np.minimum(ge, le))
    return np.where((a == 0).all(axis=1), 1.0, p)


def logrank_p(a: np.ndarray, b: np.ndarray) -> float:
    from lifelines.statistics import logrank_test

    if not (a[:, 3].any() or b[:, 3].any()):
        return 1.0
    return float(logrank_test(a[:, 2], b[:, 2], a[:, 3], b[:, 3]).p_value)


def trend_p(y: np.ndarray, rank: np.ndarray, seeds: np.ndarray) -> tuple[float, float]:
    import statsmodels.api as sm

    dummies = (seeds[:, None] == np.unique(seeds)[None, 1:]).astype(float)
    x = np.column_stack([np.ones_like(y), rank, dummies])
    res = sm.OLS(y, x).fit()
    return float(res.params[1]), float(res.pvalues[1])


def power_paired(rng, sims, a_solved, a_stalled, qa, b_solved, b_stalled, qb, field, *, claim: str):
    """(power at α, power at α/9): arm a vs arm b, paired Wilcoxon on `field`; claim 'lower', 'higher' or 'any'."""
    a = draw(rng, a_solved, a_stalled, qa, (sims, SEEDS))[..., FIELDS.index(field)]
    b = draw(rng, b_solved, b_stalled, qb, (sims, SEEDS))[..., FIELDS.index(field)]
    d = a - b
    p = wilcoxon_exact_p(d)
    est = trim_mean(d, 0.25, axis=1)
    ok = np.ones(sims, bool) if claim == "any" else (est < 0 if claim == "lower" else est > 0)
    return float(np.mean((p <= ALPHA) & ok)), float(np.mean((p <= ALPHA / FAMILY) & ok))


def power_logrank(rng, sims, solved, stalled, qa, qb):
    hits = np.zeros((sims, 2), bool)
    for i in range(sims):
        a, b = draw(rng, solved, stalled, qa, (SEEDS,)), draw(rng, solved, stalled, qb, (SEEDS,))
        p = logrank_p(a, b)
        more = a[:, 3].sum() > b[:, 3].sum()
        hits[i] = (p <= ALPHA and more, p <= ALPHA / FAMILY and more)
    return tuple(hits.mean(axis=0).tolist())


def power_trend(rng, sims, solved, stalled, q0, delta):
    rank = np.repeat(np.arange(6.0), SEEDS)
    seeds = np.tile(np.arange(SEEDS), 6)
    q = q0 + delta * rank / 5
    hits = np.zeros((sims, 2), bool)
    for i in range(sims):
        y = draw(rng, solved, stalled, q, (6 * SEEDS,))[:, 0]
        slope, p = trend_p(y, rank, seeds)
        hits[i] = (p <= ALPHA and slope < 0, p <= ALPHA / FAMILY and slope < 0)
    return tuple(hits.mean(axis=0).tolist())


def power_table(by, sims: int) -> list[str]:
    pl = pools(by)
    st_, g = pl["stalled"], pl[GRPO]
    q0 = float(np.mean(pl["p0"][:, 0] < STALL))
    cost = float(g[:, 0].mean() - st_[:, 0].mean())
    rows = {}

    def rng(test, delta):
        return np.random.default_rng([test, int(round(100 * delta))])

    for delta in DELTAS:
        qa = min(1.0, q0 + delta)
        rows.setdefault("1", []).append(power_paired(rng(1, delta), sims, g, st_, qa, g, st_, q0, "final_reward",
                                                     claim="lower"))
        rows.setdefault("2", []).append(power_paired(rng(2, delta), sims, g, st_, qa, g, st_, q0, "reward_auc",
                                                     claim="lower"))
        rows.setdefault("3", []).append(power_logrank(rng(3, delta), max(1, sims // 4), g, st_, qa, q0))
        rows.setdefault("4", []).append(power_trend(rng(4, delta), max(1, sims // 4), g, st_, q0, delta))
        for num, fix in ((5, "grpo-r3"), (6, "grpo-none+tis"), (7, "gspo-none")):
            rows.setdefault(str(num), []).append(power_paired(rng(num, delta), sims, pl[fix], st_, q0, g, st_, qa,
                                                              "final_reward", claim="higher"))
        rows.setdefault("9", []).append(power_paired(rng(9, delta), sims, pl["grpo-r3"], st_, qa, g, st_, q0,
                                                     "final_reward", claim="any"))
    names = {"1": "1. GRPO final reward, p40 vs p0 (Wilcoxon)", "2": "2. GRPO reward AUC, p40 vs p0 (Wilcoxon)",
             "3": "3. GRPO time to entropy collapse, p40 vs p0 (log-rank)",
             "4": "4. GRPO final reward vs dose rank, 6 doses (OLS, seed effects)",
             "5": "5. GRPO+R3 vs GRPO at p40 (Wilcoxon)", "6": "6. GRPO+TIS vs GRPO at p40 (Wilcoxon)",
             "7": "7. GSPO vs GRPO at p40 (Wilcoxon)", "9": "9. zero mismatch: GRPO+R3 vs GRPO at p0, any difference"}
    lines = [f"q0 (GRPO's stall rate at p = 0) = {q0:.2f}; one stall costs {cost:.3f} of final reward (mean solved "
             f"GRPO run minus mean stalled run); {SEEDS} seeds per arm, {sims} simulations per cell "
             f"({max(1, sims // 4)} for tests 3 and 4)", "",
             "| test | power at Δ = +0.1 / +0.2 / +0.4 / +0.6 failure rate, α 0.05 | the same at α/9 (Holm's first "
             "step) | smallest Δ with 80% power at α 0.05 (mean final-reward drop) | the same at α/9 |",
             "|---|---|---|---|---|"]

    def smallest(col, j):
        for delta, pw in zip(DELTAS, col):
            if pw[j] >= 0.8:
                return f"+{delta:.1f} ({-delta * cost:+.2f})"
        return f"none up to +{DELTAS[-1]:.1f}"

    for key in names:
        col = rows[key]
        pick = [DELTAS.index(x) for x in (0.1, 0.2, 0.4, 0.6)]
        lines.append(f"| {names[key]} | " + " / ".join(f"{col[i][0]:.2f}" for i in pick) + " | "
                     + " / ".join(f"{col[i][1]:.2f}" for i in pick) + f" | {smallest(col, 0)} | {smallest(col, 1)} |")
    pos = power_paired(np.random.default_rng([8, 0]), sims, pl["pos"], pl["pos"], 0.0, pl["p0"], pl["p0"], 0.0,
                       "final_reward", claim="lower")
    lines.append(f"| 8. positive control, pos vs p0, at its observed effect (its runs resampled) | {pos[0]:.2f} | "
                 f"{pos[1]:.2f} | | |")
    at0 = [rows[k][0] for k in names]
    lines += ["", "At Δ = 0 (no effect) the share decided: " + ", ".join(
        f"test {k} {a[0]:.3f} / {a[1]:.3f}" for k, a in zip(names, at0)) + " (α / α/9; directional tests count one "
        "direction)."]
    # the scenario: failures 5% -> 40% at p40
    s = power_paired(np.random.default_rng([1, 540]), sims, g, st_, 0.40, g, st_, 0.05, "final_reward", claim="lower")
    lines.append(f"Test 1 with failures 5% at p0 and 40% at p40: power {s[0]:.2f} at α 0.05, {s[1]:.2f} at α/9.")
    return lines


def fisher_lines(by) -> list[str]:
    """The exploratory pooled comparison: GRPO's failures over 5-20% flips vs p = 0, by the detector and with
    p = 0's stalled seed (final < 0.9, not flagged) counted as a failure."""
    grpo = by[GRPO]
    mid = [r for d in ("p5", "p10", "p20") for r in grpo[d].values()]
    zero = list(grpo[ZERO_DOSE].values())
    k_mid, k0 = sum(r.failed for r in mid), sum(r.failed for r in zero)
    stalled0 = [(r.seed, round(r.scores["final_reward"], 3), round(r.scores["final_entropy"], 3))
                for r in zero if not r.failed and r.scores["final_reward"] < STALL]
    p_det = fisher_exact([[k_mid, len(mid) - k_mid], [k0, len(zero) - k0]]).pvalue
    k0b = k0 + len(stalled0)
    p_alt = fisher_exact([[k_mid, len(mid) - k_mid], [k0b, len(zero) - k0b]]).pvalue
    return [f"Fisher (two-sided), GRPO failed over 5-20% vs p = 0: {k_mid}/{len(mid)} vs {k0}/{len(zero)}: p {p_det:.3f}; "
            f"with p = 0's stalled, unflagged runs {stalled0} (seed, final reward, final entropy) counted as failed, "
            f"{k_mid}/{len(mid)} vs {k0b}/{len(zero)}: p {p_alt:.3f}"]


def coverage_lines(rng_seed: int = 0, datasets: int = 1000, reps: int = 1000) -> list[str]:
    """How often a nominal 95% percentile bootstrap CI of the mean / the IQM covers the true value, at n seeds:
    normal data, and bistable data like experiment 3's (a stall, 0.77, with probability 0.3, else 0.998)."""
    from analysis.stats import iqm_rows

    rng = np.random.default_rng(rng_seed)
    out = ["| seeds | mean, normal data | IQM, normal data | mean, bistable data (30% stalls) |", "|---|---|---|---|"]
    for n in (3, 4, 5, 10):
        cells = []
        for how, kind in (("mean", "normal"), ("iqm", "normal"), ("mean", "bistable")):
            x = (rng.normal(size=(datasets, n)) if kind == "normal"
                 else np.where(rng.random((datasets, n)) < 0.3, 0.77, 0.998))
            truth = 0.0 if kind == "normal" else 0.3 * 0.77 + 0.7 * 0.998
            idx = rng.integers(0, n, (datasets, reps, n))
            res = np.take_along_axis(np.broadcast_to(x[:, None, :], idx.shape), idx, axis=2)
            stat = res.mean(axis=2) if how == "mean" else iqm_rows(res)
            lo, hi = np.percentile(stat, [2.5, 97.5], axis=1)
            cells.append(float(np.mean((lo <= truth) & (truth <= hi))))
        out.append(f"| {n} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")
    return out


def setting_lines(by) -> list[str]:
    """GSPO's slower learning at p = 0 and experts changed per update (GRPO, p = 0), from the saved metrics."""
    from analysis.stats import iqm_rows

    out = []
    for m in (GRPO, "gspo-none"):
        arm = by[m][ZERO_DOSE]
        auc = np.asarray([r.scores["reward_auc"] for r in arm.values()])
        out.append(f"{m} p0 reward AUC: IQM {iqm_rows(auc[None])[0]:.3f}, mean {auc.mean():.3f} ({len(auc)} seeds)")
    for m in (GRPO, "gspo-none"):
        arm = by[m][ZERO_DOSE]
        first = np.mean([r.scores["expert_change"] for r in arm.values()])
        every = np.mean([r.scores["expert_change_all"] for r in arm.values()])
        out.append(f"{m} p0 experts changed per step (run means, mean over seeds): first of 4 updates {first:.4f}, "
                   f"all 4 {every:.4f}")
    return out


def rerun_lines(phase_source, staleness_source) -> list[str]:
    """3S's N = 4 arms against experiment 3's p = 0 arms: per method, how many seeds' runs are the same at every
    step (reward and entropy), i.e. the same runs made again (3S's default N is experiment 3's config)."""
    from analysis.load import series

    exp3 = {r.source.name: r for r in load_runs(phase_source)}
    out = []
    for r in sorted(load_runs(staleness_source), key=lambda r: r.source.name):
        name = r.source.name
        if "-mb4-" not in name:
            continue
        twin = exp3.get(name.replace("-mb4-", "-p0-"))
        same = twin is not None and all(
            np.array_equal(series(r.records, k)[1], series(twin.records, k)[1], equal_nan=True)
            for k in ("reward/mean", "actor/entropy"))
        out.append(f"{name}: {'identical to ' + twin.source.name + ' at every step' if same else 'no identical run'}"
                   f" in experiment 3")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.phase_pilot.power_phase", description=__doc__.split("\n")[0])
    ap.add_argument("source", nargs="?", default="reports/phase/metrics.jsonl.gz")
    ap.add_argument("--staleness", default="reports/phase_staleness/metrics.jsonl.gz", help="3S's saved metrics")
    ap.add_argument("--sims", type=int, default=2000, help="simulations per cell (tests 3-4: a quarter)")
    ap.add_argument("--no-power", action="store_true", help="skip the power simulation (minutes); the rest in seconds")
    args = ap.parse_args(argv)
    if args.sims < 1:
        ap.error("--sims must be >= 1")
    by = arms(load_phase(load_runs(args.source)))
    lines = [] if args.no_power else power_table(by, args.sims) + [""]
    lines += fisher_lines(by) + [""] + coverage_lines() + [""] + setting_lines(by) + [""]
    lines += rerun_lines(args.source, args.staleness)
    for line in lines:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
