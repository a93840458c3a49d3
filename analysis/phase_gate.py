"""The probe as a CI gate (issue 47, item 9): where a checkpoint's measured rollout/learner mismatch falls on a phase
diagram, and thresholds that fail the probe (`python -m moe_gspo.probe ... --phase DIR --max-k3 X --max-flip X
--max-critical-frac F`).

- `--phase DIR|FILE.jsonl.gz`: a phase matrix (`analysis.phase`); for every method the probe reports its per-layer
  flip rate as a fraction of the critical mismatch x* (with x*'s CI) when x* was reached, or says that it was not
  reached at any dose tested; and the method's largest dose tolerated with the page's one meaning
  (`analysis.phase_stats.tolerated_by_ci`: the largest dose at which the paired final-reward drop's 95% CI lies above
  −0.1, as at every lower dose; "none shown" when the CI reaches −0.1 at the first dose).
- `--max-k3 X`: fail when `mismatch/k3_kl` > X (prime-rl asks new models for mismatch KL < 0.015).
- `--max-flip X`: fail when the per-layer flip rate (mean over MoE layers of `routing/layer_disagree`, the phase
  diagram's axis) > X (Miles fails CI above 1% replay mismatch).
- `--max-critical-frac F` (needs --phase), `CRITICAL_FRAC_RULE`: fail when the flip rate exceeds F x the critical
  mismatch x* of `--phase-method` (default grpo-none). When x* was not reached at any dose tested, the reference is
  the method's largest dose tolerated instead (one line says so; the gate fails above F x it); when no dose is
  tolerated either, the matrix cannot place the checkpoint and the gate fails with one line saying why.
One line per violated threshold; the probe then exits 1 (after writing its JSON).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from analysis.phase_runs import check_dose_names, load_phase
from analysis.phase_stats import (
    REWARD_DROP, MethodFit, ZERO_DOSE, arms, fit_method, shared_boot_seeds, tolerated_text,
)

CRITICAL_FRAC_RULE = (f"fail when the per-layer flip rate exceeds F x --phase-method's critical mismatch x*; if x* "
                      f"was not reached, F x its largest dose tolerated (the largest dose whose final-reward drop has "
                      f"its 95% CI above -{REWARD_DROP:g} there and below); if neither exists, fail (the matrix cannot "
                      "place the checkpoint)")
"""`--max-critical-frac F`'s rule, as `--help` and the README state it."""


@dataclass(frozen=True)
class Thresholds:
    max_k3: float | None = None
    max_flip: float | None = None
    max_critical_frac: float | None = None
    phase_method: str = "grpo-none"


def check_thresholds(t: Thresholds, *, have_phase: bool) -> None:
    """ValueError naming the flag and the fix for thresholds that cannot be used (before any compute)."""
    for flag, v in (("--max-k3", t.max_k3), ("--max-flip", t.max_flip), ("--max-critical-frac", t.max_critical_frac)):
        if v is not None and not (math.isfinite(v) and v >= 0):
            raise ValueError(f"{flag}={v}: give a finite number >= 0")
    if t.max_flip is not None and t.max_flip > 1:
        raise ValueError(f"--max-flip={t.max_flip}: a flip rate is a share in [0, 1] (1% = 0.01)")
    if t.max_critical_frac is not None and not have_phase:
        raise ValueError("--max-critical-frac needs --phase DIR (the phase matrix whose critical mismatch it scales)")


def load_fits(source: str, t: Thresholds, *, reps: int = 1000, seed: int = 0) -> dict[str, MethodFit]:
    """The critical mismatch of every method of a phase matrix (or its saved metrics); ValueError when none has
    a zero-dose arm and a dosed one, or `--phase-method` is not among them."""
    from analysis.load import ReportInputError

    try:
        runs = load_phase(source)
        check_dose_names(runs)  # no zero-dose and dosed arm: the one line names the dose-naming rule
        by_method = arms(runs)
    except ReportInputError as e:
        raise ValueError(f"--phase: {e}") from None
    boot = shared_boot_seeds({m: a for m, a in by_method.items() if ZERO_DOSE in a}, reps, seed)
    fits = {m: f for m, a in by_method.items()
            if (f := fit_method(m, a, reps=reps, seed=seed, boot_seeds=boot if boot.size else None)) is not None}
    if not fits:
        raise ValueError(f"--phase {source}: no method has a zero-drift arm ({ZERO_DOSE}) and a dosed one; pass the "
                         "out_dir of a phase matrix (e.g. configs/ablation_phase.yaml)")
    if t.max_critical_frac is not None and t.phase_method not in fits:
        raise ValueError(f"--phase-method {t.phase_method}: the phase matrix's methods are {', '.join(fits)}")
    return fits


def flip_rate(res: dict) -> float:
    v = res.get("routing/layer_disagree")
    vals = [float(x) for x in (v if isinstance(v, (list, tuple)) else [v]) if x is not None]
    return float(np.mean(vals)) if vals else math.nan


def phase_keys(res: dict, fits: dict[str, MethodFit]) -> dict:
    """`phase/<method>/...` keys for the probe's JSON: x*, its CI, and the probe's flip rate as a fraction of it."""
    x = flip_rate(res)
    out = {}
    for m, f in fits.items():
        reached = math.isfinite(f.critical.value)
        lo, hi = f.ci_log10
        out[f"phase/{m}/critical_flip"] = f.critical.value if reached else None
        out[f"phase/{m}/critical_flip_ci"] = [10 ** lo, 10 ** hi] if reached and math.isfinite(lo) else None
        tolerated = math.isfinite(f.largest_tolerated)
        out[f"phase/{m}/largest_tolerated"] = f.largest_tolerated if tolerated else None
        out[f"phase/{m}/fraction_of_critical"] = x / f.critical.value if reached else None
        out[f"phase/{m}/fraction_of_largest_tolerated"] = x / f.largest_tolerated if tolerated and f.largest_tolerated > 0 else None
    return out


def _not_reached(f: MethodFit) -> str:
    return f"critical mismatch not reached at any dose tested (up to {100 * float(np.max(f.x)):.3g}%)"


def phase_lines(res: dict, fits: dict[str, MethodFit]) -> list[str]:
    x = flip_rate(res)
    lines = [f"on the phase diagram (per-layer flips {100 * x:.3g}%):"]
    for m, f in fits.items():
        tolerated = f"largest dose tolerated {tolerated_text(f.largest_tolerated)}"
        if math.isfinite(f.largest_tolerated) and f.largest_tolerated > 0:
            tolerated += f" ({x / f.largest_tolerated:.2f} of it)"
        if math.isfinite(f.critical.value):
            lo, hi = f.ci_log10
            ci = f" [{100 * 10 ** lo:.3g}%, {100 * 10 ** hi:.3g}%]" if math.isfinite(lo) else ""
            lines.append(f"  {m}: {x / f.critical.value:.2f} of its critical mismatch {100 * f.critical.value:.3g}%{ci}; "
                         + tolerated)
        else:
            lines.append(f"  {m}: {_not_reached(f)}; {tolerated}")
    return lines


def gate_notes(t: Thresholds, fits: dict[str, MethodFit] | None) -> list[str]:
    """One line when `--max-critical-frac` does not scale x* (`CRITICAL_FRAC_RULE`): what it scales instead."""
    if t.max_critical_frac is None or fits is None or math.isfinite(fits[t.phase_method].critical.value):
        return []
    f = fits[t.phase_method]
    if not math.isfinite(f.largest_tolerated):
        return []  # a violation then (`violations`), with its own line
    return [f"gate: {t.phase_method}'s {_not_reached(f)}: --max-critical-frac scales its largest dose tolerated, "
            f"{tolerated_text(f.largest_tolerated)}, instead"]


def violations(res: dict, t: Thresholds, fits: dict[str, MethodFit] | None) -> list[str]:
    """One line per violated threshold (empty: the gate passes)."""
    out = []
    k3, x = res.get("mismatch/k3_kl"), flip_rate(res)
    if t.max_k3 is not None and k3 is not None and k3 > t.max_k3:
        out.append(f"gate: mismatch/k3_kl {k3:.3e} > --max-k3 {t.max_k3:g}")
    if t.max_flip is not None and x > t.max_flip:
        out.append(f"gate: per-layer flip rate {x:.4f} > --max-flip {t.max_flip:g}")
    if t.max_critical_frac is not None and fits is not None:  # CRITICAL_FRAC_RULE
        f, frac = fits[t.phase_method], t.max_critical_frac
        if math.isfinite(f.critical.value):
            if x > frac * f.critical.value:
                out.append(f"gate: per-layer flip rate {x:.4f} > --max-critical-frac {frac:g} x "
                           f"{t.phase_method}'s critical mismatch {f.critical.value:.4f}")
        elif math.isfinite(f.largest_tolerated):
            if x > frac * f.largest_tolerated:
                out.append(f"gate: per-layer flip rate {x:.4f} > --max-critical-frac {frac:g} x {t.phase_method}'s "
                           f"largest dose tolerated {f.largest_tolerated:.4f} (its {_not_reached(f)})")
        else:
            out.append(f"gate: --max-critical-frac cannot place this checkpoint: {t.phase_method}'s {_not_reached(f)}, "
                       f"and no dose is tolerated by the pre-registered rule (the drop's 95% CI reaches -{REWARD_DROP:g} "
                       "at the first dose); add seeds or doses to the matrix, or gate with --max-flip")
    return out
