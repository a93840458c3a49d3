"""Few-seed statistics that can rank the arms of an ablation (Agarwal et al. 2021, "Deep RL at the
edge of the statistical precipice", with their library `rliable`): per run a few scalars from its
reward curve and mismatch metric (`run_quantities`), per arm their interquartile mean (IQM) with a
stratified-bootstrap 95% confidence interval over seeds (`arm_estimates`), per pair of arms the
IQM difference and the probability of improvement with their bootstrap CIs and a plain verdict
(`compare_arms`). Arrays in, dataclasses out, no plotting: `analysis.compare` formats the tables.

Bootstrap: rliable's `get_interval_estimates` (percentile method; arms resampled independently in a
pair). The statistic inside its resampling loop is a vectorised numpy form of rliable's own
(`aggregate_iqm` = scipy's 25%-trimmed mean, `probability_of_improvement` = Mann-Whitney U / (n_a n_b)),
because scipy's versions cost ~0.1-0.5 ms a call and the loop runs `reps` times per arm and pair;
the point estimates are rliable's functions, and the tests check that both forms agree. Each
quantity is resampled on its own (the quantities are stacked as rliable "tasks", which its
stratified bootstrap resamples independently), always from the same seed, so a report is
reproducible and an arm's CIs do not depend on which other arms are in it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
from rliable import library, metrics

DEFAULT_REPS = 2000
"""Bootstrap replications per arm and per pair (rliable's default for performance profiles)."""
DEFAULT_SEED = 0
DEFAULT_REWARD_THRESHOLD = 0.8
DEFAULT_COLLAPSE_DROP = 0.3
MAX_ALL_PAIRS_ARMS = 6
"""Up to this many arms every pair is compared; beyond, the pairs that differ in one name component."""


@dataclass(frozen=True)
class Quantity:
    key: str
    label: str
    higher_is_better: bool
    aggregate: str = "iqm"
    """'iqm' (rliable's interquartile mean), or 'mean' for a 0/1 quantity: the IQM would trim up to
    half the seeds away (2 collapsed seeds of 8 would read 0), the mean is the rate."""


QUANTITIES = (
    Quantity("final_reward", "final reward", True),
    Quantity("reward_auc", "reward AUC", True),
    Quantity("steps_to_threshold", "steps to threshold", False),
    Quantity("collapsed", "collapse rate", False, "mean"),
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


def collapsed(rewards: np.ndarray, drop: float) -> bool:
    """True when the smoothed reward falls `drop` or more below its running best and stays that far
    below that best up to the last step. The running best cannot rise while the reward stays below it,
    so this is: the last smoothed value is ≥ `drop` below the best smoothed value."""
    s = smoothed(rewards)
    return bool(s.size and s.max() - s[-1] >= drop - 1e-12)


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
    """1.0 when `collapsed`, else 0.0."""
    mismatch_kl: float
    """Mean over steps of mismatch/k3_kl (rollout engine vs learner, natural routing)."""

    def value(self, key: str) -> float:
        return float(getattr(self, key))


def reward_quantities(rewards: np.ndarray, final_reward: float, mismatch_kl: float, *,
                      reward_threshold: float = DEFAULT_REWARD_THRESHOLD,
                      collapse_drop: float = DEFAULT_COLLAPSE_DROP) -> RunQuantities:
    """The run's scalars from its reward/mean values in step order (non-finite steps are dropped)."""
    rewards = np.asarray(rewards, np.float64)
    rewards = rewards[np.isfinite(rewards)]
    if rewards.size == 0:
        return RunQuantities(math.nan, math.nan, math.nan, False, math.nan, mismatch_kl)
    steps, reached = steps_to_threshold(rewards, reward_threshold)
    return RunQuantities(final_reward, float(rewards.mean()), float(steps), reached,
                         float(collapsed(rewards, collapse_drop)), mismatch_kl)


# --------------------------------------------------------------------------- bootstrap

@contextmanager
def _seeded_global_rng(seed: int):
    """rliable 1.2's StratifiedBootstrap / StratifiedIndependentBootstrap draw their resampling
    indices from numpy's global legacy stream (`np.random.choice` in `update_indices`); the
    `random_state` they accept goes to arch's generator, which they never use. So the global stream
    is seeded here, and restored afterwards."""
    state = np.random.get_state()
    np.random.seed(seed)
    try:
        yield
    finally:
        np.random.set_state(state)


def _interval(scores: np.ndarray | tuple[np.ndarray, ...], func: Callable[..., np.ndarray], reps: int,
              seed: int, confidence: float) -> np.ndarray:
    """[2, K] lower / upper ends of rliable's percentile stratified-bootstrap CIs of func's K outputs."""
    with _seeded_global_rng(seed):
        _, ci = library.get_interval_estimates({"x": scores}, func, reps=reps,
                                               confidence_interval_size=confidence)
    return np.asarray(ci["x"], np.float64).reshape(2, -1)


def iqm_columns(x_NK: np.ndarray) -> np.ndarray:
    """Per column, rliable's `aggregate_iqm` (scipy trim_mean, int(n / 4) values cut each side)."""
    return _aggregate_columns(x_NK, np.zeros(x_NK.shape[1], bool))


def poi_columns(a_NK: np.ndarray, b_MK: np.ndarray) -> np.ndarray:
    """Per column, rliable's `probability_of_improvement` of a over b: P(a > b) + P(a = b) / 2 over
    all (seed of a, seed of b) pairs, = (1 + mean sign(a - b)) / 2."""
    signs = np.sign(a_NK[:, None, :] - b_MK[None, :, :]).sum(axis=(0, 1))
    return 0.5 + 0.5 * signs / (a_NK.shape[0] * b_MK.shape[0])


def _aggregate_columns(x_NK: np.ndarray, use_mean: np.ndarray) -> np.ndarray:
    """Per column the mean where `use_mean`, else the IQM (sums, not np.mean: this runs `reps` times)."""
    n = x_NK.shape[0]
    cut = int(0.25 * n)
    x_NK = np.sort(x_NK, axis=0)
    return np.where(use_mean, x_NK.sum(axis=0) / n, x_NK[cut:n - cut].sum(axis=0) / (n - 2 * cut))


def _point(values: np.ndarray, key: str, quantities: Mapping[str, Quantity] = QUANTITY) -> float:
    agg = metrics.aggregate_mean if quantities[key].aggregate == "mean" else metrics.aggregate_iqm
    return float(agg(values[:, None])) if values.size else math.nan


def _finite(values) -> np.ndarray:
    values = np.asarray(values, np.float64).ravel()
    return values[np.isfinite(values)]


@dataclass
class Estimate:
    """A point estimate with its bootstrap CI (NaN ends with fewer than 2 seeds)."""

    point: float
    lo: float
    hi: float
    num_seeds: int
    """Seeds with a finite value."""


def arm_estimates(scores: Mapping[str, Sequence[float]], *, reps: int = DEFAULT_REPS,
                  seed: int = DEFAULT_SEED, confidence: float = 0.95,
                  quantities: Mapping[str, Quantity] = QUANTITY) -> dict[str, Estimate]:
    """Per quantity (a key of `quantities`, default QUANTITY) of one arm: the IQM (the mean for a rate)
    over its seeds' finite values and the stratified-bootstrap CI. Quantities with the same number of
    finite seeds go through one bootstrap, as separate rliable tasks (resampled independently)."""
    finite = {k: _finite(v) for k, v in scores.items()}
    out = {k: Estimate(_point(v, k, quantities), math.nan, math.nan, v.size) for k, v in finite.items()}
    groups: dict[int, list[str]] = {}
    for k, v in finite.items():
        if v.size >= 2:
            groups.setdefault(v.size, []).append(k)
    for keys in groups.values():
        use_mean = np.asarray([quantities[k].aggregate == "mean" for k in keys])
        ci = _interval(np.stack([finite[k] for k in keys], 1), lambda x: _aggregate_columns(x, use_mean),
                       reps, seed, confidence)
        for i, k in enumerate(keys):
            out[k].lo, out[k].hi = float(ci[0, i]), float(ci[1, i])
    return out


# --------------------------------------------------------------------------- pairs

@dataclass
class PairComparison:
    """One quantity compared between arms A and B."""

    arm_a: str
    arm_b: str
    key: str
    diff: Estimate
    """IQM(A) - IQM(B) (means for a rate) in the quantity's units, with its bootstrap CI (num_seeds:
    the smaller arm's)."""
    poi: Estimate
    """Probability that a seed of A is better than a seed of B (> 0.5: A better; lower-is-better
    quantities are negated first), with its bootstrap CI."""
    verdict: str


def seeds_needed(diff: float, lo: float, hi: float, num_seeds: int) -> int | None:
    """Seeds per arm at which the CI of the difference would just reach |diff| from it on zero's side.

    Assumes the CI shrinks like 1/sqrt(n) when both arms get more seeds in the same proportion, and
    that the measured difference and per-seed spread hold: M = ceil(N (h / |diff|)^2) with N the
    pair's larger seed count and h the distance from `diff` to the CI end on zero's side (the
    half-width for a symmetric CI; the percentile CI need not be symmetric). At M seeds the CI would
    exclude 0 about half the time if the measured difference is the true one: a rough size, not a
    power calculation. None when diff is 0 (no difference measured); at least N + 1."""
    if diff == 0 or not math.isfinite(diff):
        return None
    h = abs(diff - (lo if diff > 0 else hi))
    return max(num_seeds + 1, math.ceil(num_seeds * (h / abs(diff)) ** 2))


def verdict(arm_a: str, arm_b: str, diff: Estimate, n_a: int, n_b: int, higher_is_better: bool,
            confidence: float = 0.95, max_seeds: int = 1000) -> str:
    """'A better than B: ...' when the CI of A - B excludes 0, else 'not decided at N seeds; ...'
    with `seeds_needed`."""
    if min(n_a, n_b) < 2:
        return "not decided: fewer than 2 seeds"
    if diff.lo > 0 or diff.hi < 0:
        better, worse = (arm_a, arm_b) if (diff.lo > 0) == higher_is_better else (arm_b, arm_a)
        return f"{better} better than {worse}: the {confidence:.0%} CI of the difference excludes 0"
    seeds = str(n_a) if n_a == n_b else f"{n_a} and {n_b}"
    m = seeds_needed(diff.point, diff.lo, diff.hi, max(n_a, n_b))
    if m is None:
        return f"not decided at {seeds} seeds; no difference measured"
    if m > max_seeds:
        return f"not decided at {seeds} seeds; > {max_seeds} seeds per arm"
    return f"not decided at {seeds} seeds; ~{m} seeds per arm might decide it"


def compare_arms(arm_a: str, arm_b: str, scores_a: Mapping[str, Sequence[float]],
                 scores_b: Mapping[str, Sequence[float]], *, reps: int = DEFAULT_REPS,
                 seed: int = DEFAULT_SEED, confidence: float = 0.95,
                 quantities: Mapping[str, Quantity] = QUANTITY) -> list[PairComparison]:
    """Each quantity both arms have finite values of (in QUANTITIES order): IQM difference and
    probability of improvement with stratified-bootstrap CIs (each arm resampled on its own), and
    the verdict. Quantities with the same seed counts share one bootstrap (as separate tasks)."""
    keys = [k for k in quantities if k in scores_a and k in scores_b]
    fa = {k: _finite(scores_a[k]) for k in keys}
    fb = {k: _finite(scores_b[k]) for k in keys}
    keys = [k for k in keys if fa[k].size and fb[k].size]
    sign = {k: 1.0 if quantities[k].higher_is_better else -1.0 for k in keys}
    n = {k: min(fa[k].size, fb[k].size) for k in keys}
    diff = {k: Estimate(_point(fa[k], k, quantities) - _point(fb[k], k, quantities), math.nan, math.nan, n[k]) for k in keys}
    poi = {k: Estimate(float(metrics.probability_of_improvement(sign[k] * fa[k][:, None],
                                                                sign[k] * fb[k][:, None])),
                       math.nan, math.nan, n[k]) for k in keys}
    groups: dict[tuple[int, int], list[str]] = {}
    for k in keys:
        if n[k] >= 2:
            groups.setdefault((fa[k].size, fb[k].size), []).append(k)
    for ks in groups.values():
        use_mean = np.asarray([quantities[k].aggregate == "mean" for k in ks])
        s = np.asarray([sign[k] for k in ks])

        def func(a, b, use_mean=use_mean, s=s):
            return np.concatenate([_aggregate_columns(a, use_mean) - _aggregate_columns(b, use_mean),
                                   poi_columns(s * a, s * b)])

        ci = _interval((np.stack([fa[k] for k in ks], 1), np.stack([fb[k] for k in ks], 1)), func,
                       reps, seed, confidence)
        for i, k in enumerate(ks):
            diff[k].lo, diff[k].hi = float(ci[0, i]), float(ci[1, i])
            poi[k].lo, poi[k].hi = float(ci[0, len(ks) + i]), float(ci[1, len(ks) + i])
    return [PairComparison(arm_a, arm_b, k, diff[k], poi[k],
                           verdict(arm_a, arm_b, diff[k], fa[k].size, fb[k].size,
                                   quantities[k].higher_is_better, confidence)) for k in keys]


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
    reps: int = DEFAULT_REPS
    seed: int = DEFAULT_SEED
    confidence: float = 0.95


def seed_statistics(runs: Mapping[str, Sequence[RunQuantities]], *,
                    pairs: Sequence[tuple[str, str]] | None = None, reps: int = DEFAULT_REPS,
                    seed: int = DEFAULT_SEED, confidence: float = 0.95) -> SeedStatistics:
    """`arm_estimates` of every arm and `compare_arms` of `pairs` (default `arm_pairs`). Raises
    UnknownArmError for a pair naming an arm that is not in `runs`."""
    unknown = sorted({a for p in pairs or () for a in p} - set(runs))
    if unknown:
        raise UnknownArmError(f"pairs name unknown arm(s) {', '.join(unknown)}; arms: {', '.join(runs)}")
    scores = {arm: {q.key: [r.value(q.key) for r in rs] for q in QUANTITIES} for arm, rs in runs.items()}
    opts = dict(reps=reps, seed=seed, confidence=confidence)
    pairs = arm_pairs(list(runs)) if pairs is None else pairs
    return SeedStatistics(
        {arm: list(rs) for arm, rs in runs.items()},
        {arm: arm_estimates(s, **opts) for arm, s in scores.items()},
        [c for a, b in pairs for c in compare_arms(a, b, scores[a], scores[b], **opts)],
        reps, seed, confidence)
