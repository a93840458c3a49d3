"""The figures of `analysis.compare` (several runs grouped into arms; `analysis.compare_arms`).

Per arm: reward, entropy and zero-variance groups, clip fractions, SAPO's gate, new/old ratio variances, routing
drift, train-inference mismatch (natural routing next to the pass replaying the rollout routes), each a line =
mean over seeds with a min/max band (`seed_band`); learner/rollout ratio variance against response length from
the logprob traces; routing change per MoE layer as grouped bars; and issue 41's stability figures (F(tau), dead
experts, expert load over training), left out when no run logged their metric.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import seaborn as sns
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from analysis.arm_stats import arm_length_variance, layer_means
from analysis.compare_arms import Arms
from analysis.figure_kit import FigureSpec, SkipFigure, layer_axis_label, layer_labels, positive_or_nan
from analysis.figures import logprob_trace_paths, read_logprob_sets
from analysis.load import RunData, series
from analysis.stability_figures import (
    CURVE_KEY, CURVE_KEY_REPLAYED, DEAD_KEY, EXTREME_TAUS, LOAD_KEYS, draw_load_steps, f_tau_y_axis, load_steps,
    mean_curve, shown_layers, tau_axis,
)


def seed_band(runs: list[tuple[int, RunData]], key: str
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(steps, mean, min, max) across seeds of a scalar metric, on the union of logged steps
    (each step aggregates the seeds that logged a finite value there)."""
    per_seed = [dict(zip(*(a.tolist() for a in series(run.records, key)))) for _, run in runs]
    steps = np.asarray(sorted(set().union(*per_seed)) if per_seed else [], np.int64)
    if steps.size == 0:
        empty = np.zeros(0)
        return steps, empty, empty, empty
    vals = np.asarray([[d.get(s, math.nan) for s in steps.tolist()] for d in per_seed], np.float64)
    vals[~np.isfinite(vals)] = np.nan
    keep = np.isfinite(vals).any(axis=0)
    vals, steps = vals[:, keep], steps[keep]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return steps, np.nanmean(vals, 0), np.nanmin(vals, 0), np.nanmax(vals, 0)


def _arm_panel(ax, arms: Arms, key: str, ylabel: str, logy: bool = False) -> bool:
    drawn = False
    palette = sns.color_palette("tab10", n_colors=max(len(arms.runs), 1))
    bands = {arm: seed_band(runs, key) for arm, runs in arms.runs.items()}
    logy = logy and any(np.any(b[1] > 0) for b in bands.values())
    for color, (arm, runs) in zip(palette, arms.runs.items()):
        steps, mean, lo, hi = bands[arm]
        if steps.size == 0:
            continue
        if logy:
            mean, lo, hi = positive_or_nan(mean), positive_or_nan(lo), positive_or_nan(hi)
        ax.plot(steps, mean, color=color, label=f"{arm} (n={len(runs)})")
        if len(runs) > 1:
            ax.fill_between(steps, lo, hi, color=color, alpha=0.2, linewidth=0)
        drawn = True
    if drawn:
        if logy:
            ax.set_yscale("log")
        ax.legend(fontsize="x-small")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    else:
        ax.text(0.5, 0.5, f"'{key}' not logged", ha="center", va="center", transform=ax.transAxes)
    ax.set(title=key, xlabel="training step", ylabel=ylabel)
    return drawn


def _panels(arms: Arms, panels: list[tuple[str, str, bool]], title: str) -> Figure:
    keys = [p[0] for p in panels]
    if not any(k in r for runs in arms.runs.values() for _, run in runs for r in run.records
               for k in keys):
        raise SkipFigure(f"metric(s) {', '.join(keys)} missing from all runs")
    fig = Figure(figsize=(5.2 * len(panels), 3.6), dpi=100, layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (key, ylabel, logy) in zip(axes, panels):
        _arm_panel(ax, arms, key, ylabel, logy)
    fig.suptitle(title)
    return fig


def _palette(arms: Arms) -> dict[str, tuple]:
    return dict(zip(arms.runs, sns.color_palette("tab10", n_colors=max(len(arms.runs), 1))))


def fig_ratio_variance_length(arms: Arms) -> Figure:
    """Per arm, learner/rollout token-ratio and length-normalised sequence-ratio variance per
    response-length bin (bins shared by all arms), from the seeds' logprob traces pooled."""
    arm_sets = {}
    for arm, runs in arms.runs.items():
        per_seed = []
        for seed, run in runs:
            num_warnings = len(run.warnings)
            sets = read_logprob_sets(run)
            arms.notes += [f"{arm} seed {seed}: {w}" for w in run.warnings[num_warnings:]]
            if sets:
                per_seed.append(sets)
        if per_seed:
            arm_sets[arm] = per_seed
    if not arm_sets:
        what = ("every step_*_logprobs.npz file was unreadable"
                if any(logprob_trace_paths(run) for runs in arms.runs.values() for _, run in runs)
                else "no run has traces/step_*_logprobs.npz files (logging.trace_every 0 or traces missing)")
        raise SkipFigure(what)
    try:
        edges, per_arm = arm_length_variance(arm_sets)
    except ValueError as e:
        raise SkipFigure(str(e)) from e
    if not any(np.isfinite(v.pooled["token_var"]).any() for v in per_arm.values()):
        raise SkipFigure("fewer than 2 responses per length bin in every arm's logprob traces")
    fig = Figure(figsize=(10.4, 3.8), dpi=100, layout="constrained")
    axes = fig.subplots(1, 2)
    colors = _palette(arms)
    panels = (("token_var", "token ratio exp(d_t)"),
              ("seq_norm_var", "length-normalised sequence ratio exp(mean_t d_t)"))
    for ax, (key, title) in zip(axes, panels):
        for arm, v in per_arm.items():
            ok = np.isfinite(v.pooled[key])
            x = v.pooled["len_mid"][ok]
            ax.plot(x, positive_or_nan(v.pooled[key][ok]), marker="o", markersize=3, color=colors[arm],
                    label=f"{arm} (n={v.num_seeds})")
            if v.num_seeds > 1:
                ax.fill_between(x, positive_or_nan(v.seed_min[key][ok]), positive_or_nan(v.seed_max[key][ok]),
                                color=colors[arm], alpha=0.2, linewidth=0)
        if any(np.nanmax(v.pooled[key], initial=0) > 0 for v in per_arm.values()):
            ax.set_yscale("log")
        ax.legend(fontsize="x-small")
        ax.set(title=title, xlabel="response length (tokens, arm's bin mean)", ylabel="variance (unitless)")
    bins = ", ".join(f"[{edges[i]:g}, {edges[i + 1]:g}{']' if i == edges.size - 2 else ')'}"
                     for i in range(edges.size - 1))
    fig.suptitle(f"Learner/rollout ratio variance vs response length; bins {bins}", fontsize="medium")
    return fig


_LAYER_KEYS = (("update/layer_change", "old→new policy change (update/layer_change)"),
               ("routing/layer_disagree", "rollout vs learner (routing/layer_disagree)"))


def arm_layer_labels(arms: Arms, num_layers: int) -> list[str]:
    for runs in arms.runs.values():
        for _, run in runs:
            if run.traces:
                return layer_labels(run, num_layers)
    return [str(i) for i in range(num_layers)]


def all_layer_means(arms: Arms) -> tuple[dict[str, dict], int]:
    means = {key: {arm: layer_means(runs, key) for arm, runs in arms.runs.items()} for key, _ in _LAYER_KEYS}
    num_layers = max((m.mean_L.size for per_arm in means.values() for m in per_arm.values() if m), default=0)
    return means, num_layers


def fig_layer_change(arms: Arms) -> Figure:
    """Grouped bars: per MoE layer and arm, the mean over steps then seeds (error bar: seed min/max)."""
    means, num_layers = all_layer_means(arms)
    if num_layers == 0:
        raise SkipFigure(f"per-layer metrics {', '.join(k for k, _ in _LAYER_KEYS)} missing from all runs")
    labels = arm_layer_labels(arms, num_layers)
    width = min(20.0, 1.6 * max(5.0, 0.25 * num_layers * len(arms.runs) + 2.5))
    fig = Figure(figsize=(width, 3.8), dpi=100, layout="constrained")
    axes = fig.subplots(1, 2)
    colors, width = _palette(arms), 0.8 / max(len(arms.runs), 1)
    for ax, (key, title) in zip(axes, _LAYER_KEYS):
        drawn = False
        for i, (arm, m) in enumerate(means[key].items()):
            if m is None:
                continue
            x = np.arange(m.mean_L.size) - 0.4 + width * (i + 0.5)
            err = (np.stack([m.mean_L - m.min_L, m.max_L - m.mean_L]) if m.num_seeds > 1 else None)
            ax.bar(x, m.mean_L, width, yerr=err, capsize=2, color=colors[arm], label=f"{arm} (n={m.num_seeds})")
            drawn = True
        if drawn:
            ax.legend(fontsize="x-small")
        else:
            ax.text(0.5, 0.5, f"'{key}' not logged", ha="center", va="center", transform=ax.transAxes)
        ax.set_xticks(np.arange(num_layers), labels)
        ax.set(title=title, xlabel=layer_axis_label(labels), ylabel="fraction of tokens")
    fig.suptitle("Routing change per MoE layer (mean over steps, then seeds; bars: seed min/max)")
    return fig


COMPARE_FIGURES: list[FigureSpec] = [
    FigureSpec("cmp_reward", "Reward per arm",
               "reward/mean: line = mean over seeds, band = min/max across seeds.",
               lambda a: _panels(a, [("reward/mean", "reward (task units)", False)], "Reward")),
    FigureSpec("cmp_collapse", "Entropy and zero-variance groups per arm",
               "actor/entropy (mean token entropy of the old-policy pass over response tokens) and "
               "reward/frac_zero_std (share of prompt groups whose rewards are all equal, i.e. no learning "
               "signal): line = mean over seeds, band = min/max across seeds.",
               lambda a: _panels(a, [("actor/entropy", "nats per response token", False),
                                     ("reward/frac_zero_std", "fraction of groups", False)],
                                 "Entropy and zero-variance groups")),
    FigureSpec("cmp_clip", "Clip fractions per arm",
               "Binding clip fractions of tokens and sequences (the clip takes the gradient away) and "
               "the out-of-range token fraction whatever the sign of A (mean over seeds, min/max band).",
               lambda a: _panels(a, [("clip/token_frac", "fraction of tokens (binding)", False),
                                     ("clip/seq_frac", "fraction of sequences (binding)", False),
                                     ("clip/out_of_range_frac", "fraction of tokens (out of range)", False)],
                                 "Clip fractions")),
    FigureSpec("cmp_gate", "SAPO gate per arm",
               "SAPO's soft gate (no hard clip): mean gate weight g = sech^2(tau (w - 1) / 2) over tokens (1 = the "
               "token keeps its full unclipped gradient) and the share of tokens with g < 0.5 (mean over seeds, "
               "min/max band). Only SAPO arms log it.",
               lambda a: _panels(a, [("gate/weight_mean", "mean gate weight", False),
                                     ("gate/token_frac_below_half", "fraction of tokens (g < 0.5)", False)],
                                 "SAPO gate")),
    FigureSpec("cmp_ratio_var", "Ratio variances per arm",
               "New/old policy token- and sequence-ratio variance inside the update (log scale).",
               lambda a: _panels(a, [("ratio/token_var", "variance (unitless)", True),
                                     ("ratio/seq_var", "variance (unitless)", True)],
                                 "Token vs sequence ratio variance")),
    FigureSpec("cmp_routing", "Routing drift per arm",
               "Rollout-vs-learner share of tokens routed differently in ≥1 layer, and the old→new "
               "policy expert change per update.",
               lambda a: _panels(a, [("routing/any_layer_flip", "fraction of tokens", False),
                                     ("update/expert_change_frac", "fraction of experts", False)],
                                 "Routing drift")),
    FigureSpec("cmp_mismatch", "Train-inference mismatch per arm: natural vs replayed routing",
               "k3 KL and |Δ log p| > ln 2 token fraction between rollout-engine and learner log-probs: "
               "learner with its natural routing (mismatch/*, every arm) and replaying the rollout "
               "engine's routes (mismatch_replayed/*, R3 arms: the log-probs their loss uses).",
               lambda a: _panels(a, [("mismatch/k3_kl", "k3 KL, natural (nats/token)", True),
                                     ("mismatch_replayed/k3_kl", "k3 KL, replayed (nats/token)", True),
                                     ("mismatch/extreme_frac_ln2", "tokens, natural", False),
                                     ("mismatch_replayed/extreme_frac_ln2", "tokens, replayed", False)],
                                 "Mismatch: natural vs replayed routing")),
    FigureSpec("cmp_ratio_var_length", "Ratio variance vs response length per arm",
               "Learner/rollout log-ratio d_t from the traced steps' logprob traces, each arm's seeds "
               "pooled: variance of the token ratios exp(d_t) and of the length-normalised sequence ratio "
               "exp(mean_t d_t) per response-length bin (quantile bins of all arms' responses, the same "
               "for every arm; x = the arm's mean length in the bin), log scale. Band: min/max of the "
               "per-seed values. GSPO's claim: the sequence ratio's variance stays far below the token "
               "ratio's and does not grow with length.", fig_ratio_variance_length),
    FigureSpec("cmp_layer_change", "Routing change per layer per arm",
               "Per MoE layer, over the token rows that produce response log-probs: share whose learner "
               "top-k set changes over the first optimizer step (update/layer_change) and whose "
               "rollout-engine and learner (natural routing) top-k sets differ (routing/layer_disagree); "
               "per seed the mean over steps, bar = mean over seeds, error bar = seed min/max.",
               fig_layer_change),
]


def _any_logged(arms: Arms, key: str) -> bool:
    return any(key in r for runs in arms.runs.values() for _, run in runs for r in run.records)


def fig_extreme_frac_curve(arms: Arms) -> Figure:
    """F(tau) per arm, one line each: per seed the mean over its steps, then the mean over seeds (band: seed
    min/max); R3 arms' pass replaying the rollout routes dashed."""
    fig = Figure(figsize=(7.2, 4.0), dpi=100, layout="constrained")
    ax = fig.subplots()
    colors, lines = _palette(arms), []
    for arm, runs in arms.runs.items():
        for key, style, what in ((CURVE_KEY, "-", "natural"), (CURVE_KEY_REPLAYED, "--", "replayed")):
            per_seed = [c for c in (mean_curve(run.records, key) for _, run in runs) if c is not None]
            if not per_seed:
                continue
            c = np.asarray(per_seed)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                lines.append((arm, style, f"{arm}, {what} (n={len(per_seed)})", len(per_seed),
                              np.nanmean(c, 0), np.nanmin(c, 0), np.nanmax(c, 0)))
    if not lines:
        raise SkipFigure(f"'{CURVE_KEY}' has no step with one value per τ in any run")
    positive = any(np.nanmax(mean, initial=0) > 0 for *_, mean, _, _ in lines)  # all zeros: a linear axis at 0
    show = positive_or_nan if positive else (lambda v: v)
    for arm, style, label, n, mean, lo, hi in lines:
        ax.plot(EXTREME_TAUS, show(mean), marker="o", markersize=3, linestyle=style, color=colors[arm], label=label)
        if n > 1:
            ax.fill_between(EXTREME_TAUS, show(lo), show(hi), color=colors[arm], alpha=0.15, linewidth=0)
    f_tau_y_axis(ax, positive=positive)
    tau_axis(ax)
    ax.legend(fontsize="x-small")
    ax.set(ylabel="F(τ): share of response tokens", title="Extreme-token fraction F(τ) per arm")
    return fig


def arm_load_steps(runs: list[tuple[int, RunData]], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, loads [S, L, E]) of an expert-load key averaged over an arm's seeds, on the steps every seed
    that logged it has (empty when none did)."""
    per_seed = [load_steps(run.records, key) for _, run in runs]
    per_seed = [(st, v) for st, v in per_seed if st.size]
    if not per_seed or len({v.shape[1:] for _, v in per_seed}) != 1:
        return np.zeros(0, np.int64), np.zeros((0, 0, 0))
    common = sorted(set.intersection(*(set(st.tolist()) for st, _ in per_seed)))
    if not common:
        return np.zeros(0, np.int64), np.zeros((0, 0, 0))
    stack = [v[np.searchsorted(st, common)] for st, v in per_seed]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.asarray(common, np.int64), np.nanmean(np.stack(stack), 0)


def fig_expert_load_steps(arms: Arms) -> Figure:
    """Per arm (rows) and side (columns), the expert load per layer against the step, seeds averaged."""
    cells = {(arm, name): arm_load_steps(runs, key) for arm, runs in arms.runs.items() for key, name in LOAD_KEYS}
    shapes = {v.shape[1:] for st, v in cells.values() if st.size}
    if not shapes:
        raise SkipFigure("no run logged routing/expert_load_rollout or routing/expert_load_learner per layer")
    num_layers = max(sh[0] for sh in shapes)
    layers = shown_layers(num_layers, 4)
    labels = arm_layer_labels(arms, num_layers)
    vmax = max(float(np.nanmax(v)) if np.isfinite(v).any() else 0.0 for st, v in cells.values() if st.size) or 1.0
    arm_names = list(arms.runs)
    fig = Figure(figsize=(10.4, float(np.clip((0.5 * len(layers) + 1.2) * len(arm_names), 3.0, 24.0))), dpi=100,
                 layout="constrained")
    axes = fig.subplots(len(arm_names), len(LOAD_KEYS), squeeze=False)
    im = None
    for r, arm in enumerate(arm_names):
        for c, (_, name) in enumerate(LOAD_KEYS):
            ax = axes[r][c]
            steps, vals = cells[(arm, name)]
            if not steps.size or vals.shape[1] != num_layers:
                ax.text(0.5, 0.5, f"{arm}: {name} load not logged", ha="center", va="center", transform=ax.transAxes)
                ax.set_axis_off()
                continue
            im = draw_load_steps(ax, steps, vals, layers, labels, vmax=vmax, title=f"{arm}: {name}", ylabel=False)
            if c == 0:
                ax.set_ylabel(f"MoE layer ({vals.shape[2]} experts each)", fontsize="small")
    if im is not None:
        fig.colorbar(im, ax=axes, label="share of the layer's top-k slots (mean over seeds)")
    shown = "" if len(layers) == num_layers else f", {len(layers)} of {num_layers} layers shown"
    fig.suptitle(f"Expert load per layer over training, per arm{shown}")
    return fig


COMPARE_STABILITY_FIGURES: list[FigureSpec] = [
    FigureSpec("cmp_extreme_frac_curve", "Extreme-token fraction curve F(τ) per arm",
               "F(τ) = share of response tokens with |log p_learner − log p_rollout| > ln τ "
               "(mismatch/extreme_frac_curve; the R3 paper's curve): per seed the mean over steps, line = mean "
               "over seeds, band = seed min/max; dashed: R3 arms' pass replaying the rollout routes "
               "(mismatch_replayed/extreme_frac_curve). Its points at τ = 2 and 5 are mismatch/extreme_frac_ln2 "
               "and _ln5. Log y when a point is positive (points at 0 left out), else a linear axis from 0.",
               fig_extreme_frac_curve, applies=lambda a: _any_logged(a, CURVE_KEY)),
    FigureSpec("cmp_dead_experts", "Dead experts per arm",
               "router/dead_experts: (MoE layer, expert) pairs to which the learner's old-policy pass routed no "
               "response row in the last logging.dead_expert_window steps; line = mean over seeds, band = min/max.",
               lambda a: _panels(a, [(DEAD_KEY, "(layer, expert) pairs", False)], "Dead experts (learner)"),
               applies=lambda a: _any_logged(a, DEAD_KEY)),
    FigureSpec("cmp_expert_load_steps", "Expert load per layer over training, per arm",
               "Each expert's share of its layer's top-k slots on the response rows (routing/expert_load_rollout, "
               "routing/expert_load_learner) against the step, the arm's seeds averaged on their common steps; "
               "layers stacked (white lines), at most 4 shown.", fig_expert_load_steps,
               applies=lambda a: _any_logged(a, DEAD_KEY)),
]
"""Figures of issue 41's stability metrics; left out silently when no run logged their metric (older runs)."""
