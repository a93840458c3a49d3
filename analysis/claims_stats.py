"""The claims page's pre-registered tests, one Holm family: which arms each compares, its p-value,
and a verdict ("reproduces" / "does not reproduce" / "not decided") from the Holm-adjusted p and the
direction of the effect. Pure: per-run scalars (`analysis.claims_runs.ClaimRun`) in, rows out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from analysis import stats as st
from analysis.claims_runs import ClaimRun, arm_level, level_rank

ALPHA = st.ALPHA


@dataclass
class ClaimTest:
    section: str
    label: str
    test: str
    estimate: str
    p: float
    agrees: bool | None
    """The measured effect points the claimed way (True), the other way (False), or nowhere (None)."""
    null_claim: bool = False
    """The claim is 'no difference' (zero point): a significant difference does not reproduce it."""
    seeds_needed: int | None = None
    num_seeds: int = 0
    """Seeds of the smaller arm (runs, for a within-run test)."""
    p_holm: float = math.nan
    verdict: str = ""


def claim_verdict(t: ClaimTest, alpha: float = ALPHA) -> str:
    if not math.isfinite(t.p_holm):
        return "not decided: fewer than 2 seeds per arm"
    hp = f"Holm-adjusted p = {st.fmt_p(t.p_holm)}"
    if t.null_claim:
        return (f"does not reproduce: they differ ({hp})" if t.p_holm < alpha
                else f"not decided: no difference at the Holm-adjusted level, equality not shown ({hp})")
    if t.p_holm < alpha and t.agrees is True:
        return f"reproduces ({hp})"
    if t.p_holm < alpha and t.agrees is False:
        return f"does not reproduce: the opposite direction ({hp})"
    return f"not decided ({hp}; {st.fmt_seeds_needed(t.seeds_needed, t.num_seeds)})"


def apply_holm(tests: list[ClaimTest]) -> list[ClaimTest]:
    for t, p in zip(tests, st.holm([t.p for t in tests])):
        t.p_holm = p
        t.verdict = claim_verdict(t)
    return tests


# --------------------------------------------------------------------------- per arm

def seed_map(runs: list[ClaimRun], key: str) -> dict[int, float]:
    return {r.seed: r.scores[key] for r in runs}


def arm_survival(runs: list[ClaimRun]) -> st.Survival:
    ok = [r for r in runs if math.isfinite(r.duration)]
    return st.survival([r.duration for r in ok], [r.observed for r in ok])


def failure_rate(runs: list[ClaimRun]) -> st.Estimate:
    return st.rate(sum(r.observed for r in runs), len(runs))


def fmt_median(s: st.Survival) -> str:
    if not math.isfinite(s.median):
        return "n/a" if math.isnan(s.median) else f"> {int(s.durations.max())} (not reached)"
    return f"{s.median:g}"


def _sign(x: float) -> int:
    return 0 if not math.isfinite(x) or x == 0 else (1 if x > 0 else -1)


def _agrees(effect: float, claim_sign: int) -> bool | None:
    s = _sign(effect)
    return None if s == 0 else s == claim_sign


def _power_on(a: dict[int, float], b: dict[int, float]) -> int | None:
    if st.paired_by_seed(a, b):
        return st.seeds_for_power([a[s] - b[s] for s in sorted(a)], paired=True)
    return st.seeds_for_power(list(a.values()), list(b.values()), paired=False)


# --------------------------------------------------------------------------- tests

def logrank_row(section: str, a: str, b: str, arms: Mapping[str, list[ClaimRun]], claim_sign: int,
                null_claim: bool = False) -> ClaimTest:
    """Log-rank of A's against B's time to failure; claim_sign +1: A fails more / earlier, -1: less."""
    sa, sb = arm_survival(arms[a]), arm_survival(arms[b])
    lr = st.logrank(sa, sb)
    est = (f"failed {st.fmt_rate(failure_rate(arms[a]))} vs {st.fmt_rate(failure_rate(arms[b]))}; "
           f"median time to failure {fmt_median(sa)} vs {fmt_median(sb)}")
    return ClaimTest(section, f"{a} vs {b}: time to failure", "log-rank", est, lr.p,
                     _agrees(lr.observed_minus_expected, claim_sign), null_claim,
                     _power_on(seed_map(arms[a], "failed"), seed_map(arms[b], "failed")),
                     min(len(arms[a]), len(arms[b])))


def paired_row(section: str, a: str, b: str, key: str, label: str, arms: Mapping[str, list[ClaimRun]],
               claim_sign: int, reps: int, seed: int) -> ClaimTest:
    """A - B of a per-run scalar, paired by seed where the seeds match (`stats.compare`)."""
    d = st.compare(seed_map(arms[a], key), seed_map(arms[b], key), reps=reps,
                   seed=st.stream_seed(seed, key, a, b))
    design = f"paired by seed, n={d.diff.num_seeds}" if d.paired else "unpaired"
    return ClaimTest(section, f"{a} vs {b}: {label}", f"{d.test} ({design})",
                     f"A − B = {st.fmt_ci(d.diff)} (IQM, 95% bootstrap CI)", d.p, _agrees(d.diff.point, claim_sign),
                     seeds_needed=d.seeds_needed, num_seeds=min(len(arms[a]), len(arms[b])))


def r3_mismatch_row(arm: str, runs: list[ClaimRun], reps: int, seed: int) -> ClaimTest:
    """(a) within the R3 runs: k3 natural - k3 replayed per run (the two passes of one run are paired),
    Wilcoxon signed-rank over seeds; the claim: natural > replayed."""
    diffs = np.asarray([r.scores["k3_nat_minus_rep"] for r in runs])
    ratio = st.bootstrap_ci([r.scores["k3_ratio_of_means"] for r in runs], reps=reps,
                            seed=st.stream_seed(seed, "k3_ratio_of_means", arm))
    med = st.bootstrap_ci([r.scores["k3_ratio_median"] for r in runs], reps=reps,
                          seed=st.stream_seed(seed, "k3_ratio_median", arm))
    est = f"ratio of means {st.fmt_ci(ratio)}×; median per-step ratio {st.fmt_ci(med)}×"
    return ClaimTest("(a) R3 mismatch", f"{arm}: k3 natural vs replayed", "Wilcoxon signed-rank (within runs)",
                     est, st.wilcoxon_p(diffs), _agrees(float(np.median(st.finite(diffs))) if st.finite(diffs).size
                                                        else math.nan, 1),
                     seeds_needed=st.seeds_for_power(diffs, paired=True), num_seeds=int(st.finite(diffs).size))


def grpo_levels(arms: Mapping[str, list[ClaimRun]]) -> list[str]:
    """Drift levels with a GRPO-none arm (no method suffix), weakest first."""
    return sorted({arm_level(a) for a in arms if a.startswith("grpo-none-") and "_" not in a.split("-", 2)[2]},
                  key=level_rank)


def strongest_level(arms: Mapping[str, list[ClaimRun]]) -> str | None:
    levels = grpo_levels(arms)
    return levels[-1] if levels else None


def fix_arms(level: str) -> list[tuple[str, str]]:
    return [(f"grpo-r3-{level}", "GRPO+R3"), (f"grpo-r2-{level}", "GRPO+R2"),
            (f"grpo-none-{level}_tis", "GRPO token-TIS"), (f"gspo-none-{level}", "GSPO")]


def claim_family(arms: Mapping[str, list[ClaimRun]], reps: int, seed: int) -> list[ClaimTest]:
    """Every pre-registered test whose arms are present (docs/paper_claims.md "Pre-registration": dose-response,
    fixes at the strongest drift with their paired secondaries, zero point), Holm-adjusted together."""
    tests: list[ClaimTest] = []
    levels = grpo_levels(arms)
    if "fp32" in levels:
        for lv in levels[1:]:
            tests.append(logrank_row("dose-response", f"grpo-none-{lv}", "grpo-none-fp32", arms, +1))
    top = strongest_level(arms)
    if top is not None:
        base = f"grpo-none-{top}"
        for arm, _ in fix_arms(top):
            if arm in arms:
                tests.append(logrank_row("fixes", arm, base, arms, -1))
                tests.append(paired_row("fixes", arm, base, "final_reward", "final reward", arms, +1, reps, seed))
                tests.append(paired_row("fixes", arm, base, "reward_auc", "reward AUC", arms, +1, reps, seed))
    if "grpo-none-fp32" in arms:
        for arm in ("gspo-none-fp32", "grpo-r3-fp32"):
            if arm in arms:
                tests.append(logrank_row("zero point", arm, "grpo-none-fp32", arms, 0, null_claim=True))
    return apply_holm(tests)


def r3_family(arms: Mapping[str, list[ClaimRun]], reps: int, seed: int) -> list[ClaimTest]:
    """(a), not pre-registered: per R3 arm with both k3 metrics, natural vs replayed within runs; a Holm
    family of its own, so it does not dilute the confirmatory tests."""
    return apply_holm([r3_mismatch_row(arm, runs, reps, seed) for arm, runs in arms.items()
                       if arm.startswith("grpo-r3-") and any(math.isfinite(r.scores["k3_nat_minus_rep"])
                                                              for r in runs)])


POSITIVE_CONTROL_LEVEL = "bf16"
"""Pre-registered (docs/paper_claims.md): plain GRPO with bf16 rollouts fails in at least half its seeds."""


def positive_control_arm(arms: Mapping[str, list[ClaimRun]]) -> str | None:
    """grpo-none-bf16 when present, else GRPO-none at the strongest drift level present."""
    if f"grpo-none-{POSITIVE_CONTROL_LEVEL}" in arms:
        return f"grpo-none-{POSITIVE_CONTROL_LEVEL}"
    top = strongest_level(arms)
    return f"grpo-none-{top}" if top else None
