"""Few-seed statistics a reviewer accepts: pure functions, arrays in, numbers out.

- Every bootstrap has its own seeded stream (`stream_seed`: SHA-256 of the base seed and the
  quantity / arm / pair names), so a CI does not depend on what else is computed in the same call
  or shown on the same page.
- `bootstrap_ci`: percentile bootstrap over seeds of rliable's interquartile mean (or the mean), the
  one-task case of rliable's stratified bootstrap, vectorised (rliable's loop costs ~1 s per CI at
  10,000 resamples); `DEFAULT_REPS` = 10,000 for published tables.
- `paired_comparison` / `unpaired_comparison`: per-seed differences (arms sharing `train.seed`)
  with a bootstrap CI and a Wilcoxon signed-rank p-value; otherwise the difference of the arms'
  IQMs (each arm resampled on its own) and a Mann-Whitney U p-value (scipy, two-sided).
- `holm`: Holm's step-down adjustment over a page's tests (statsmodels `multipletests`).
- `rate`: exact Clopper-Pearson interval of k events in n runs (statsmodels `proportion_confint`,
  method "beta"), never a bootstrap: 0/8 gives 0-37 %.
- `seeds_for_power`: seeds per arm at which a two-sided test at alpha 0.05 has 80% power for the
  observed effect size (statsmodels: one-sample t-test power on paired differences, two-sample otherwise).
- `survival` / `logrank`: Kaplan-Meier time to failure (lifelines) and the log-rank test between two arms.
- `fmt_ci` / `fmt_rate`: print an estimate and its CI with the digits the CI supports.
"""

from __future__ import annotations

import hashlib
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

DEFAULT_REPS = 10_000
"""Bootstrap resamples for published tables."""
ALPHA = 0.05
POWER = 0.8
MAX_SEEDS = 1000


# --------------------------------------------------------------------------- streams and bootstrap

def stream_seed(base_seed: int, *names: object) -> int:
    """A 63-bit RNG seed from the base seed and names (quantity key, arm or pair names): SHA-256 of
    their reprs joined by NUL, so it is stable across processes (unlike Python's hash())."""
    text = "\0".join([repr(int(base_seed))] + [str(n) for n in names])
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def finite(values) -> np.ndarray:
    values = np.asarray(values, np.float64).ravel()
    return values[np.isfinite(values)]


def iqm_rows(x_RN: np.ndarray) -> np.ndarray:
    """Per row, rliable's `aggregate_iqm` (scipy's 25%-trimmed mean: int(n / 4) values cut each side)."""
    n = x_RN.shape[-1]
    cut = int(0.25 * n)
    s = np.sort(x_RN, axis=-1)
    return s[..., cut:n - cut].sum(axis=-1) / (n - 2 * cut)


def aggregate(values: np.ndarray, how: str = "iqm") -> float:
    """rliable's IQM ('iqm') or the mean ('mean') of finite values; NaN when there are none."""
    from rliable import metrics

    values = finite(values)
    if values.size == 0:
        return math.nan
    agg = metrics.aggregate_mean if how == "mean" else metrics.aggregate_iqm
    return float(agg(values[:, None]))


def _rows(x_RN: np.ndarray, how: str) -> np.ndarray:
    return x_RN.mean(axis=-1) if how == "mean" else iqm_rows(x_RN)


def _resample(values: np.ndarray, reps: int, rng: np.random.Generator) -> np.ndarray:
    return values[rng.integers(0, values.size, (reps, values.size))]


@dataclass
class Estimate:
    """A point estimate with its CI (NaN ends without one) over `num_seeds` finite values."""

    point: float
    lo: float
    hi: float
    num_seeds: int
    events: int | None = None
    """For a rate: the number of events (the CI is then Clopper-Pearson, not a bootstrap)."""


def bootstrap_ci(values, *, how: str = "iqm", reps: int = DEFAULT_REPS, seed: int = 0,
                 confidence: float = 0.95) -> Estimate:
    """IQM (or mean) of the finite values with a percentile-bootstrap CI over them, drawn from
    `np.random.default_rng(seed)` (pass a `stream_seed`). NaN ends with fewer than 2 values."""
    v = finite(values)
    point = aggregate(v, how)
    if v.size < 2:
        return Estimate(point, math.nan, math.nan, int(v.size))
    stats = _rows(_resample(v, reps, np.random.default_rng(seed)), how)
    lo, hi = np.percentile(stats, [50 * (1 - confidence), 50 * (1 + confidence)])
    return Estimate(point, float(lo), float(hi), int(v.size))


# --------------------------------------------------------------------------- tests, power, Holm

def seeds_for_power(a, b=None, *, paired: bool = True, power: float = POWER, alpha: float = ALPHA,
                    max_seeds: int = MAX_SEEDS) -> int | None:
    """Seeds per arm for `power` at two-sided `alpha` if the observed effect size is the true one.

    Paired (`b` None: `a` are the per-seed differences): Cohen's d = mean / sd (ddof 1), one-sample
    t-test power (statsmodels `TTestPower`). Unpaired: d = (mean a - mean b) / pooled sd, two-sample
    t-test power with equal arms (`TTestIndPower`). Smallest n ≥ 2 reaching the power; None when no
    effect is measured (d = 0 or undefined), `max_seeds + 1` when more than `max_seeds` would be needed."""
    from statsmodels.stats.power import TTestIndPower, TTestPower

    a = finite(a)
    if paired:
        if a.size < 2:
            return None
        m, sd = a.mean(), a.std(ddof=1)
        engine = TTestPower()
    else:
        b = finite(b)
        if a.size < 2 or b.size < 2:
            return None
        m = a.mean() - b.mean()
        sd = math.sqrt(((a.size - 1) * a.var(ddof=1) + (b.size - 1) * b.var(ddof=1)) / (a.size + b.size - 2))
        engine = TTestIndPower()
    if m == 0 or not math.isfinite(m):
        return None
    if sd == 0:
        return 2
    d = abs(m) / sd

    def pw(n: int) -> float:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return float(engine.power(effect_size=d, nobs=n, alpha=alpha, alternative="two-sided")
                         if paired else engine.power(effect_size=d, nobs1=n, alpha=alpha, ratio=1.0,
                                                      alternative="two-sided"))
    if pw(max_seeds) < power:
        return max_seeds + 1
    lo, hi = 2, max_seeds
    while lo < hi:  # power rises with n
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if pw(mid) < power else (lo, mid)
    return lo


def _permutation():
    """scipy's permutation null (exact enumeration while it has ≤ 9999 arrangements, else 9999 draws
    from a fixed stream): valid with ties and few seeds, where the normal approximation is not."""
    from scipy.stats import PermutationMethod

    return PermutationMethod(n_resamples=9999, rng=np.random.default_rng(0))


def wilcoxon_p(diffs) -> float:
    """Two-sided Wilcoxon signed-rank p of per-seed differences (scipy, permutation null; zeros dropped):
    1.0 when every difference is 0, NaN with fewer than 2 values."""
    from scipy.stats import wilcoxon

    d = finite(diffs)
    if d.size < 2:
        return math.nan
    if not np.any(d != 0):
        return 1.0
    return float(wilcoxon(d, zero_method="wilcox", alternative="two-sided", method=_permutation()).pvalue)


def mannwhitney_p(a, b) -> float:
    """Two-sided Mann-Whitney U p (scipy, permutation null); 1.0 when all values are equal, NaN with < 2
    in an arm."""
    from scipy.stats import mannwhitneyu

    a, b = finite(a), finite(b)
    if a.size < 2 or b.size < 2:
        return math.nan
    if np.all(np.concatenate([a, b]) == a[0]):
        return 1.0
    return float(mannwhitneyu(a, b, alternative="two-sided", method=_permutation()).pvalue)


@dataclass
class Difference:
    """A - B for one quantity: paired by seed or not."""

    paired: bool
    diff: Estimate
    """Paired: IQM (mean for a rate) of the per-seed differences A - B with a bootstrap CI over seeds;
    unpaired: IQM(A) - IQM(B), each arm resampled on its own."""
    p: float
    """Wilcoxon signed-rank (paired) or Mann-Whitney U (unpaired), two-sided; NaN below 2 seeds."""
    seeds_needed: int | None
    """`seeds_for_power` (80% power, two-sided 0.05)."""
    test: str


def paired_by_seed(a: dict[int, float], b: dict[int, float]) -> bool:
    """True when both arms have finite values for the same seeds (at least 2)."""
    fa = {s for s, v in a.items() if math.isfinite(v)}
    fb = {s for s, v in b.items() if math.isfinite(v)}
    return fa == fb and len(fa) >= 2


def compare(a: dict[int, float] | Sequence[float], b: dict[int, float] | Sequence[float], *, how: str = "iqm",
            reps: int = DEFAULT_REPS, seed: int = 0, confidence: float = 0.95) -> Difference:
    """A - B with a CI, a p-value and the seeds needed. `a`, `b`: {train.seed: value} (paired when the
    finite values' seeds match, `paired_by_seed`) or plain sequences (unpaired). `seed`: the stream."""
    if isinstance(a, dict) and isinstance(b, dict) and paired_by_seed(a, b):
        seeds = sorted(s for s, v in a.items() if math.isfinite(v))
        d = np.asarray([a[s] - b[s] for s in seeds])
        est = bootstrap_ci(d, how=how, reps=reps, seed=seed, confidence=confidence)
        return Difference(True, est, wilcoxon_p(d), seeds_for_power(d, paired=True), "Wilcoxon signed-rank")
    va = finite(list(a.values()) if isinstance(a, dict) else a)
    vb = finite(list(b.values()) if isinstance(b, dict) else b)
    n = min(va.size, vb.size)
    est = Estimate(aggregate(va, how) - aggregate(vb, how), math.nan, math.nan, n)
    if n >= 2:
        rng = np.random.default_rng(seed)
        sa, sb = _resample(va, reps, rng), _resample(vb, reps, rng)
        stats = _rows(sa, how) - _rows(sb, how)
        est.lo, est.hi = (float(x) for x in np.percentile(stats, [50 * (1 - confidence), 50 * (1 + confidence)]))
    return Difference(False, est, mannwhitney_p(va, vb), seeds_for_power(va, vb, paired=False), "Mann-Whitney U")


def one_sample(values, alpha: float = ALPHA) -> dict:
    """Mean, SD, two-sided one-sample t-test against 0 and its (1 - alpha) t CI over the finite `values` (scipy):
    keys n, mean, sd, p, lo, hi (nan where fewer than 2 values)."""
    from scipy import stats

    v = np.asarray([x for x in values if math.isfinite(x)], dtype=float)
    if len(v) < 2:
        return {"n": len(v), "mean": float(v.mean()) if len(v) else math.nan, "sd": math.nan, "p": math.nan,
                "lo": math.nan, "hi": math.nan}
    res = stats.ttest_1samp(v, 0.0)
    ci = res.confidence_interval(1 - alpha)
    return {"n": len(v), "mean": float(v.mean()), "sd": float(v.std(ddof=1)), "p": float(res.pvalue),
            "lo": float(ci.low), "hi": float(ci.high)}


def holm(pvalues: Sequence[float], alpha: float = ALPHA) -> list[float]:
    """Holm-adjusted p-values (statsmodels `multipletests(method="holm")`) over the finite ones; NaN stays NaN."""
    from statsmodels.stats.multitest import multipletests

    p = np.asarray(pvalues, np.float64)
    out = np.full(p.shape, np.nan)
    ok = np.isfinite(p)
    if ok.any():
        out[ok] = multipletests(p[ok], alpha=alpha, method="holm")[1]
    return out.tolist()


# --------------------------------------------------------------------------- rates and survival

def rate(events: int, n: int, confidence: float = 0.95) -> Estimate:
    """k / n with the exact Clopper-Pearson interval (statsmodels, method 'beta')."""
    from statsmodels.stats.proportion import proportion_confint

    if n == 0:
        return Estimate(math.nan, math.nan, math.nan, 0, 0)
    lo, hi = proportion_confint(events, n, alpha=1 - confidence, method="beta")
    return Estimate(events / n, float(lo), float(hi), n, int(events))


@dataclass
class Survival:
    durations: np.ndarray
    """Per run, the failure step, or the last step when censored."""
    observed: np.ndarray
    """Per run, True when it failed."""
    median: float
    """Kaplan-Meier median time to failure: the first time S(t) ≤ 0.5 (inf when it stays above)."""
    timeline: np.ndarray
    survival: np.ndarray
    """The Kaplan-Meier estimate S(t) on `timeline`."""


def survival(durations, observed) -> Survival:
    """Kaplan-Meier time to failure (lifelines' KaplanMeierFitter), censored at the run's end."""
    from lifelines import KaplanMeierFitter

    d = np.asarray(durations, np.float64)
    e = np.asarray(observed, bool)
    if d.size == 0:
        return Survival(d, e, math.nan, np.zeros(0), np.zeros(0))
    sf = KaplanMeierFitter().fit(d, e).survival_function_
    timeline, surv = sf.index.to_numpy(np.float64), sf.iloc[:, 0].to_numpy(np.float64)
    # the first time S(t) ≤ 0.5 (lifelines' own median misses an S of exactly 0.5 by rounding: 4 of 8)
    below = np.flatnonzero(surv <= 0.5 + 1e-9)
    return Survival(d, e, float(timeline[below[0]]) if below.size else math.inf, timeline, surv)


@dataclass
class LogRank:
    p: float
    """lifelines' log-rank p (two-sided); NaN when an arm is empty, 1.0 with no event in either."""
    observed_minus_expected: float
    """Failures of A minus those expected under equal hazards (> 0: A fails more / earlier)."""


def logrank(a: Survival, b: Survival) -> LogRank:
    """Log-rank test between two arms' times to failure (lifelines.statistics.logrank_test)."""
    from lifelines.statistics import logrank_test

    if a.durations.size == 0 or b.durations.size == 0:
        return LogRank(math.nan, math.nan)
    if not (a.observed.any() or b.observed.any()):
        return LogRank(1.0, 0.0)
    p = float(logrank_test(a.durations, b.durations, a.observed, b.observed).p_value)
    oe = 0.0
    for t in np.unique(np.concatenate([a.durations[a.observed], b.durations[b.observed]])):
        n_a, n_b = (a.durations >= t).sum(), (b.durations >= t).sum()
        d_a = ((a.durations == t) & a.observed).sum()
        d = d_a + ((b.durations == t) & b.observed).sum()
        oe += d_a - d * n_a / (n_a + n_b)
    return LogRank(p, float(oe))


# --------------------------------------------------------------------------- formatting

def _exp10(x: float) -> int:
    return math.floor(math.log10(abs(x)))


def fmt_at(x: float, res_exp: int) -> str:
    """x rounded to a multiple of 10**res_exp: fixed point for 1e-3 <= |x| < 1e5 (or 0), else
    scientific with the digits down to 10**res_exp."""
    if not math.isfinite(x):
        return "n/a"
    xr = round(x, -res_exp)
    if xr == 0:
        return "0"
    if 1e-3 <= abs(xr) < 1e5:
        return f"{xr:.{max(0, -res_exp)}f}"
    sig = max(1, _exp10(xr) - res_exp + 1)
    return f"{xr:.{sig - 1}e}"


def ci_resolution(lo: float, hi: float) -> int | None:
    """The decimal exponent to print an estimate and its CI at: one digit below the first digit in
    which the bounds differ (the order of magnitude of hi - lo). None for a degenerate CI (bounds equal
    within a relative 1e-9)."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi - lo <= 1e-9 * max(abs(lo), abs(hi)):
        return None  # equal bounds, or equal up to float rounding
    return _exp10(hi - lo) - 1


def fmt_ci(e: Estimate, unit: str = "") -> str:
    """'point [lo, hi]' at `ci_resolution`; without a CI 'point (n seeds)' (4 significant digits);
    a degenerate CI 'point [point, point]'; 'n/a' without a value."""
    if e.num_seeds == 0 or not math.isfinite(e.point):
        return "n/a"
    if e.events is not None:
        return fmt_rate(e)
    res = ci_resolution(e.lo, e.hi)
    if res is None:
        g = lambda v: f"{v:.4g}"  # noqa: E731
        if math.isfinite(e.lo):
            return f"{g(e.point)}{unit} [{g(e.lo)}, {g(e.hi)}]"
        return f"{g(e.point)}{unit} ({e.num_seeds} seed{'s' if e.num_seeds != 1 else ''})"
    return f"{fmt_at(e.point, res)}{unit} [{fmt_at(e.lo, res)}, {fmt_at(e.hi, res)}]"


def _pct(x: float) -> str:
    v = 100 * x
    return f"{v:.0f}" if abs(v - round(v)) < 1e-9 or v >= 10 else f"{v:.1f}"


def fmt_rate(e: Estimate) -> str:
    """'k/n (r %, 95% CI lo–hi %)' with whole percentages (one decimal below 10 %)."""
    if e.num_seeds == 0:
        return "n/a"
    return f"{e.events}/{e.num_seeds} ({_pct(e.point)} %, 95% CI {_pct(e.lo)}–{_pct(e.hi)} %)"


def fmt_seeds_needed(needed: int | None, num_seeds: int) -> str:
    """The seeds clause of an undecided verdict: '~N seeds per arm for 80% power'; when N ≤ the seeds
    already run, the t-test's figure is below what the rank test with Holm's correction needs, and says so."""
    if needed is None:
        return "no effect measured"
    if needed > MAX_SEEDS:
        return f"> {MAX_SEEDS} seeds per arm for 80% power"
    if needed <= num_seeds:
        return (f"a t-test would have 80% power at ~{needed} seeds per arm, but the rank test with Holm's "
                f"correction does not decide it at {num_seeds}")
    return f"~{needed} seeds per arm for 80% power"


def fmt_p(p: float) -> str:
    """Two significant digits; '< 0.0001' below."""
    if not math.isfinite(p):
        return "n/a"
    if p < 1e-4:
        return "< 0.0001"
    return f"{p:.2g}"
