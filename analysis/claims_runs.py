"""The claims page's runs: names, loading / saving the metrics it reads, and per-run scalars.

Runs are named by `moe_gspo.ablate` `<algo>-<replay>-<variant>-s<seed>`: algo grpo or gspo, replay
none / r2 / r3, variant a drift level (fp32 < bf16 < fp8 < w8a8) optionally with a method suffix
(`w8a8_tis`: GRPO with token-level truncated importance sampling). Numbers per run come from
`metrics.jsonl` only (the keys of `CLAIM_KEYS`), so the page regenerates from `save_metrics`' file.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from analysis.load import RunData, finite_mean, matrix_series, series
from analysis.matrix_runs import load_matrix_runs, save_records
from analysis.seed_report import reward_and_zero_std, run_quantities
from moe_gspo.algos.collapse import FailureCriteria, FailureEvent, detect_failure

RUN_RE = re.compile(r"^(?P<algo>[a-z_]+)-(?P<replay>none|r2|r3)-(?P<variant>[A-Za-z0-9_.]+)-s(?P<seed>\d+)$")
DRIFT_LEVELS = ("fp32", "bf16", "fp8", "w8a8")
"""Rollout precision, weakest routing drift first: fp32 (none), bf16, FP8 weights, FP8 weights + activations."""

CLAIM_KEYS = ("step", "reward/mean", "mismatch/k3_kl", "mismatch_replayed/k3_kl", "mismatch/extreme_frac_ln2",
              "mismatch_replayed/extreme_frac_ln2", "routing/layer_disagree", "routing/any_layer_flip",
              "ratio/token_var", "ratio/seq_var", "update/expert_change_frac", "update/any_layer_change",
              "update/layer_change", "actor/entropy", "reward/frac_zero_std", "train/lr")
"""The metrics the claims read: `--save-metrics` keeps only these (a few % of metrics.jsonl)."""


def drift_level(variant: str) -> str:
    """'w8a8_tis' -> 'w8a8' (the part before the first '_')."""
    return variant.split("_", 1)[0]


def level_rank(level: str) -> int:
    """Position in DRIFT_LEVELS (unknown levels after them)."""
    return DRIFT_LEVELS.index(level) if level in DRIFT_LEVELS else len(DRIFT_LEVELS)


def method_of(arm: str) -> str:
    """The arm without its drift level: 'grpo-none-w8a8_tis' -> 'grpo-none+tis', 'gspo-none-fp8' -> 'gspo-none'."""
    algo, replay, variant = arm.split("-", 2)
    suffix = variant.split("_", 1)[1] if "_" in variant else ""
    return f"{algo}-{replay}" + (f"+{suffix}" if suffix else "")


def arm_level(arm: str) -> str:
    return drift_level(arm.split("-", 2)[2])


# --------------------------------------------------------------------------- loading

def load_runs(source: str | Path) -> list[RunData]:
    """The finished runs (with done.json) of a matrix directory, or those saved by `save_metrics`."""
    return load_matrix_runs(source, RUN_RE, matrix="the matrix's out_dir", names="<algo>-<replay>-<variant>-s<seed>")


def save_metrics(runs: list[RunData], path: str | Path) -> None:
    """One gzip'd JSON line per run with the `CLAIM_KEYS` of its records (temp file, then rename)."""
    save_records(runs, path, CLAIM_KEYS)


# --------------------------------------------------------------------------- per run

def _mean(run: RunData, key: str) -> float:
    return finite_mean(series(run.records, key)[1])


def _last10(run: RunData, key: str) -> float:
    vals = series(run.records, key)[1]
    return finite_mean(vals[-max(1, vals.size // 10):]) if vals.size else math.nan


def k3_step_ratio_median(run: RunData) -> float:
    """Median over steps of mismatch/k3_kl / mismatch_replayed/k3_kl (steps where both are > 0)."""
    steps_n, nat = series(run.records, "mismatch/k3_kl")
    steps_r, rep = series(run.records, "mismatch_replayed/k3_kl")
    by_step = dict(zip(steps_r.tolist(), rep.tolist()))
    ratios = [n / by_step[s] for s, n in zip(steps_n.tolist(), nat.tolist())
              if s in by_step and n > 0 and by_step[s] > 0]
    return float(np.median(ratios)) if ratios else math.nan


def expert_change(run: RunData) -> dict[str, float]:
    """update/expert_change_frac without step 0 (Adam's first step alone moves ~half the experts): the mean
    over all measured steps > 0, over those at the run's maximum train/lr (constant lr) and over those below
    it (the lr decay); NaN where no step qualifies (no train/lr logged: both splits NaN)."""
    steps, frac = series(run.records, "update/expert_change_frac")
    ok = np.isfinite(frac) & (steps != 0)
    lr_steps, lr = series(run.records, "train/lr")
    lr_by_step = dict(zip(lr_steps.tolist(), lr.tolist()))
    lr_at = np.asarray([lr_by_step.get(s, math.nan) for s in steps.tolist()], np.float64)
    out = {"update_change": finite_mean(frac[ok]), "update_change_const": math.nan, "update_change_decay": math.nan}
    if np.isfinite(lr).any():
        top = float(np.nanmax(np.where(np.isfinite(lr), lr, np.nan)))
        out["update_change_const"] = finite_mean(frac[ok & (lr_at >= top)])
        out["update_change_decay"] = finite_mean(frac[ok & (lr_at < top)])
    return out


def num_moe_layers(run: RunData) -> int:
    """Length of the per-layer lists (routing/layer_disagree, else update/layer_change); 0 when neither."""
    for key in ("routing/layer_disagree", "update/layer_change"):
        _, m = matrix_series(run.records, key)
        if m.size:
            return int(m.reshape(m.shape[0], -1).shape[1])
    return 0


def _layer_mean(run: RunData, key: str) -> float:
    """Mean over steps of the mean over layers (a float-valued metric: its mean)."""
    _, m = matrix_series(run.records, key)
    if m.size:
        return finite_mean(m.reshape(m.shape[0], -1).mean(axis=1))
    return _mean(run, key)


@dataclass
class ClaimRun:
    name: str
    arm: str
    seed: int
    scores: dict[str, float]
    failure: FailureEvent
    duration: float
    """Step number of the failure, or of the last step when censored."""
    observed: bool


def failure_of(run: RunData, criteria: FailureCriteria = FailureCriteria()) -> tuple[FailureEvent, float, bool]:
    """(`detect_failure` on the finite-reward steps, failure or censoring step number, failed?)."""
    steps = series(run.records, "reward/mean")[0]
    reward, zero_std = reward_and_zero_std(run)
    keep = np.isfinite(reward)
    ev = detect_failure(reward[keep], zero_std[keep], criteria)
    kept = steps[keep]
    if kept.size == 0:
        return ev, math.nan, False
    return ev, float(kept[ev.step if ev.step is not None else ev.censored_at]), ev.kind is not None


def claim_run(run: RunData) -> ClaimRun | None:
    """The per-run scalars of a run named like `RUN_RE` (None otherwise)."""
    m = RUN_RE.match(run.source.name)
    if not m:
        return None
    q = run_quantities(run)
    ev, duration, observed = failure_of(run)
    k3_nat, k3_rep = _mean(run, "mismatch/k3_kl"), _mean(run, "mismatch_replayed/k3_kl")
    _, tok = series(run.records, "ratio/token_var")
    _, seq = series(run.records, "ratio/seq_var")
    ok = np.isfinite(tok) & np.isfinite(seq) & (seq > 0)
    scores = {
        "final_reward": q.final_reward, "reward_auc": q.reward_auc, "failed": float(observed),
        "collapse": float(ev.kind == "collapse"), "stall": float(ev.kind == "stall"),
        "k3_natural": k3_nat, "k3_replayed": k3_rep,
        "k3_ratio_of_means": k3_nat / k3_rep if k3_rep > 0 else math.nan,
        "k3_ratio_median": k3_step_ratio_median(run),
        "k3_nat_minus_rep": k3_nat - k3_rep,
        "layer_disagree": _layer_mean(run, "routing/layer_disagree"),
        "any_layer_flip": _mean(run, "routing/any_layer_flip"),
        "var_quotient": float(np.median(tok[ok] / seq[ok])) if ok.any() else math.nan,
        "num_moe_layers": float(num_moe_layers(run)),
        "final_entropy": _last10(run, "actor/entropy"), "final_zero_std": _last10(run, "reward/frac_zero_std"),
        **expert_change(run),
    }
    return ClaimRun(run.source.name, f"{m['algo']}-{m['replay']}-{m['variant']}", int(m["seed"]), scores, ev,
                    duration, observed)


def load_arms(source: str | Path | list[RunData]) -> dict[str, list[ClaimRun]]:
    """{arm: its runs (by seed)} of `source` (a directory, a saved .jsonl.gz, or loaded runs), arms sorted."""
    runs = load_runs(source) if not isinstance(source, list) else source
    arms: dict[str, list[ClaimRun]] = {}
    for run in runs:
        c = claim_run(run)
        if c is not None:
            arms.setdefault(c.arm, []).append(c)
    return {a: sorted(rs, key=lambda r: r.seed) for a, rs in sorted(arms.items())}
