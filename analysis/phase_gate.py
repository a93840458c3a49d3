"""The probe as a CI gate (issue 47, item 9): where a checkpoint's measured rollout/learner mismatch falls on a phase
diagram, and thresholds that fail the probe (`python -m moe_gspo.probe ... --phase DIR --max-k3 X --max-flip X
--max-critical-frac F`).

- `--phase DIR|FILE.jsonl.gz`: a phase matrix (`analysis.phase`); for every method with a critical mismatch x* the
  probe reports its per-layer flip rate as a fraction of x* (with x*'s CI), or says the method tolerated every
  dose tested (then the fraction of the largest dose tolerated, a lower bound on x*).
- `--max-k3 X`: fail when `mismatch/k3_kl` > X (prime-rl asks new models for mismatch KL < 0.015).
- `--max-flip X`: fail when the per-layer flip rate (mean over MoE layers of `routing/layer_disagree`, the phase
  diagram's axis) > X (Miles fails CI above 1% replay mismatch).
- `--max-critical-frac F` (needs --phase): fail when the flip rate exceeds F x the critical mismatch of
  `--phase-method` (default grpo-none); a method that tolerated every dose cannot fail this check.
One line per violated threshold; the probe then exits 1 (after writing its JSON).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from analysis.phase_runs import load_phase
from analysis.phase_stats import MethodFit, arms, fit_method, shared_boot_seeds, ZERO_DOSE


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
        by_method = arms(load_phase(source))
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
        out[f"phase/{m}/largest_tolerated"] = f.largest_tolerated
        out[f"phase/{m}/fraction_of_critical"] = x / f.critical.value if reached else None
    return out


def phase_lines(res: dict, fits: dict[str, MethodFit]) -> list[str]:
    x = flip_rate(res)
    lines = [f"on the phase diagram (per-layer flips {100 * x:.3g}%):"]
    for m, f in fits.items():
        if math.isfinite(f.critical.value):
            lo, hi = f.ci_log10
            ci = f" [{100 * 10 ** lo:.3g}%, {100 * 10 ** hi:.3g}%]" if math.isfinite(lo) else ""
            lines.append(f"  {m}: {x / f.critical.value:.2f} of its critical mismatch {100 * f.critical.value:.3g}%{ci}")
        else:
            lines.append(f"  {m}: tolerated every dose tested; this is {x / f.largest_tolerated:.2f} of the largest "
                         f"({100 * f.largest_tolerated:.3g}%)" if f.largest_tolerated > 0 else f"  {m}: no dose")
    return lines


def violations(res: dict, t: Thresholds, fits: dict[str, MethodFit] | None) -> list[str]:
    """One line per violated threshold (empty: the gate passes)."""
    out = []
    k3, x = res.get("mismatch/k3_kl"), flip_rate(res)
    if t.max_k3 is not None and k3 is not None and k3 > t.max_k3:
        out.append(f"gate: mismatch/k3_kl {k3:.3e} > --max-k3 {t.max_k3:g}")
    if t.max_flip is not None and x > t.max_flip:
        out.append(f"gate: per-layer flip rate {x:.4f} > --max-flip {t.max_flip:g}")
    if t.max_critical_frac is not None and fits is not None:
        f = fits[t.phase_method]
        if math.isfinite(f.critical.value) and x > t.max_critical_frac * f.critical.value:
            out.append(f"gate: per-layer flip rate {x:.4f} > --max-critical-frac {t.max_critical_frac:g} x "
                       f"{t.phase_method}'s critical mismatch {f.critical.value:.4f}")
    return out
