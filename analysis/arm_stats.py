"""Per-arm numbers of the ablation comparison that are more than one scalar per step and seed:
per-layer means of list-valued metrics, and the learner/rollout ratio variance against response
length pooled over an arm's seeds. Pure numpy on loaded runs / logprob traces (no plotting), so the
tests recompute them by hand; `analysis.compare` draws them.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from analysis.load import RunData, length_bin_edges, matrix_series, ratio_variance_by_length


@dataclass
class LayerMeans:
    """A per-layer metric of one arm: per seed the mean over its steps (finite values only), then
    the mean / min / max of those per-seed means across seeds."""

    mean_L: np.ndarray
    min_L: np.ndarray
    max_L: np.ndarray
    num_seeds: int
    """Seeds that logged the metric."""


def layer_means(runs: list[tuple[int, RunData]], key: str) -> LayerMeans | None:
    """Per-layer means of the list-valued `key` (e.g. `update/layer_change`, `routing/layer_disagree`:
    one value per MoE layer in each metrics.jsonl row); None when no seed logged it. A seed with fewer
    layers than another (should not happen within an arm) is NaN-padded."""
    per_seed = []
    for _, run in runs:
        steps, vals_SL = matrix_series(run.records, key)
        if steps.size == 0:
            continue
        vals_SL = np.where(np.isfinite(vals_SL), vals_SL, np.nan)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a layer null at every step
            per_seed.append(np.nanmean(vals_SL.reshape(vals_SL.shape[0], -1), axis=0))
    if not per_seed:
        return None
    num_layers = max(m.size for m in per_seed)
    arr_SL = np.full((len(per_seed), num_layers), np.nan)
    for i, m in enumerate(per_seed):
        arr_SL[i, :m.size] = m
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return LayerMeans(np.nanmean(arr_SL, 0), np.nanmin(arr_SL, 0), np.nanmax(arr_SL, 0), len(per_seed))


@dataclass
class ArmLengthVariance:
    """Ratio variance vs response length of one arm (see `arm_length_variance`)."""

    pooled: dict[str, np.ndarray]
    """`ratio_variance_by_length` of all the arm's seeds' traces pooled."""
    seed_min: dict[str, np.ndarray]
    """Per bin, the smallest per-seed value (seeds with ≥ 2 responses in the bin), for
    `token_var` and `seq_norm_var`; NaN where no seed has one."""
    seed_max: dict[str, np.ndarray]
    num_seeds: int
    """Seeds with at least one readable logprob trace with a non-empty response."""


def arm_length_variance(arm_sets: dict[str, list[list[dict[str, np.ndarray]]]], num_bins: int = 6
                        ) -> tuple[np.ndarray, dict[str, ArmLengthVariance]]:
    """Learner/rollout token- and length-normalised sequence-ratio variance per response-length bin,
    per arm. `arm_sets` maps an arm to its seeds' logprob traces (one list of `load_logprobs` dicts
    per seed). The bins are the same for every arm: up to `num_bins` quantile bins of the lengths of
    all arms' responses together (`length_bin_edges`). Returns (edges, per-arm results); arms whose
    traces hold no non-empty response are left out. Raises ValueError when no arm has one."""
    everything = [s for seeds in arm_sets.values() for sets in seeds for s in sets]
    edges = length_bin_edges(everything, num_bins)
    out: dict[str, ArmLengthVariance] = {}
    for arm, seeds in arm_sets.items():
        per_seed = []
        for sets in seeds:
            try:
                per_seed.append(ratio_variance_by_length(sets, edges=edges))
            except ValueError:  # this seed's traces hold only empty responses
                continue
        if not per_seed:
            continue
        pooled = ratio_variance_by_length([s for sets in seeds for s in sets], edges=edges)
        lo, hi = {}, {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a bin no seed fills
            for key in ("token_var", "seq_norm_var"):
                stack = np.stack([s[key] for s in per_seed])
                lo[key], hi[key] = np.nanmin(stack, 0), np.nanmax(stack, 0)
        out[arm] = ArmLengthVariance(pooled, lo, hi, len(per_seed))
    return edges, out
