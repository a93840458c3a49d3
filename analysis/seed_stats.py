"""Few-seed statistics that can rank the arms of an ablation: per run a few scalars from its reward
curve and mismatch metric (`reward_quantities`), per arm their interquartile mean (IQM, rliable) with
a 95% bootstrap CI over seeds, or for the failure rate the exact Clopper-Pearson interval
(`arm_estimates`); per pair of arms the difference with its CI, a rank test and a verdict after Holm's
correction over every test of the report (`compare_arms`, `seed_statistics`). Arrays in,
dataclasses out, no plotting: `analysis.compare` formats the tables. The statistics themselves are
`analysis.stats`.

- Each quantity of each arm (and of each pair) is resampled from its own stream, seeded by
  `stats.stream_seed(seed, quantity, arm names)`: a CI does not depend on what else is in the report.
- Arms that share `train.seed` values are compared paired by seed: the IQM (mean for a rate) of the
  per-seed differences with a bootstrap CI over seeds and a Wilcoxon signed-rank p; otherwise
  unpaired: IQM(A) - IQM(B) with each arm resampled on its own and a Mann-Whitney U p.
- Verdicts: "A better than B (Holm-adjusted p = ...)" when the Holm-adjusted p is below 0.05, else
  "not decided (...)" with the seeds per arm a two-sided test would need for 80% power at the
  observed effect size.
- A run fails when its reward collapses or it stalls without learning signal
  (`moe_gspo.algos.collapse.detect_failure`, pre-registered `FailureCriteria`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from rliable import metrics

from analysis import stats as st
from analysis.stats import Estimate, fmt_p
from moe_gspo.algos.collapse import FailureCriteria, detect_failure

DEFAULT_REPS = st.DEFAULT_REPS
"""Bootstrap replications per arm and quantity, and per pair and quantity."""
DEFAULT_SEED = 0
DEFAULT_REWARD_THRESHOLD = 0.8
DEFAULT_COLLAPSE_DROP = FailureCriteria().drop
MAX_ALL_PAIRS_ARMS = 6
"""Up to this many arms every pair is compared; beyond, the pairs that differ in one name component."""


@dataclass(frozen=True)
class Quantity:
    key: str
    label: str
    higher_is_better: bool
    aggregate: str = "iqm"
    """'iqm' (rliable's interquartile mean), 'mean', or 'rate' for a 0/1 quantity (k/n with the exact
    Clopper-Pearson interval; pairs compare the means)."""


QUANTITIES = (
    Quantity("final_reward", "final reward", True),
    Quantity("reward_auc", "reward AUC", True),
    Quantity("steps_to_threshold", "steps to threshold", False),
    Quantity("collapsed", "failure (collapse or stall) rate", False, "rate"),
    Quantity("mismatch_kl", "mismatch k3 KL", False),
)
QUANTITY = {q.key: q for q in QUANTITIES}


# --------------------------------------------------------------------------- per run

def smoothing_window(num_steps: int) -> int:
    """max(1, 10% of the run's steps rounded half up)."""
    return max(1, math.floor(num_steps / 10 + 0.5))


def smoothed(rewards: np.ndarray) -> np.ndarray:
    """Trailing moving average over `smoothing_window(n)` steps, full windows only: element i is the
    mean of rewards[i : i + w], i.e. the smoothed value at step i + w - 1 (n - w + 1 values)."""
    rewards = np.asarray(rewards, np.float64)
    w = smoothing_window(rewards.size)
    if rewards.size == 0:
        return rewards
    c = np.concatenate([[0.0], np.cumsum(rewards)])
    return (c[w:] - c[:-w]) / w


def steps_to_threshold(rewards: np.ndarray, threshold: float) -> tuple[int, bool]:
    """(steps, reached): the number of steps up to and including the first one at which the smoothed
    reward reaches `threshold`; a run that never does counts as its number of steps + 1 (censored,
    reached False)."""
    s = smoothed(rewards)
    hit = np.flatnonzero(s >= threshold)
    if hit.size == 0:
        return len(rewards) + 1, False
    return int(hit[0]) + smoothing_window(len(rewards)), True


def collapsed(rewards: np.ndarray, drop: float = DEFAULT_COLLAPSE_DROP, zero_std: np.ndarray | None = None) -> bool:
    """True when `detect_failure` finds a collapse or (with `zero_std`) a stall, `drop` replacing
    the pre-registered 0.3."""
    return detect_failure(rewards, zero_std, FailureCriteria(drop=drop)).kind is not None


@dataclass
class RunQuantities:
    """The per-run scalars (NaN where the run has no finite reward / did not log the mismatch)."""

    final_reward: float
    """Mean reward/mean over the last max(1, n // 10) steps (`headline_numbers`' reward_last10_mean)."""
    reward_auc: float
    """Mean reward/mean over all steps: the area under the reward curve / the number of steps."""
    steps_to_threshold: float
    """See `steps_to_threshold`; num_steps + 1 when not reached."""
    reached_threshold: bool
    collapsed: float
    """1.0 when the run failed (collapse or stall, `detect_failure`), else 0.0."""
    mismatch_kl: float
    """Mean over steps of mismatch/k3_kl (rollout engine vs learner, natural routing)."""
    seed: int | None = None
    """The run's train.seed (pairs arms by seed when both have the same seeds)."""
    failure_kind: str | None = None
    failure_step: int | None = None
    """Index of the failure step among the run's finite-reward steps (None: censored)."""
    censored_at: int = -1

    def value(self, key: str) -> float:
        return float(getattr(self, key))


def reward_quantities(rewards: np.ndarray, final_reward: float, mismatch_kl: float, *,
                      reward_threshold: float = DEFAULT_REWARD_THRESHOLD,
                      collapse_drop: float = DEFAULT_COLLAPSE_DROP, zero_std: np.ndarray | None = None,
                      seed: int | None = None) -> RunQuantities:
    """The run's scalars from its reward/mean values in step order (non-finite steps are dropped;
    `zero_std`: reward/frac_zero_std at the same steps, for the stall half of the failure detector)."""
    rewards = np.asarray(rewards, np.float64)
    keep = np.isfinite(rewards)
    if zero_std is not None:
        zero_std = np.asarray(zero_std, np.float64)
        zero_std = zero_std[keep] if zero_std.size == rewards.size else None
    rewards = rewards[keep]
    if rewards.size == 0:
        return RunQuantities(math.nan, math.nan, math.nan, False, math.nan, mismatch_kl, seed)
    steps, reached = steps_to_threshold(rewards, reward_threshold)
    ev = detect_failure(rewards, zero_std, FailureCriteria(drop=collapse_drop))
    return RunQuantities(final_reward, float(rewards.mean()), float(steps), reached, float(ev.kind is not None),
                         mismatch_kl, seed, ev.kind, ev.step, ev.censored_at)


# --------------------------------------------------------------------------- per arm

def iqm_columns(x_NK: np.ndarray) -> np.ndarray:
    """Per column, rliable's `aggregate_iqm` (scipy trim_mean, int(n / 4) values cut each side)."""
    return st.iqm_rows(np.asarray(x_NK, np.float64).T)


def poi_columns(a_NK: np.ndarray, b_MK: np.ndarray) -> np.ndarray:
    """Per column, rliable's `probability_of_improvement` of a over b: P(a > b) + P(a = b) / 2 over
    all (seed of a, seed of b) pairs, = (1 + mean sign(a - b)) / 2."""
    signs = np.sign(a_NK[:, None, :] - b_MK[None, :, :]).sum(axis=(0, 1))
    return 0.5 + 0.5 * signs / (a_NK.shape[0] * b_MK.shape[0])


def _how(q: Quantity) -> str:
    return "iqm" if q.aggregate == "iqm" else "mean"


def _as_seed_map(values, seeds: Sequence[int] | None):
    """{seed: value} when the seeds are given and unique, else the plain list."""
    values = [float(v) for v in np.asarray(values, np.float64).ravel()]
    if seeds is not None and len(seeds) == len(values) and len(set(seeds)) == len(seeds):
        return dict(zip(seeds, values))
    return values


def arm_estimates(scores: Mapping[str, Sequence[float]], *, reps: int = DEFAULT_REPS,
                  seed: int = DEFAULT_SEED, confidence: float = 0.95,
                  quantities: Mapping[str, Quantity] = QUANTITY, arm: str = "") -> dict[str, Estimate]:
    """Per quantity of one arm: the IQM (the mean for 'mean') over its seeds' finite values with a
    percentile-bootstrap CI from the stream `stream_seed(seed, key, arm)`; a 'rate' quantity: k/n
    with the exact Clopper-Pearson interval."""
    out = {}
    for k, v in scores.items():
        q = quantities[k]
        if q.aggregate == "rate":
            f = st.finite(v)
            out[k] = st.rate(int(f.sum()), int(f.size), confidence)
        else:
            out[k] = st.bootstrap_ci(v, how=_how(q), reps=reps, seed=st.stream_seed(seed, k, arm),
                                     confidence=confidence)
    return out


# --------------------------------------------------------------------------- pairs

@dataclass
class PairComparison:
    """One quantity compared between arms A and B."""

    arm_a: str
    arm_b: str
    key: str
    diff: Estimate
    """A - B in the quantity's units with its bootstrap CI: paired, the IQM (mean for a rate) of the
    per-seed differences; unpaired, IQM(A) - IQM(B) (num_seeds: the smaller arm's)."""
    poi: Estimate
    """Probability that a seed of A is better than a seed of B (> 0.5: A better; lower-is-better
    quantities are negated first), with its bootstrap CI (arms resampled on their own)."""
    verdict: str
    paired: bool = False
    p: float = math.nan
    """Wilcoxon signed-rank (paired) or Mann-Whitney U (unpaired), two-sided."""
    p_holm: float = math.nan
    """`p` after Holm's correction over the family it was decided in (`apply_holm`)."""
    seeds_needed: int | None = None
    """Seeds per arm for 80% power at the observed effect size (`stats.seeds_for_power`)."""
    test: str = ""


def verdict(arm_a: str, arm_b: str, c: PairComparison | st.Estimate, n_a: int | None = None,
            n_b: int | None = None, higher_is_better: bool = True, alpha: float = st.ALPHA) -> str:
    """'A better than B (Holm-adjusted p = …)' when the adjusted p < alpha, else 'not decided (…)'."""
    if not isinstance(c, PairComparison) or not math.isfinite(c.p_holm):
        return "not decided: fewer than 2 seeds"
    if c.p_holm < alpha and c.diff.point != 0 and math.isfinite(c.diff.point):
        better, worse = (arm_a, arm_b) if (c.diff.point > 0) == higher_is_better else (arm_b, arm_a)
        return f"{better} better than {worse} (Holm-adjusted p = {fmt_p(c.p_holm)})"
    need = ("no difference measured" if c.seeds_needed is None
            else st.fmt_seeds_needed(c.seeds_needed, c.diff.num_seeds))
    return f"not decided (Holm-adjusted p = {fmt_p(c.p_holm)}; {need})"


def apply_holm(comparisons: list[PairComparison], quantities: Mapping[str, Quantity] = QUANTITY) -> None:
    """Holm-adjust the p-values of `comparisons` as one family and rewrite their verdicts (in place)."""
    for c, p in zip(comparisons, st.holm([c.p for c in comparisons])):
        c.p_holm = p
        c.verdict = verdict(c.arm_a, c.arm_b, c, higher_is_better=quantities[c.key].higher_is_better)


def _poi(fa: np.ndarray, fb: np.ndarray, sign: float, reps: int, seed: int, confidence: float) -> Estimate:
    point = float(metrics.probability_of_improvement(sign * fa[:, None], sign * fb[:, None]))
    e = Estimate(point, math.nan, math.nan, min(fa.size, fb.size))
    if e.num_seeds >= 2:
        rng = np.random.default_rng(seed)
        sa = fa[rng.integers(0, fa.size, (reps, fa.size))]
        sb = fb[rng.integers(0, fb.size, (reps, fb.size))]
        pois = 0.5 + 0.5 * np.sign(sign * (sa[:, :, None] - sb[:, None, :])).mean(axis=(1, 2))
        e.lo, e.hi = (float(x) for x in np.percentile(pois, [50 * (1 - confidence), 50 * (1 + confidence)]))
    return e


def compare_arms(arm_a: str, arm_b: str, scores_a: Mapping[str, Sequence[float]],
                 scores_b: Mapping[str, Sequence[float]], *, seeds_a: Sequence[int] | None = None,
                 seeds_b: Sequence[int] | None = None, reps: int = DEFAULT_REPS, seed: int = DEFAULT_SEED,
                 confidence: float = 0.95, quantities: Mapping[str, Quantity] = QUANTITY) -> list[PairComparison]:
    """Each quantity both arms have finite values of (in `quantities` order): A - B (paired by seed when
    `seeds_a` / `seeds_b` give the same seeds, `stats.compare`), the probability of improvement, the
    p-value and the verdict, Holm-adjusted over these quantities (`seed_statistics` re-adjusts over the
    whole report). Each quantity's bootstrap: stream `stream_seed(seed, key, arm_a, arm_b)`."""
    out = []
    for k, q in quantities.items():
        if k not in scores_a or k not in scores_b:
            continue
        fa, fb = st.finite(scores_a[k]), st.finite(scores_b[k])
        if not (fa.size and fb.size):
            continue
        d = st.compare(_as_seed_map(scores_a[k], seeds_a), _as_seed_map(scores_b[k], seeds_b), how=_how(q),
                       reps=reps, seed=st.stream_seed(seed, k, arm_a, arm_b), confidence=confidence)
        poi = _poi(fa, fb, 1.0 if q.higher_is_better else -1.0, reps,
                   st.stream_seed(seed, k, arm_a, arm_b, "poi"), confidence)
        out.append(PairComparison(arm_a, arm_b, k, d.diff, poi, "", d.paired, d.p, math.nan, d.seeds_needed, d.test))
    apply_holm(out, quantities)
    return out


def arm_pairs(arms: Sequence[str], max_all_pairs: int = MAX_ALL_PAIRS_ARMS) -> list[tuple[str, str]]:
    """Every pair (in the given order) up to `max_all_pairs` arms; beyond, the pairs whose names
    (split on '-', e.g. 'grpo-r3-base') have as many components and differ in exactly one."""
    pairs = list(itertools.combinations(arms, 2))
    if len(arms) <= max_all_pairs:
        return pairs
    split = {a: a.split("-") for a in arms}
    return [(a, b) for a, b in pairs if len(split[a]) == len(split[b])
            and sum(x != y for x, y in zip(split[a], split[b])) == 1]


# --------------------------------------------------------------------------- all arms

class UnknownArmError(ValueError):
    """A pair names an arm that has no runs."""


@dataclass
class SeedStatistics:
    runs: dict[str, list[RunQuantities]]
    """Per arm, its runs' scalars (the arm's seeds)."""
    arms: dict[str, dict[str, Estimate]]
    """Per arm and quantity key, `arm_estimates`."""
    pairs: list[PairComparison] = field(default_factory=list)
    """Holm-adjusted over all of them together."""
    reps: int = DEFAULT_REPS
    seed: int = DEFAULT_SEED
    confidence: float = 0.95


def _seeds(rs: Sequence[RunQuantities]) -> list[int] | None:
    seeds = [r.seed for r in rs]
    return None if any(s is None for s in seeds) else seeds


def seed_statistics(runs: Mapping[str, Sequence[RunQuantities]], *,
                    pairs: Sequence[tuple[str, str]] | None = None, reps: int = DEFAULT_REPS,
                    seed: int = DEFAULT_SEED, confidence: float = 0.95) -> SeedStatistics:
    """`arm_estimates` of every arm and `compare_arms` of `pairs` (default `arm_pairs`), with Holm's
    correction over every pair and quantity together. Raises UnknownArmError for a pair naming an arm
    that is not in `runs`."""
    unknown = sorted({a for p in pairs or () for a in p} - set(runs))
    if unknown:
        raise UnknownArmError(f"pairs name unknown arm(s) {', '.join(unknown)}; arms: {', '.join(runs)}")
    scores = {arm: {q.key: [r.value(q.key) for r in rs] for q in QUANTITIES} for arm, rs in runs.items()}
    opts = dict(reps=reps, seed=seed, confidence=confidence)
    pairs = arm_pairs(list(runs)) if pairs is None else pairs
    comparisons = [c for a, b in pairs
                   for c in compare_arms(a, b, scores[a], scores[b], seeds_a=_seeds(runs[a]),
                                         seeds_b=_seeds(runs[b]), **opts)]
    apply_holm(comparisons)
    return SeedStatistics(
        {arm: list(rs) for arm, rs in runs.items()},
        {arm: arm_estimates(s, arm=arm, **opts) for arm, s in scores.items()},
        comparisons, reps, seed, confidence)

