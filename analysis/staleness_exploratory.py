"""Experiment 6's exploratory look (`python -m analysis.staleness ... --exploratory`): written after its endpoint
was seen (docs/experiment6_training.md), so it tests nothing; it says what the pre-registered signed-rank test of
final reward could not see in bistable outcomes, as hypotheses for a fresh-seed experiment.

Per pair of arms, paired by seed (each fix against GRPO at the largest N both have, then the two controls):
- the **mean** of the per-seed differences of final reward, its 95% t CI and the two-sided sign-flip permutation p
  (scipy `permutation_test` on the one sample of differences: each difference's sign flipped; 9999 draws from a
  fixed stream). A test of the mean: a few large differences (one stall costs ~0.22 of final reward) move it by
  their size, whereas the signed-rank test gives each at most rank n and lets many small differences between solved
  runs (of either sign) weigh nearly as much;
- **stalls** (final reward below `analysis.phase_runs.SOLVED`, 0.9, the pre-registration's secondary "stalls"):
  seeds where only A stalled and where only B stalled, and the exact McNemar p (two-sided binomial test of the
  discordant seeds, scipy `binomtest`).
No Holm family and no verdicts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from analysis import stats as st
from analysis.matrix_runs import md_table
from analysis.phase_runs import SOLVED, PhaseRun
from analysis.phase_stats import GRPO

SeedRuns = Mapping[int, PhaseRun]


def sign_flip_p(diffs) -> float:
    """Two-sided sign-flip permutation p of the mean of paired differences (scipy, 9999 draws from stream 0, or
    exact enumeration when 2^n ≤ 9999); 1.0 when every difference is 0, NaN below 2 values."""
    from scipy.stats import permutation_test

    d = st.finite(diffs)
    if d.size < 2:
        return math.nan
    if not np.any(d != 0):
        return 1.0
    res = permutation_test((d,), lambda x, axis: np.mean(x, axis=axis), permutation_type="samples",
                           vectorized=True, n_resamples=9999, alternative="two-sided", rng=np.random.default_rng(0))
    return float(res.pvalue)


def mcnemar_p(only_a: int, only_b: int) -> float:
    """Exact two-sided McNemar p: binomial test of `only_a` of the discordant seeds at 1/2; 1.0 with none."""
    from scipy.stats import binomtest

    n = only_a + only_b
    return 1.0 if n == 0 else float(binomtest(only_a, n, 0.5, alternative="two-sided").pvalue)


def paired_mean(a: SeedRuns, b: SeedRuns) -> dict:
    """A − B of final reward on the seeds both have with finite values: n, mean and 95% t CI, the sign-flip p, the
    stalls of each arm and the seeds where only A / only B stalled."""
    fa = {s: r.scores["final_reward"] for s, r in a.items()}
    fb = {s: r.scores["final_reward"] for s, r in b.items()}
    seeds = sorted(s for s in fa.keys() & fb.keys() if math.isfinite(fa[s]) and math.isfinite(fb[s]))
    d = [fa[s] - fb[s] for s in seeds]
    t = st.one_sample(d)
    return {"n": len(d), "mean": t["mean"], "lo": t["lo"], "hi": t["hi"], "p": sign_flip_p(d),
            "stalled_a": sum(fa[s] < SOLVED for s in seeds), "stalled_b": sum(fb[s] < SOLVED for s in seeds),
            "only_a": sum(fa[s] < SOLVED <= fb[s] for s in seeds),
            "only_b": sum(fb[s] < SOLVED <= fa[s] for s in seeds)}


def fmt_mean(r: dict) -> str:
    """'+m [+lo, +hi]' of a `paired_mean`, 'n/a' without a CI."""
    return "n/a" if not math.isfinite(r["lo"]) else f"{r['mean']:+.3f} [{r['lo']:+.3f}, {r['hi']:+.3f}]"


def pair_row(label: str, a: SeedRuns, b: SeedRuns) -> list[str]:
    """One table row for arms `a` and `b` on the seeds both have."""
    r = paired_mean(a, b)
    return [label, str(r["n"]), fmt_mean(r), st.fmt_p(r["p"]), f"{r['stalled_a']} / {r['stalled_b']}",
            f"{r['only_a']} / {r['only_b']}", st.fmt_p(mcnemar_p(r["only_a"], r["only_b"]))]


def exploratory_table(by_method: Mapping[str, Mapping[int, SeedRuns]], fixes: tuple[str, ...],
                      controls: tuple[tuple, ...]) -> list[str]:
    """The rows for each of `fixes` against GRPO at the largest N both have, then each of `controls` ((name,
    method A, N of A, method B, N of B, ...), `analysis.staleness.CONTROLS`) whose arms exist."""
    pairs = []
    grpo = by_method.get(GRPO, {})
    for fix in fixes:
        shared = sorted(grpo.keys() & by_method.get(fix, {}).keys())
        if shared:
            pairs.append((f"{fix} vs {GRPO} at N = {shared[-1]}", by_method[fix][shared[-1]], grpo[shared[-1]]))
    for name, ma, na, mb, nb, *_ in controls:
        a, b = by_method.get(ma, {}).get(na), by_method.get(mb, {}).get(nb)
        if a and b:
            pairs.append((f"{name}: {ma} at N = {na} vs {mb} at N = {nb}", a, b))
    if not pairs:
        return ["No pair: the matrix has no fix and GRPO at a shared N, and no control's arms.", ""]
    return md_table(["A vs B", "seeds", "mean of A − B, final reward (95% t CI)", "sign-flip p",
                     f"stalled (final < {SOLVED:g}) A / B", "seeds only A / only B stalled", "McNemar exact p"],
                    [pair_row(*p) for p in pairs])
