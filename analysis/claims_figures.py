"""Figures of the claims page: Kaplan-Meier time to failure per arm, and the dose-response figure
(failure rate with Clopper-Pearson error bars, and Kaplan-Meier median time to failure, against the
drift level, one line per method). Matplotlib `Figure` objects (no pyplot state); `write_figures`
saves them as PNGs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import seaborn as sns
from matplotlib.figure import Figure

from analysis import stats as st
from analysis.claims_runs import ClaimRun, arm_level, level_rank, method_of
from analysis.claims_stats import arm_survival, failure_rate


def km_figure(curves: Mapping[str, st.Survival], title: str) -> Figure:
    """One panel: the Kaplan-Meier survival (no failure yet) of each arm, censored runs marked '+'."""
    fig = Figure(figsize=(6.4, 4.0), dpi=100, layout="constrained")
    ax = fig.subplots()
    for color, (arm, s) in zip(sns.color_palette("tab10", n_colors=max(len(curves), 1)), curves.items()):
        if s.timeline.size == 0:
            continue
        ax.step(s.timeline, s.survival, where="post", color=color,
                label=f"{arm} ({int(s.observed.sum())}/{s.durations.size} failed)")
        cens = s.durations[~s.observed]
        if cens.size:
            y = np.interp(cens, s.timeline, s.survival)
            ax.plot(cens, y, "+", color=color, markersize=8)
    ax.set(xlabel="training step", ylabel="fraction of runs not failed (Kaplan-Meier)", ylim=(-0.03, 1.03),
           title=title)
    ax.legend(fontsize="x-small")
    return fig


def dose_response_figure(arms: Mapping[str, list[ClaimRun]]) -> Figure:
    """Two panels against the drift level: failure rate (Clopper-Pearson 95% error bars) and Kaplan-Meier
    median time to failure (hollow marker at the last step where the median is not reached)."""
    methods: dict[str, list[str]] = {}
    for arm in arms:
        methods.setdefault(method_of(arm), []).append(arm)
    levels = sorted({arm_level(a) for a in arms}, key=level_rank)
    x_of = {lv: i for i, lv in enumerate(levels)}
    fig = Figure(figsize=(11.0, 4.0), dpi=100, layout="constrained")
    ax_rate, ax_time = fig.subplots(1, 2)
    palette = sns.color_palette("tab10", n_colors=max(len(methods), 1))
    for k, (color, (method, members)) in enumerate(zip(palette, methods.items())):
        members = sorted(members, key=lambda a: level_rank(arm_level(a)))
        x = np.asarray([x_of[arm_level(a)] for a in members], float) + 0.04 * (k - len(methods) / 2)
        rates = [failure_rate(arms[a]) for a in members]
        pts = np.asarray([r.point for r in rates])
        err = np.asarray([[r.point - r.lo for r in rates], [r.hi - r.point for r in rates]])
        ax_rate.errorbar(x, pts, yerr=err, marker="o", capsize=3, color=color, label=method)
        surv = [arm_survival(arms[a]) for a in members]
        med = np.asarray([s.median for s in surv])
        last = np.asarray([s.durations.max() if s.durations.size else math.nan for s in surv])
        reached = np.isfinite(med)
        ax_time.plot(x, np.where(reached, med, last), color=color, label=method)
        ax_time.plot(x[reached], med[reached], "o", color=color)
        ax_time.plot(x[~reached], last[~reached], "o", mfc="none", color=color)
    for ax in (ax_rate, ax_time):
        ax.set_xticks(range(len(levels)), levels)
        ax.set_xlabel("rollout precision (routing drift, weakest first)")
        ax.legend(fontsize="x-small")
    ax_rate.set(ylabel="failure (collapse or stall) rate", ylim=(-0.03, 1.03),
                title="Failure rate (95% Clopper–Pearson)")
    ax_time.set(ylabel="median time to failure (steps)",
                title="KM median time to failure (hollow: not reached)")
    return fig


def claim_figures(arms: Mapping[str, list[ClaimRun]]) -> dict[str, Figure]:
    """{file stem: figure}: the dose-response figure and, per drift level, the KM curves of its arms."""
    figs = {"dose_response": dose_response_figure(arms)}
    for lv in sorted({arm_level(a) for a in arms}, key=level_rank):
        members = {a: arm_survival(rs) for a, rs in arms.items() if arm_level(a) == lv}
        figs[f"km_{lv}"] = km_figure(members, f"Time to failure, {lv} rollouts")
    return figs


def write_figures(arms: Mapping[str, list[ClaimRun]], out_dir: str | Path) -> list[Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for stem, fig in claim_figures(arms).items():
        path = out_dir / f"{stem}.png"
        fig.savefig(path)
        paths.append(path)
    return paths
