"""The phase diagram's runs: names, per-run scalars, loading and saving the metrics they come from (issue 47).

A phase matrix (`moe_gspo.ablate`, e.g. configs/ablation_phase.yaml) names its runs
`<algo>-<replay>-<variant>-s<seed>`, the variant `<dose>[_<fix>]`: the dose a label of the drift it sets (the
routing-drift dial by the dose-naming rule of `moe_gspo.run.dose_names`: `p0` zero drift, `p<N>` flip probability
N/100, `s<X>` noise std X, all on the realised-flip axis below; or a rollout precision such as bf16 or w8a8),
the optional fix a method suffix (`tis`: token-level truncated importance sampling). A *method* is the arm
without its dose (`grpo-none`, `grpo-r3`, `grpo-none+tis`, `gspo-none`). The dose axis is the **realised**
mismatch each run measured, not the dial's setting: `routing/layer_disagree` (share of response tokens whose
top-k expert set differs between the rollout engine and the learner's natural routing, per MoE layer, mean over
layers and steps) and `mismatch/k3_kl` (mean over steps).

Per-run scalars (the pre-registered endpoints, docs/paper_claims.md "Pre-registration of experiment 3"):
- `final_reward`: mean `reward/mean` over the last 10% of steps; `reward_auc`: mean over all steps;
- `entropy_collapse`: the first step at which the trailing `ENTROPY_WINDOW`-step mean of `actor/entropy` is below
  `ENTROPY_FLOOR` and the trailing reward stays below `SOLVED` from then to the end (a policy turned nearly
  deterministic on a partly wrong answer and never solved the task; a dip on the way to solving it is none),
  censored at the last step when it never does;
- `failed`: `moe_gspo.algos.collapse.detect_failure` with `FAILURE_V2` (the pre-registered detector plus its
  end-of-run miss fixed: a trailing reward that ends at or below `dead_reward`, the run never solved, counts).

Numbers per run come from `metrics.jsonl` only (`PHASE_KEYS`), so the saved metrics regenerate the page.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from analysis.load import ReportInputError, RunData, finite_mean, matrix_series, series
from analysis.matrix_runs import load_matrix_runs, save_records
from moe_gspo.algos.collapse import FailureCriteria, detect_failure, trailing_mean
from moe_gspo.run.dose_names import DIAL_DOSE, DOSE_RULE, ZERO_DOSE, split_variant  # noqa: F401 (split_variant: API)

RUN_RE = re.compile(r"^(?P<algo>[a-z_]+)-(?P<replay>none|r2|r3)-(?P<variant>[A-Za-z0-9_.]+)-s(?P<seed>\d+)$")

PHASE_KEYS = ("step", "reward/mean", "reward/frac_zero_std", "actor/entropy", "mismatch/k3_kl",
              "mismatch_replayed/k3_kl", "routing/layer_disagree", "routing/any_layer_flip", "routing/dial_flip_frac",
              "routing/dial_flip_prob", "routing/dial_noise_std", "r3/replay_mismatch_frac",
              "update/expert_change_frac", "update_all_minibatches/expert_change_frac", "train/lr", "eval/accuracy")
"""The metrics the phase page reads: `--save-metrics` keeps only these."""

ENTROPY_WINDOW = 10
ENTROPY_FLOOR = 0.05
"""nats per token: below it (trailing mean) a policy samples nearly one answer per prompt."""
SOLVED = 0.9
FAILURE_V2 = FailureCriteria(dead_reward=0.1)
"""The pre-registered failure detector of experiments 1-2 with its end-of-run miss fixed (`dead_reward`)."""


def check_dose_names(runs: list[PhaseRun]) -> None:
    """ReportInputError naming the dose-naming rule (`moe_gspo.run.dose_names`) when no method has both a zero-dose
    arm (`p0`) and a dosed one (`p<N>`, `s<X>`): nothing on the page could be fitted or tested."""
    by_method: dict[str, set[str]] = {}
    for r in runs:
        by_method.setdefault(r.method, set()).add(r.dose)
    if any(ZERO_DOSE in d and any(x != ZERO_DOSE and DIAL_DOSE.match(x) for x in d) for d in by_method.values()):
        return
    found = "; ".join(f"{m}: {', '.join(sorted(d))}" for m, d in sorted(by_method.items()))
    raise ReportInputError(f"no method has a zero-dose arm ({ZERO_DOSE}) and a dosed one, so there is nothing to fit; "
                           f"doses found: {found}. Name the variants by {DOSE_RULE}")


def method_of(algo: str, replay: str, fix: str) -> str:
    return f"{algo}-{replay}" + (f"+{fix}" if fix else "")


def _series_mean(run: RunData, key: str) -> float:
    return finite_mean(series(run.records, key)[1])


def layer_mean(run: RunData, key: str) -> float:
    """Mean over steps of the mean over MoE layers of a per-layer metric."""
    _, m = matrix_series(run.records, key)
    if m.size:
        return finite_mean(m.reshape(m.shape[0], -1).mean(axis=1))
    return _series_mean(run, key)


def entropy_collapse(run: RunData) -> tuple[float, bool]:
    """(step of the entropy collapse, True) or (last step, False): module docstring."""
    steps, ent = series(run.records, "actor/entropy")
    r_steps, reward = series(run.records, "reward/mean")
    if steps.size == 0 or r_steps.size == 0:
        return math.nan, False
    by_step = dict(zip(r_steps.tolist(), reward.tolist()))
    rew = np.asarray([by_step.get(s, math.nan) for s in steps.tolist()], np.float64)
    h, r = trailing_mean(ent, ENTROPY_WINDOW), trailing_mean(rew, ENTROPY_WINDOW)
    never_solved_after = np.maximum.accumulate(np.where(np.isfinite(r), r, -np.inf)[::-1])[::-1] < SOLVED
    hit = np.flatnonzero(np.isfinite(h) & (h < ENTROPY_FLOOR) & never_solved_after)
    return (float(steps[hit[0]]), True) if hit.size else (float(steps[-1]), False)


@dataclass
class PhaseRun:
    name: str
    method: str
    dose: str
    seed: int
    scores: dict[str, float]
    collapse_step: float
    collapsed: bool
    failure_step: float
    failed: bool


def phase_run(run: RunData) -> PhaseRun | None:
    """The per-run scalars of a run named like `RUN_RE` (None otherwise)."""
    m = RUN_RE.match(run.source.name)
    if not m:
        return None
    dose, fix = split_variant(m["variant"])
    steps, reward = series(run.records, "reward/mean")
    keep = np.isfinite(reward)
    if not keep.any():
        return None
    reward, steps = reward[keep], steps[keep]
    zs_steps, zs = series(run.records, "reward/frac_zero_std")
    zs_by = dict(zip(zs_steps.tolist(), zs.tolist()))
    zero_std = np.asarray([zs_by.get(s, math.nan) for s in steps.tolist()], np.float64)
    ev = detect_failure(reward, zero_std, FAILURE_V2)
    failed = ev.kind is not None
    collapse_step, collapsed = entropy_collapse(run)
    n10 = max(1, reward.size // 10)
    scores = {
        "final_reward": float(reward[-n10:].mean()), "reward_auc": float(reward.mean()),
        "layer_disagree": layer_mean(run, "routing/layer_disagree"),
        "any_layer_flip": _series_mean(run, "routing/any_layer_flip"),
        "k3": _series_mean(run, "mismatch/k3_kl"), "k3_replayed": _series_mean(run, "mismatch_replayed/k3_kl"),
        "dial_flip_frac": _series_mean(run, "routing/dial_flip_frac"),
        "dial_flip_prob": _series_mean(run, "routing/dial_flip_prob"),
        "replay_mismatch": _series_mean(run, "r3/replay_mismatch_frac"),
        "final_entropy": finite_mean(series(run.records, "actor/entropy")[1][-n10:]),
        "expert_change": _series_mean(run, "update/expert_change_frac"),
        "expert_change_all": _series_mean(run, "update_all_minibatches/expert_change_frac"),
        "num_steps": float(reward.size),
    }
    return PhaseRun(run.source.name, method_of(m["algo"], m["replay"], fix), dose, int(m["seed"]), scores,
                    collapse_step, collapsed, float(steps[ev.step]) if failed else float(steps[-1]), failed)


# --------------------------------------------------------------------------- loading, saving

def load_runs(source: str | Path) -> list[RunData]:
    """The finished runs (with done.json) of a matrix directory, or those saved by `save_metrics`."""
    return load_matrix_runs(source, RUN_RE, matrix="the phase matrix's out_dir",
                            names="<algo>-<replay>-<dose>[_<fix>]-s<seed> (a run is finished when its done.json exists)")


def save_metrics(runs: list[RunData], path: str | Path) -> None:
    """One gzip'd JSON line per run with the `PHASE_KEYS` of its records (temp file, then rename)."""
    save_records(runs, path, PHASE_KEYS)


def load_phase(source: str | Path | list[RunData]) -> list[PhaseRun]:
    runs = load_runs(source) if not isinstance(source, list) else source
    out = [p for p in (phase_run(r) for r in runs) if p is not None]
    if not out:
        raise ReportInputError("none of the runs given has a reward curve (reward/mean in its metrics)")
    return sorted(out, key=lambda p: (p.method, p.dose, p.seed))
