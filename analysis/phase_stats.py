"""The phase diagram's statistics (issue 47): dose–response fits, the critical mismatch per method with a
bootstrap CI, each fix's shift of it, and the pre-registered test family. Pure: `PhaseRun`s in, rows out.

- **Dose**: the realised per-layer flip rate of an arm (`routing/layer_disagree`, the median over its runs);
  `ZERO_DOSE` names the arms without drift (fp32 rollouts, dial off).
- **Drop curve** of a method: at each dose, the mean over seeds of (final reward at that dose − final reward at
  the method's own zero dose), paired by seed (the arms of one seed share the initial model and prompts).
  The fit is scipy's isotonic regression (non-increasing in the dose), so a noisy curve is read as the
  monotone one closest to it in least squares; no shape is assumed.
- **Critical mismatch** x*: the dose at which the fitted drop first reaches `REWARD_DROP` (0.1), linearly
  interpolated in log10(dose) between the two doses around the crossing; "not reached" when the fitted drop
  stays above it over every dose tested (then the answer is the largest dose tolerated); "at or below the first
  dose" when it is reached there.
- **Largest dose tolerated** (one meaning on the page, in the probe and in its gate: `tolerated_by_ci`,
  `MethodFit.largest_tolerated`, worded by `tolerated_text`): the pre-registered rule, the largest realised dose
  at which the mean paired drop's 95% bootstrap CI lies above −`REWARD_DROP`, as it does at every lower dose;
  none when the CI reaches it at the first dose (even where the point fit never reaches x*). The same for the failure rate crossing 50% (isotonic non-decreasing).
- **CI**: a cluster bootstrap over seeds (a resampled seed brings all its arms), `reps` resamples from one seeded
  stream per quantity; percentiles of log10 x* over the resamples, with the share of resamples in which x* was
  not reached (an upper bound "> largest dose" when that share exceeds 2.5%).
- **Shift** of a fix: x*_fix / x*_GRPO per resample (both from the same resampled seeds), percentile CI.
- Descriptive, per method: statsmodels OLS of final reward on log10(dose) with seed fixed effects over the
  dosed arms (slope per decade, 95% CI), and a binomial GLM (logit link) of failure on log10(dose) over the same
  runs, without seed effects (a binary outcome per seed would separate), when failures vary and do not separate.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

import numpy as np
from scipy.optimize import isotonic_regression

from analysis import stats as st
from analysis.claims_stats import ClaimTest, apply_holm
from analysis.phase_runs import PhaseRun
from moe_gspo.run import dose_names

ZERO_DOSE = "p0"
REWARD_DROP = 0.1
FAILURE_LEVEL = 0.5
GRPO = "grpo-none"
FIXES = ("grpo-r3", "grpo-none+tis", "gspo-none", "grpo-r2")
POSITIVE = "pos"
"""The positive control's dose label: a regime known to fail (no entropy bonus, lr 2e-3; experiment 2)."""


def arms(runs: Iterable[PhaseRun]) -> dict[str, dict[str, dict[int, PhaseRun]]]:
    """{method: {dose: {seed: run}}}."""
    out: dict[str, dict[str, dict[int, PhaseRun]]] = {}
    for r in runs:
        out.setdefault(r.method, {}).setdefault(r.dose, {})[r.seed] = r
    return out


def dose_x(arm: Mapping[int, PhaseRun], seeds: Iterable[int] | None = None) -> float:
    """The arm's realised dose: median over its runs of the per-layer flip rate (0 for an arm without drift)."""
    vals = [arm[s].scores["layer_disagree"] for s in (seeds if seeds is not None else arm) if s in arm]
    vals = [v for v in vals if math.isfinite(v)]
    return float(np.median(vals)) if vals else math.nan


DIAL_DOSE = dose_names.DIAL_DOSE
"""A dial dose label (`p0`, `p2.5`, `p40`, noise `s0.25`; `moe_gspo.run.dose_names`): the arms the fits and tests use. Other labels (the rollout precisions
bf16 / fp8 / w8a8, the positive control) are reference points: described, not fitted or tested."""


def ladder(method_arms: Mapping[str, Mapping[int, PhaseRun]]) -> list[str]:
    """The method's dial doses, weakest realised dose first, zero first (reference arms left out)."""
    doses = [d for d in method_arms if DIAL_DOSE.match(d)]
    return sorted(doses, key=lambda d: (d != ZERO_DOSE, dose_x(method_arms[d])))


@dataclass
class Crossing:
    value: float
    """x* (realised per-layer flips), or NaN when not reached."""
    kind: str
    """'interpolated', 'at_or_below_first' (reached at the first dosed arm) or 'not_reached'."""


def crossing(x: np.ndarray, y: np.ndarray, level: float, *, decreasing: bool) -> Crossing:
    """Where the isotonic fit of y over the doses x (x[0] = 0: the zero dose; ascending) first reaches `level`
    (y ≤ level when `decreasing`, y ≥ level otherwise), interpolated in log10(x)."""
    ok = np.isfinite(y)
    x, y = x[ok], y[ok]
    if x.size < 2:
        return Crossing(math.nan, "not_reached")
    fit = isotonic_regression(y, increasing=not decreasing).x
    hit = (fit <= level) if decreasing else (fit >= level)
    idx = np.flatnonzero(hit)
    if idx.size == 0:
        return Crossing(math.nan, "not_reached")
    i = int(idx[0])
    if i == 0 or x[i - 1] <= 0:
        return Crossing(float(x[i]), "at_or_below_first")
    lx0, lx1 = math.log10(x[i - 1]), math.log10(x[i])
    f0, f1 = fit[i - 1], fit[i]
    frac = (level - f0) / (f1 - f0) if f1 != f0 else 1.0
    return Crossing(float(10 ** (lx0 + frac * (lx1 - lx0))), "interpolated")


def _curves(method_arms, doses, seeds) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(x, mean reward drop vs the zero dose, failure rate) per dose for the (resampled) `seeds`."""
    zero = method_arms[ZERO_DOSE]
    xs, drops, fails = [], [], []
    for d in doses:
        arm = method_arms[d]
        pairs = [(arm[s].scores["final_reward"], zero[s].scores["final_reward"]) for s in seeds if s in arm and s in zero]
        xs.append(0.0 if d == ZERO_DOSE else dose_x(arm, seeds))
        drops.append(float(np.mean([a - b for a, b in pairs])) if pairs else math.nan)
        f = [float(arm[s].failed) for s in seeds if s in arm]
        fails.append(float(np.mean(f)) if f else math.nan)
    return np.asarray(xs), np.asarray(drops), np.asarray(fails)


@dataclass
class MethodFit:
    method: str
    doses: list[str]
    x: np.ndarray
    drop: np.ndarray
    fail: np.ndarray
    critical: Crossing
    critical_fail: Crossing
    ci_log10: tuple[float, float]
    """95% bootstrap CI of log10 x* over the resamples where it was reached (NaN when it never was)."""
    not_reached_share: float
    boot_log10: np.ndarray
    """log10 x* per resample (NaN where not reached), in resample order: the shifts pair them."""
    largest_tolerated: float
    """The pre-registered largest dose tolerated (`tolerated_by_ci`: the drop's 95% CI above -REWARD_DROP there and
    at every lower dose); NaN when the CI reaches it at the first dose."""


def _seed_pool(method_arms: Mapping[str, Mapping[int, PhaseRun]]) -> list[int]:
    return sorted(set(method_arms[ZERO_DOSE]))


def fit_method(method: str, method_arms: Mapping[str, Mapping[int, PhaseRun]], *, reps: int, seed: int,
               boot_seeds: np.ndarray | None = None) -> MethodFit | None:
    """The method's drop curve, critical mismatch and its bootstrap (None without a zero-dose arm and one dose
    more). `boot_seeds` [reps, n]: the resampled seed lists (shared across methods so shifts pair)."""
    if ZERO_DOSE not in method_arms:
        return None
    doses = ladder(method_arms)
    if len(doses) < 2:
        return None
    pool = _seed_pool(method_arms)
    x, drop, fail = _curves(method_arms, doses, pool)
    crit = crossing(x, drop, -REWARD_DROP, decreasing=True)
    crit_fail = crossing(x, fail, FAILURE_LEVEL, decreasing=False)
    if boot_seeds is None:
        rng = np.random.default_rng(st.stream_seed(seed, "phase", method))
        boot_seeds = rng.choice(pool, size=(reps, len(pool)), replace=True)
    boot = np.full(len(boot_seeds), math.nan)
    for i, seeds in enumerate(boot_seeds):
        bx, bd, _ = _curves(method_arms, doses, [int(s) for s in seeds])
        c = crossing(bx, bd, -REWARD_DROP, decreasing=True)
        if math.isfinite(c.value):
            boot[i] = math.log10(c.value)
    reached = boot[np.isfinite(boot)]
    ci = tuple(np.percentile(reached, [2.5, 97.5]).tolist()) if reached.size >= 2 else (math.nan, math.nan)
    tolerated = tolerated_by_ci(method_arms, reps=reps, seed=seed, method=method)[0]  # the page's rule, not the fit's
    return MethodFit(method, doses, x, drop, fail, crit, crit_fail, ci, float(np.mean(~np.isfinite(boot))), boot,
                     tolerated)


def drop_ci(arm: Mapping[int, PhaseRun], zero: Mapping[int, PhaseRun], *, reps: int, seed: int, method: str,
            dose: str) -> st.Estimate:
    """The mean paired (by seed) final-reward drop of `arm` against the method's zero-dose arm, with its 95%
    percentile bootstrap CI over the seeds both have (its own stream; the figure draws the same)."""
    diffs = [arm[s].scores["final_reward"] - zero[s].scores["final_reward"] for s in arm if s in zero]
    return st.bootstrap_ci(diffs, how="mean", reps=reps, seed=st.stream_seed(seed, "fig", method, dose))


def tolerated_by_ci(method_arms: Mapping[str, Mapping[int, PhaseRun]], *, reps: int, seed: int, method: str
                    ) -> tuple[float, list[tuple[float, st.Estimate]]]:
    """The pre-registered "largest dose tolerated" (docs/paper_claims.md, experiment 3, "What counts"): the largest
    realised dose p such that the drop's 95% CI (`drop_ci`) lies above −`REWARD_DROP` at p and at every lower dose;
    NaN when it does not at the first dose. Also (dose, drop estimate) per dosed arm, weakest first."""
    doses = [d for d in ladder(method_arms) if d != ZERO_DOSE] if ZERO_DOSE in method_arms else []
    zero = method_arms.get(ZERO_DOSE, {})
    per_dose = [(dose_x(method_arms[d]), drop_ci(method_arms[d], zero, reps=reps, seed=seed, method=method, dose=d))
                for d in doses]
    largest = math.nan
    for x, e in per_dose:
        if not (math.isfinite(e.lo) and e.lo > -REWARD_DROP):
            break
        largest = x
    return largest, per_dose


NONE_TOLERATED = "none shown (the CI reaches it at the first dose)"


def tolerated_text(largest: float) -> str:
    """The one wording of the largest dose tolerated (`tolerated_by_ci`): '2.6%', or `NONE_TOLERATED`."""
    return f"{100 * largest:.3g}%" if math.isfinite(largest) else NONE_TOLERATED


def shared_boot_seeds(by_method: Mapping[str, Mapping[str, Mapping[int, PhaseRun]]], reps: int, seed: int) -> np.ndarray:
    """Resampled seed lists over the seeds every method's zero-dose arm has (so fixes and GRPO pair)."""
    pools = [set(m[ZERO_DOSE]) for m in by_method.values() if ZERO_DOSE in m]
    pool = sorted(set.intersection(*pools)) if pools else []
    if not pool:
        return np.zeros((0, 0), np.int64)
    rng = np.random.default_rng(st.stream_seed(seed, "phase", "shared"))
    return rng.choice(pool, size=(reps, len(pool)), replace=True)


def shift(fix: MethodFit, base: MethodFit) -> tuple[float, float, float, float]:
    """(x*_fix / x*_base point, CI low, CI high, share of resamples where both were reached)."""
    point = (fix.critical.value / base.critical.value
             if math.isfinite(fix.critical.value) and math.isfinite(base.critical.value) else math.nan)
    both = np.isfinite(fix.boot_log10) & np.isfinite(base.boot_log10)
    if both.sum() < 2:
        return point, math.nan, math.nan, float(both.mean()) if both.size else 0.0
    ratio = fix.boot_log10[both] - base.boot_log10[both]
    lo, hi = np.percentile(ratio, [2.5, 97.5])
    return point, float(10 ** lo), float(10 ** hi), float(both.mean())


def ols_slope(method_arms: Mapping[str, Mapping[int, PhaseRun]]) -> tuple[float, float, float, float]:
    """Final reward on log10(realised dose) with seed fixed effects over the dosed dial arms (statsmodels OLS):
    (slope per decade, CI low, CI high, p); NaNs when fewer than two dosed arms (one arm's seeds differ in realised
    dose only by sampling noise: no slope to read) or no residual degree of freedom. Only dial arms (`DIAL_DOSE`,
    p0 left out) enter: the reference arms (bf16 / fp8 / w8a8 rollouts, the positive control) differ in more than
    the dose, as `failure_glm` and the tests already treat them."""
    import pandas as pd
    import statsmodels.formula.api as smf

    rows = [{"reward": r.scores["final_reward"], "logx": math.log10(r.scores["layer_disagree"]), "seed": str(s),
             "arm": d}
            for d, arm in method_arms.items() if DIAL_DOSE.match(d) and d != ZERO_DOSE for s, r in arm.items()
            if r.scores["layer_disagree"] > 0 and math.isfinite(r.scores["final_reward"])]
    df = pd.DataFrame(rows)
    if df.empty or df["arm"].nunique() < 2:
        return (math.nan,) * 4
    formula = "reward ~ logx + C(seed)" if df["seed"].nunique() > 1 else "reward ~ logx"
    res = smf.ols(formula, data=df).fit()
    if res.df_resid < 1:
        return (math.nan,) * 4
    lo, hi = res.conf_int().loc["logx"].tolist()
    return float(res.params["logx"]), float(lo), float(hi), float(res.pvalues["logx"])


@dataclass
class FailureFit:
    slope: float
    """Log-odds of failure per decade of realised flips (NaN when not fitted)."""
    lo: float
    hi: float
    p: float
    why_not: str = ""
    """Why no fit (empty when fitted)."""


def failure_glm(method_arms: Mapping[str, Mapping[int, PhaseRun]]) -> FailureFit:
    """statsmodels binomial GLM `failed ~ log10(x)` over the method's dosed dial arms (each run at its own realised
    per-layer flip rate x): the slope per decade with its 95% Wald CI and p; not fitted (NaNs and the reason) when
    the failures do not vary or separate perfectly by dose."""
    import warnings

    import pandas as pd
    import statsmodels.api as sm
    import statsmodels.formula.api as smf

    rows = [{"failed": float(r.failed), "logx": math.log10(r.scores["layer_disagree"])}
            for d, arm in method_arms.items() if DIAL_DOSE.match(d) and d != ZERO_DOSE for r in arm.values()
            if math.isfinite(r.scores["layer_disagree"]) and r.scores["layer_disagree"] > 0]
    df = pd.DataFrame(rows)
    nan = (math.nan,) * 4
    if df.empty or df["logx"].nunique() < 2:
        return FailureFit(*nan, why_not="fewer than two doses")
    k, n = int(df["failed"].sum()), len(df)
    if k in (0, n):
        return FailureFit(*nan, why_not=f"failures do not vary ({k}/{n})")
    failed_x, ok_x = df.loc[df["failed"] == 1, "logx"], df.loc[df["failed"] == 0, "logx"]
    if failed_x.min() > ok_x.max() or failed_x.max() < ok_x.min():
        return FailureFit(*nan, why_not=f"failures separate perfectly by dose ({k}/{n})")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # convergence chatter on near-separated data: the CI says how sure it is
        res = smf.glm("failed ~ logx", data=df, family=sm.families.Binomial()).fit()
    lo, hi = res.conf_int().loc["logx"].tolist()
    return FailureFit(float(res.params["logx"]), float(lo), float(hi), float(res.pvalues["logx"]))


# --------------------------------------------------------------------------- pre-registered tests

def _common(a: Mapping[int, PhaseRun], b: Mapping[int, PhaseRun]) -> tuple[dict, dict]:
    """Both arms on the seeds both finished (a stopped matrix: the pre-registered family on those seeds, paired);
    both whole when they share none."""
    both = a.keys() & b.keys()
    if not both:
        return dict(a), dict(b)
    return {s: a[s] for s in sorted(both)}, {s: b[s] for s in sorted(both)}


def _paired(a: Mapping[int, PhaseRun], b: Mapping[int, PhaseRun], key: str) -> tuple[dict, dict]:
    a, b = _common(a, b)
    return ({s: r.scores[key] for s, r in a.items()}, {s: r.scores[key] for s, r in b.items()})


def paired_compare(section: str, label: str, a, b, key: str, *, a_better: bool, reps: int, seed: int,
             null_claim: bool = False) -> ClaimTest:
    """Paired (by seed) Wilcoxon of `key`; `a_better`: the claim is that arm a scores higher."""
    va, vb = _paired(a, b, key)
    c = st.compare(va, vb, reps=reps, seed=st.stream_seed(seed, label, key))
    diff = c.diff
    agrees = None if not math.isfinite(diff.point) or diff.point == 0 else ((diff.point > 0) == a_better)
    return ClaimTest(section, label, "Wilcoxon signed-rank (paired by seed)" if c.paired else "Mann–Whitney U",
                     f"A − B = {st.fmt_ci(diff)} (IQM, 95% bootstrap CI)", c.p, agrees, null_claim=null_claim,
                     seeds_needed=c.seeds_needed, num_seeds=diff.num_seeds)


def _collapse_test(section: str, label: str, a, b) -> ClaimTest:
    """Log-rank on time to entropy collapse; the claim: arm a collapses earlier (or more often)."""
    a, b = _common(a, b)
    sa = st.survival([r.collapse_step for r in a.values()], [r.collapsed for r in a.values()])
    sb = st.survival([r.collapse_step for r in b.values()], [r.collapsed for r in b.values()])
    lr = st.logrank(sa, sb)
    ka, kb = sum(r.collapsed for r in a.values()), sum(r.collapsed for r in b.values())
    agrees = None if not math.isfinite(lr.observed_minus_expected) or lr.observed_minus_expected == 0 else (
        lr.observed_minus_expected > 0)
    return ClaimTest(section, label, "log-rank", f"collapsed {ka}/{len(a)} vs {kb}/{len(b)}", lr.p, agrees,
                     num_seeds=min(len(a), len(b)))


def _trend_test(grpo: Mapping[str, Mapping[int, PhaseRun]]) -> ClaimTest | None:
    import pandas as pd
    import statsmodels.formula.api as smf

    doses = ladder(grpo)
    rows = [{"reward": r.scores["final_reward"], "rank": i, "seed": str(s)}
            for i, d in enumerate(doses) for s, r in grpo[d].items()]
    df = pd.DataFrame(rows)
    if df.empty or df["rank"].nunique() < 3:
        return None
    res = smf.ols("reward ~ rank + C(seed)" if df["seed"].nunique() > 1 else "reward ~ rank", data=df).fit()
    slope, p = float(res.params["rank"]), float(res.pvalues["rank"])
    lo, hi = res.conf_int().loc["rank"].tolist()
    return ClaimTest("drift", f"{GRPO}: final reward against the dose rank ({len(doses)} doses)",
                     "OLS with seed fixed effects, t-test on the slope",
                     f"slope {slope:+.3f} per dose step [{lo:+.3f}, {hi:+.3f}]", p, None if slope == 0 else slope < 0,
                     num_seeds=df["seed"].nunique())


# Each fix's test number in experiment 3's pre-registered list (docs/paper_claims.md); GRPO+R2 at the top dose was
# not in that list: it is test 10 when a matrix has it. Tests 11 and 12 are experiment 4's (the inverted U: GRPO's
# mean final reward over the doses strictly between zero and the top one, vs zero and vs the top), kept only when
# asked for by number.
FIX_TEST_NUMBER = {"grpo-r3": 5, "grpo-none+tis": 6, "gspo-none": 7, "grpo-r2": 10}
assert set(FIX_TEST_NUMBER) == set(FIXES)
FAMILY_TESTS = tuple(range(1, 13))
DEFAULT_FAMILY = tuple(range(1, 11))
MIDDLE = "middle"


def phase_family(by_method: Mapping[str, Mapping[str, Mapping[int, PhaseRun]]], *, reps: int, seed: int,
                 only: Iterable[int] | None = None) -> list[ClaimTest]:
    """The pre-registered Holm family (docs/paper_claims.md, experiment 3), in its listed order; tests whose arms
    are missing are left out (and the page says so). `only`: keep just these tests, by their number in that list
    (1-9; 10 = GRPO+R2 vs GRPO at the top dose; 11-12 = experiment 4's middle-dose tests, never in the default
    family), before Holm's adjustment: a later experiment that pre-registered a subset of the list (3F: tests 1 and
    7; experiment 4: 11 and 12) gets its own, smaller family."""
    keep = set(DEFAULT_FAMILY if only is None else only)
    numbered = _numbered_family(by_method, reps=reps, seed=seed)
    return apply_holm([t for n, t in numbered if n in keep])


def _numbered_family(by_method: Mapping[str, Mapping[str, Mapping[int, PhaseRun]]], *, reps: int, seed: int
                     ) -> list[tuple[int, ClaimTest]]:
    tests: list[tuple[int, ClaimTest]] = []
    grpo = by_method.get(GRPO, {})
    doses = ladder(grpo) if ZERO_DOSE in grpo else []
    top = doses[-1] if len(doses) >= 2 else None
    if top is not None:
        a, b = grpo[top], grpo[ZERO_DOSE]
        tests.append((1, paired_compare("drift", f"{GRPO}: final reward, {top} vs {ZERO_DOSE}", a, b, "final_reward",
                                        a_better=False, reps=reps, seed=seed)))
        tests.append((2, paired_compare("drift", f"{GRPO}: reward AUC, {top} vs {ZERO_DOSE}", a, b, "reward_auc",
                                        a_better=False, reps=reps, seed=seed)))
        tests.append((3, _collapse_test("drift", f"{GRPO}: time to entropy collapse, {top} vs {ZERO_DOSE}", a, b)))
        trend = _trend_test(grpo)
        if trend is not None:
            tests.append((4, trend))
        for fix in FIXES:
            if top in by_method.get(fix, {}):
                tests.append((FIX_TEST_NUMBER[fix], paired_compare(
                    "fixes", f"{fix} vs {GRPO} at {top}: final reward", by_method[fix][top], a, "final_reward",
                    a_better=True, reps=reps, seed=seed)))
        middle = middle_doses_arm(grpo)
        if middle:
            label = f"{GRPO}: final reward, mean over the middle doses ({', '.join(doses[1:-1])})"
            tests.append((11, paired_compare("drift", f"{label} vs {ZERO_DOSE}", middle, b, "final_reward",
                                             a_better=False, reps=reps, seed=seed)))
            tests.append((12, paired_compare("drift", f"{label} vs {top}", middle, a, "final_reward",
                                             a_better=False, reps=reps, seed=seed)))
    if POSITIVE in grpo and ZERO_DOSE in grpo:
        tests.append((8, paired_compare("controls", f"positive control: {GRPO} {POSITIVE} vs {ZERO_DOSE}: final reward",
                                        grpo[POSITIVE], grpo[ZERO_DOSE], "final_reward", a_better=False, reps=reps,
                                        seed=seed)))
    if ZERO_DOSE in by_method.get("grpo-r3", {}) and ZERO_DOSE in grpo:
        tests.append((9, paired_compare("controls", f"zero mismatch: grpo-r3 vs {GRPO} at {ZERO_DOSE}: final reward",
                                        by_method["grpo-r3"][ZERO_DOSE], grpo[ZERO_DOSE], "final_reward",
                                        a_better=True, reps=reps, seed=seed, null_claim=True)))
    return tests


def middle_doses_arm(method_arms: Mapping[str, Mapping[int, PhaseRun]]) -> dict[int, PhaseRun]:
    """Per seed, the mean final reward over the method's doses strictly between zero and its top dose (the seeds
    that finished every one of them), as one arm named `middle`; empty without a middle dose (experiment 4's
    inverted U: is the middle worse than both ends?)."""
    doses = ladder(method_arms) if ZERO_DOSE in method_arms else []
    mids = doses[1:-1]
    if not mids:
        return {}
    seeds = set.intersection(*(set(method_arms[d]) for d in mids))
    return {s: replace(method_arms[mids[0]][s], dose=MIDDLE, name=f"{MIDDLE}-s{s}",
                       scores={"final_reward": float(np.mean([method_arms[d][s].scores["final_reward"] for d in mids]))})
            for s in sorted(seeds)}
