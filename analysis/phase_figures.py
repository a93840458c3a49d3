"""The phase diagram figure (issue 47): realised per-layer flip rate on a log x axis; top panel, the final-reward
drop against each method's own zero-drift arm (paired by seed, mean with a seed-bootstrap 95% CI) and its critical
mismatch; bottom panel, one row per method, colour = the drop at each dose, the failure count written in. The
rollout precisions (bf16, FP8, W8A8 arms of GRPO-none) and the papers' ~10% are marked on the same axis. Matplotlib
`Figure` objects (no pyplot state); `write_figures` saves PNGs.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import seaborn as sns
from matplotlib.colors import TwoSlopeNorm
from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter

from analysis.figure_kit import save_png
from analysis.phase_runs import PhaseRun
from analysis.phase_stats import (
    GRPO, REWARD_DROP, ZERO_DOSE, arms, dose_x, drop_ci, fit_method, ladder, shared_boot_seeds,
)

PAPER_FLIPS = 0.10
PRECISIONS = ("bf16", "fp8", "w8a8")


def _zero_x(xs: list[float]) -> float:
    pos = [x for x in xs if x > 0]
    return (min(pos) / 3) if pos else 1e-3


def phase_figure(runs: list[PhaseRun], *, reps: int = 2000, seed: int = 0) -> Figure:
    by_method = arms(runs)
    boot = shared_boot_seeds({m: a for m, a in by_method.items() if ZERO_DOSE in a}, reps, seed)
    methods = [m for m, a in by_method.items() if ZERO_DOSE in a and len(ladder(a)) >= 2]
    all_x = [dose_x(a[d]) for a in by_method.values() for d in ladder(a) if d != ZERO_DOSE]
    x0 = _zero_x(all_x)
    fig = Figure(figsize=(10.0, 3.2 + 0.45 * max(len(methods), 1) + 2.6), dpi=100, layout="constrained")
    ax, heat = fig.subplots(2, 1, height_ratios=[3.0, 0.5 + 0.45 * max(len(methods), 1)], sharex=True)
    palette = dict(zip(methods, sns.color_palette("tab10", n_colors=max(len(methods), 1))))
    norm = TwoSlopeNorm(vmin=-0.5, vcenter=0.0, vmax=0.2)
    cmap = sns.color_palette("RdBu", as_cmap=True)
    for row, method in enumerate(methods):
        marms = by_method[method]
        fit = fit_method(method, marms, reps=reps, seed=seed, boot_seeds=boot if boot.size else None)
        zero = marms[ZERO_DOSE]
        xs, ys, lo, hi = [], [], [], []
        for d in fit.doses:
            arm = marms[d]
            e = drop_ci(arm, zero, reps=reps, seed=seed, method=method, dose=d)
            x = x0 if d == ZERO_DOSE else dose_x(arm)
            xs.append(x), ys.append(e.point), lo.append(e.lo), hi.append(e.hi)
            fails = sum(r.failed for r in arm.values())
            heat.scatter([x], [row], s=420, marker="s", color=cmap(norm(e.point)) if math.isfinite(e.point) else "0.8",
                         edgecolor="0.3")
            heat.text(x, row, f"{fails}/{len(arm)}", ha="center", va="center", fontsize=7)
        ys_a = np.asarray(ys)
        err = np.asarray([ys_a - np.asarray(lo), np.asarray(hi) - ys_a])
        err = np.where(np.isfinite(err), err, 0.0)
        ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, color=palette[method], label=method)
        if math.isfinite(fit.critical.value):
            ax.axvline(fit.critical.value, color=palette[method], ls=":", lw=1.2)
    ax.axhline(-REWARD_DROP, color="0.4", ls="--", lw=1, label=f"drop of {REWARD_DROP:g} (critical level)")
    ax.axhline(0.0, color="0.7", lw=0.8)
    ax.axvline(PAPER_FLIPS, color="k", lw=1.5, alpha=0.5, label="papers' Qwen3-30B-A3B (~10%)")
    grpo = by_method.get(GRPO, {})
    for d, mark in zip(PRECISIONS, ("v", "s", "D")):
        if d in grpo:
            ax.plot([dose_x(grpo[d])], [0.02], marker=mark, color="k", ls="none",
                    label=f"{d} rollouts (GRPO-none, measured)")
    ax.set_xscale("log")
    ax.set(ylabel="final reward − same method at zero drift",
           title="Routing-drift phase diagram: final-reward drop against the realised per-layer flip rate")
    ax.legend(fontsize="x-small", loc="lower left")
    heat.set_yticks(range(len(methods)), methods, fontsize=8)
    heat.set_ylim(-0.6, len(methods) - 0.4)
    heat.invert_yaxis()
    ticks = sorted({x0, *[x for x in all_x if x > 0]})
    heat.set_xticks(ticks, ["0" if t == x0 else f"{100 * t:.2g}%" for t in ticks], fontsize=7, rotation=45)
    heat.xaxis.set_minor_formatter(NullFormatter())  # a range under a decade would label log minor ticks over these
    heat.set_xlabel("realised per-layer flip rate (rollout vs learner, log scale; '0' = no drift); cell colour = "
                    "drop (blue none, red worse), text = runs failed")
    return fig


def write_figures(runs: list[PhaseRun], out_dir: str | Path, *, reps: int = 2000, seed: int = 0) -> list[Path]:
    return [save_png(phase_figure(runs, reps=reps, seed=seed), out_dir, "phase_diagram.png")]
