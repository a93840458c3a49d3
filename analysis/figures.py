"""The report's figures (matplotlib + seaborn), one small function per figure.

Each figure function takes a `RunData` (or a probe dict) and returns a `matplotlib.figure.Figure`,
or raises `SkipFigure(reason)` when its inputs are absent (a metric missing from every step, no
traces). Figures are built with `Figure()` directly, never through pyplot, so no GUI backend or
global figure state is involved (rendering is Agg's); `render_figures` turns them into PNG bytes
at a modest dpi so the self-contained HTML stays small. The machinery (`FigureSpec`, `render_figures`,
the shared plotting helpers) is `analysis/figure_kit.py`; this module holds the run figures.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from moe_gspo.routing.drift import expert_load

from analysis.figure_kit import (  # RenderedFigure ... render_figures: re-exported, the report's entry points
    FigureSpec, RenderedFigure, SkipFigure, SkippedFigure, _fig, _finite_max, _fraction_axis, _heat_height,
    _legend_below, _lines, _need, _wrapped_title, figure_png, layer_axis_label, layer_labels, positive_or_nan,
    render_figures, report_style,
)
from analysis.load import RunData, load_logprobs, load_topk, matrix_series, ratio_variance_by_length, series


def _load_heatmaps(rollout_LE: np.ndarray, learner_LE: np.ndarray, labels: list[str],
                   source: str) -> Figure:
    fig, axes = _fig(3, width=5.0, height=_heat_height(len(labels), 1.6))
    vmax = _finite_max(rollout_LE, learner_LE)
    diff = learner_LE - rollout_LE
    lim = _finite_max(np.abs(diff))
    panels = ((rollout_LE, "rollout engine", dict(vmin=0, vmax=vmax, cmap="viridis"),
               "fraction of routings"),
              (learner_LE, "learner", dict(vmin=0, vmax=vmax, cmap="viridis"), "fraction of routings"),
              (diff, "learner − rollout", dict(vmin=-lim, vmax=lim, center=0, cmap="RdBu_r"),
               "Δ fraction of routings"))
    for ax, (data, name, kw, unit) in zip(axes, panels):
        sns.heatmap(pd.DataFrame(data, index=labels), ax=ax, xticklabels="auto",
                    yticklabels="auto", cbar_kws={"label": unit}, **kw)
        ax.set(title=name, xlabel="expert id", ylabel=layer_axis_label(labels) if ax is axes[0] else "")
    fig.suptitle(f"Expert load per layer ({source})")
    return fig


def fig_routing_disagree_heatmap(run: RunData) -> Figure:
    _need(run, "routing/layer_disagree")
    steps, vals_SL = matrix_series(run.records, "routing/layer_disagree")
    if steps.size == 0:
        raise SkipFigure("'routing/layer_disagree' has no list values")
    labels = layer_labels(run, vals_SL.shape[1])
    fig, (ax,) = _fig(height=_heat_height(len(labels)))
    df = pd.DataFrame(vals_SL.T, index=labels, columns=steps)
    sns.heatmap(df, ax=ax, cmap="magma", vmin=0, xticklabels="auto", yticklabels="auto",
                cbar_kws={"label": "fraction of tokens"})
    ax.set(title="Routing disagreement, rollout engine vs learner",
           xlabel="training step", ylabel=layer_axis_label(labels))
    return fig


def fig_routing_disagree_last(run: RunData) -> Figure:
    _need(run, "routing/layer_disagree")
    steps, vals_SL = matrix_series(run.records, "routing/layer_disagree")
    if steps.size == 0:
        raise SkipFigure("'routing/layer_disagree' has no list values")
    labels = layer_labels(run, vals_SL.shape[1])
    width = max(4.0, 0.3 * len(labels) + 2.5)
    fig, (ax,) = _fig(width=width)
    sns.barplot(x=labels, y=vals_SL[-1], ax=ax, color="C0")
    ax.set(xlabel=layer_axis_label(labels), ylabel="fraction of tokens")
    _wrapped_title(ax, f"Per-layer routing disagreement at step {int(steps[-1])}", width)
    return fig


def fig_expert_load(run: RunData) -> Figure:
    for rec in reversed(run.records):
        if "routing/expert_load_rollout" in rec and "routing/expert_load_learner" in rec:
            try:
                ro = np.asarray(rec["routing/expert_load_rollout"], np.float64)
                le = np.asarray(rec["routing/expert_load_learner"], np.float64)
            except (TypeError, ValueError):
                continue
            if ro.ndim == 2 and ro.shape == le.shape:
                return _load_heatmaps(ro, le, layer_labels(run, ro.shape[0]),
                                      f"metrics, step {rec['step']}")
    for step in sorted(run.traces, reverse=True):
        kinds = run.traces[step]
        if "rollout" in kinds and "learner" in kinds:
            topk_r, num_e, layer_ids = load_topk(kinds["rollout"])
            topk_l, num_e_l, _ = load_topk(kinds["learner"])
            num_e = max(num_e, num_e_l)
            return _load_heatmaps(expert_load(topk_r, num_e), expert_load(topk_l, num_e),
                                  [str(i) for i in layer_ids], f"traces, step {step}")
    raise SkipFigure("no step has both 'routing/expert_load_rollout' and "
                     "'routing/expert_load_learner', and no traces with rollout + learner routing")


def fig_update_change(run: RunData) -> Figure:
    _need(run, "update/layer_change", "update/expert_change_frac",
          "update_all_minibatches/expert_change_frac")
    steps, vals_SL = matrix_series(run.records, "update/layer_change")
    fig, axes = _fig(2 if steps.size else 1, width=6.5,
                     height=_heat_height(vals_SL.shape[1]) if steps.size else 3.4)
    if steps.size:
        labels = layer_labels(run, vals_SL.shape[1])
        df = pd.DataFrame(vals_SL.T, index=labels, columns=steps)
        sns.heatmap(df, ax=axes[0], cmap="magma", vmin=0, vmax=max(_finite_max(vals_SL), 0.01), xticklabels="auto",
                    yticklabels="auto", cbar_kws={"label": "fraction of tokens"})
        axes[0].set(title="per layer, after the first optimizer step", xlabel="training step",
                    ylabel=layer_axis_label(labels))
    ax = axes[-1]
    if not _lines(ax, run, [("update/expert_change_frac", "experts, after the first optimizer step"),
                            ("update/any_layer_change", "tokens (≥1 layer), after the first step"),
                            ("update_all_minibatches/expert_change_frac", "experts, after all mini-batches")]):
        ax.text(0.5, 0.5, "update/expert_change_frac not logged", ha="center", transform=ax.transAxes)
    _fraction_axis(ax)
    ax.set(title="all layers", xlabel="training step", ylabel="fraction changed")
    fig.suptitle("Old→new learner routing of the same response tokens")
    return fig


def fig_ratio_variance_steps(run: RunData) -> Figure:
    _need(run, "ratio/token_var", "ratio/seq_var", "mismatch_ratio/token_var", "mismatch_ratio/seq_var")
    fig, axes = _fig(2, width=5.5)
    _lines(axes[0], run, [("ratio/token_var", "token ratio"), ("ratio/seq_var", "sequence ratio")],
           logy=True)
    axes[0].set(title="new/old policy (in the update)", xlabel="training step",
                ylabel="variance of ratio (unitless)")
    _lines(axes[1], run, [("mismatch_ratio/token_var", "token ratio"),
                          ("mismatch_ratio/seq_var", "sequence ratio")], logy=True)
    axes[1].set(title="learner/rollout (mismatch)", xlabel="training step",
                ylabel="variance of ratio (unitless)")
    fig.suptitle("Token- vs sequence-ratio variance")
    return fig


def logprob_trace_paths(run: RunData) -> list:
    """The run's traces/step_*_logprobs[_rank*].npz files, by step."""
    return [p for _, kinds in sorted(run.traces.items()) for p in kinds.get("logprobs", [])]


def read_logprob_sets(run: RunData) -> list[dict[str, np.ndarray]]:
    """Every readable logprob trace of the run (`load_logprobs`); an unreadable file is noted in
    `run.warnings` and left out."""
    sets = []
    for p in logprob_trace_paths(run):
        try:
            sets.append(load_logprobs(p))
        except (OSError, ValueError, KeyError) as e:
            run.warnings.append(f"skipped {p.name}: {e}")
    return sets


def fig_ratio_variance_length(run: RunData) -> Figure:
    if not logprob_trace_paths(run):
        raise SkipFigure("no traces/step_*_logprobs.npz files (traces off or missing)")
    sets = read_logprob_sets(run)
    if not sets:
        raise SkipFigure("every step_*_logprobs.npz file was unreadable")
    stats = ratio_variance_by_length(sets)
    ok = np.isfinite(stats["token_var"])
    if not ok.any():
        raise SkipFigure("fewer than 2 responses per length bin in the logprob traces")
    fig, (ax,) = _fig()
    x = stats["len_mid"][ok]
    for key, label in (("token_var", "token ratio exp(d_t)"),
                       ("seq_norm_var", "length-normalised sequence ratio exp(mean d_t)"),
                       ("seq_logprod_var", "unnormalised log product Σ d_t")):
        ax.plot(x, positive_or_nan(stats[key][ok]), marker="o", markersize=3, label=label)
    if np.any(np.concatenate([stats[k][ok] for k in ("token_var", "seq_norm_var",
                                                     "seq_logprod_var")]) > 0):
        ax.set_yscale("log")
    _legend_below(ax)
    num_steps = sum("logprobs" in kinds for kinds in run.traces.values())
    ax.set(title=f"Learner/rollout ratio variance vs response length ({num_steps} traced steps)",
           xlabel="response length (tokens, bin mean)", ylabel="variance (unitless)")
    return fig


def fig_variance_attribution(run: RunData) -> Figure:
    _need(run, "mismatch_ratio/token_var_share_flipped", "mismatch_ratio/flipped_token_frac")
    fig, (ax,) = _fig()
    _lines(ax, run, [("mismatch_ratio/token_var_share_flipped", "share of the variance on flipped tokens"),
                     ("mismatch_ratio/flipped_token_frac", "share of the tokens that flipped")])
    ax.set_ylim(0, 1.02)
    ax.set(title="Learner/rollout token-ratio variance carried by routing-flipped tokens",
           xlabel="training step", ylabel="fraction")
    return fig


def fig_clip(run: RunData) -> Figure:
    _need(run, "clip/token_frac", "clip/seq_frac", "clip/out_of_range_frac")
    fig, (ax,) = _fig()
    _lines(ax, run, [("clip/token_frac", "tokens, clip binds"), ("clip/seq_frac", "sequences, clip binds"),
                     ("clip/token_frac_low", "tokens, binds low (A < 0)"),
                     ("clip/token_frac_high", "tokens, binds high (A > 0)"),
                     ("clip/out_of_range_frac", "tokens out of range (either sign of A)")])
    _fraction_axis(ax)
    ax.set(title="Clip fractions", xlabel="training step", ylabel="fraction")
    return fig


def fig_mismatch(run: RunData) -> Figure:
    _need(run, "mismatch/k1_kl", "mismatch/k3_kl", "mismatch/extreme_frac_ln2",
          "mismatch/extreme_frac_ln5")
    fig, axes = _fig(2, width=5.5)
    _lines(axes[0], run, [("mismatch/k1_kl", "k1"), ("mismatch/k3_kl", "k3"),
                          ("mismatch_replayed/k3_kl", "k3, replaying rollout routes (R3)")])
    axes[0].set(title="KL(rollout ‖ learner)", xlabel="training step", ylabel="KL (nats/token)")
    _lines(axes[1], run, [("mismatch/extreme_frac_ln2", "|Δ log p| > ln 2"),
                          ("mismatch/extreme_frac_ln5", "|Δ log p| > ln 5"),
                          ("mismatch_replayed/extreme_frac_ln2", "|Δ log p| > ln 2, replayed (R3)")])
    _fraction_axis(axes[1])
    axes[1].set(title="extreme tokens", xlabel="training step", ylabel="fraction of tokens")
    fig.suptitle("Rollout engine vs learner mismatch (same tokens; natural routing unless marked)")
    return fig


ROLLOUT_CORR_PANELS = [
    ("TIS: importance weights π_old / π_rollout", "value",
     [("rollout_corr/is_weight_mean", "mean applied weight"), ("rollout_corr/is_raw_mean", "mean raw ratio"),
      ("rollout_corr/is_raw_max", "max raw ratio"), ("rollout_corr/is_ess", "effective sample size (fraction)")]),
    ("TIS truncation, MIS rejection", "fraction",
     [("rollout_corr/is_truncated_frac", "IS units truncated (TIS)"),
      ("rollout_corr/rs_masked_token_frac", "tokens rejected (MIS)"),
      ("rollout_corr/rs_masked_seq_frac", "sequences with a rejected token (MIS)"),
      ("rollout_corr/rs_frac_high", "units above the upper bound (MIS)"),
      ("rollout_corr/rs_frac_low", "units below the lower bound (MIS)")]),
    ("OPSM: masked sequences", "fraction / nats",
     [("rollout_corr/opsm_masked_seq_frac", "sequences masked"),
      ("rollout_corr/opsm_masked_token_frac", "tokens masked"),
      ("rollout_corr/opsm_kl_mean", "mean drift log π_rollout − log π_θ")]),
]
"""The rollout-correction figure's panels: (title, y label, [(key, label)]); a panel is drawn when one of its
keys was logged (TIS = algo.rollout_is, MIS = algo.rollout_rs, OPSM = algo.opsm)."""


def fig_rollout_corr(run: RunData) -> Figure:
    _need(run, *(k for _, _, pairs in ROLLOUT_CORR_PANELS for k, _ in pairs))
    panels = [p for p in ROLLOUT_CORR_PANELS if any(k in r for r in run.records for k, _ in p[2])]
    fig, axes = _fig(len(panels), width=5.5)
    for ax, (title, ylabel, pairs) in zip(axes, panels):
        _lines(ax, run, pairs)
        if ylabel == "fraction":
            _fraction_axis(ax)
        ax.set(title=title, xlabel="training step", ylabel=ylabel)
    fig.suptitle("Rollout corrections (rollout_corr/*)")
    return fig


def fig_reward(run: RunData) -> Figure:
    _need(run, "reward/mean")
    steps, mean = series(run.records, "reward/mean")
    fig, (ax,) = _fig()
    ax.plot(steps, mean, label="mean", color="C0")
    s_std, std = series(run.records, "reward/std")
    if s_std.size:
        std_at = dict(zip(s_std.tolist(), std.tolist()))
        sd = np.asarray([std_at.get(s, np.nan) for s in steps.tolist()])
        ax.fill_between(steps, mean - sd, mean + sd, alpha=0.25, color="C0", label="± std")
    s_max, mx = series(run.records, "reward/max")
    if s_max.size:
        ax.plot(s_max, mx, ls="--", color="C1", label="max")
    _legend_below(ax)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(title="Reward", xlabel="training step", ylabel="reward (task units)")
    return fig


def fig_collapse(run: RunData) -> Figure:
    """Entropy of the policy and the share of groups without learning signal, per step."""
    _need(run, "actor/entropy", "reward/frac_zero_std")
    fig, axes = _fig(2)
    if not _lines(axes[0], run, [("actor/entropy", "actor/entropy")]):
        axes[0].text(0.5, 0.5, "'actor/entropy' not logged", ha="center", va="center", transform=axes[0].transAxes)
    axes[0].set(title="policy entropy (old-policy pass)", xlabel="training step", ylabel="nats per response token")
    _lines(axes[1], run, [("reward/frac_zero_std", "groups with all-equal rewards"),
                          ("advantage/nonzero_frac", "sequences with advantage ≠ 0")])
    axes[1].set(title="learning signal", xlabel="training step", ylabel="fraction", ylim=(-0.02, 1.02))
    fig.suptitle("Collapse watch: entropy and zero-variance groups")
    return fig


RUN_FIGURES: list[FigureSpec] = [
    FigureSpec("reward", "Reward", "Batch reward per step: mean with a ± std band, and the max.",
               fig_reward),
    FigureSpec("collapse", "Entropy and zero-variance groups",
               "Left: mean token entropy of the policy over the response tokens, from the old-policy pass "
               "(actor/entropy). Right: share of prompt groups whose rewards are all equal "
               "(reward/frac_zero_std; their advantages are 0) and share of sequences with a non-zero "
               "advantage (advantage/nonzero_frac). A policy that has collapsed to deterministic, partly "
               "wrong answers shows low entropy, zero-variance groups near 1 and a reward below its maximum.",
               fig_collapse),
    FigureSpec("routing_disagree_heatmap", "Routing disagreement (layer × step)",
               "Fraction of tokens whose top-k expert set differs between the rollout engine and the "
               "learner, per MoE layer (routing/layer_disagree).", fig_routing_disagree_heatmap),
    FigureSpec("routing_disagree_last", "Routing disagreement per layer (last step)",
               "routing/layer_disagree at the last logged step.", fig_routing_disagree_last),
    FigureSpec("expert_load", "Expert load (rollout, learner, difference)",
               "Share of routings per expert and layer, from the last step that logged it (or the "
               "last routing traces).", fig_expert_load),
    FigureSpec("update_change", "Old→new policy expert change",
               "Learner routing (natural) of the rows that produce response log-probs, before vs after "
               "the first optimizer step of each RL step (update/*, the GSPO paper's ~10% figure), per "
               "layer and overall, and after all mini-batches (update_all_minibatches/*).",
               fig_update_change),
    FigureSpec("ratio_variance_steps", "Token vs sequence ratio variance over steps",
               "ratio/token_var and ratio/seq_var (new/old policy inside the update) and their "
               "learner/rollout counterparts, log scale.", fig_ratio_variance_steps),
    FigureSpec("ratio_variance_length", "Ratio variance vs response length (from traces)",
               "Per response-length bin, pooled over traced steps: variance of token ratios, of the "
               "length-normalised sequence ratio, and of the unnormalised log product: the GSPO "
               "variance argument, measured on learner/rollout log-ratios.", fig_ratio_variance_length),
    FigureSpec("variance_attribution", "Variance attribution: flipped vs agreed routing",
               "Share of the total sum of squared deviations of the learner/rollout token ratios that "
               "falls on tokens whose producing row is routed differently in ≥1 layer "
               "(mismatch_ratio/token_var_share_flipped), next to the share of such tokens; steps "
               "without a flipped token are gaps, not zeros.", fig_variance_attribution),
    FigureSpec("clip", "Clip fractions",
               "Binding clip fractions (the clip takes the gradient away: ratio above 1+ε with A > 0, "
               "or below 1−ε with A < 0; as verl's pg_clipfrac) and, for comparison, the share of "
               "tokens whose ratio is out of range whatever the sign of A.", fig_clip),
    FigureSpec("mismatch", "Mismatch KL and extreme tokens",
               "k1/k3 KL between rollout-engine and learner log-probs of the same tokens (learner with "
               "natural routing; under R3 also the pass replaying the rollout routes), and the share of "
               "tokens with |Δ log p| above ln 2 / ln 5.", fig_mismatch),
    FigureSpec("rollout_corr", "Rollout corrections",
               "Truncated importance weights π_learner_old / π_rollout (TIS, algo.rollout_is: mean applied, "
               "raw mean and max, effective sample size), the fractions truncated and rejected (MIS, "
               "algo.rollout_rs), and the sequences masked by OPSM (algo.opsm) with their mean drift, for the "
               "corrections the run used.", fig_rollout_corr, applies=lambda run: _rollout_corr_on(run)),
]


def rollout_corrections_used(config: dict | None) -> list[str] | None:
    """The rollout corrections config.yaml turns on, e.g. ['TIS (algo.rollout_is: token)', 'OPSM (algo.opsm)'];
    None without an `algo` section."""
    algo = (config or {}).get("algo")
    if not isinstance(algo, dict):
        return None
    used = []
    if algo.get("rollout_is", "none") not in ("none", None):
        used.append(f"TIS (algo.rollout_is: {algo['rollout_is']})")
    if algo.get("rollout_rs", "none") not in ("none", None):
        used.append(f"MIS (algo.rollout_rs: {algo['rollout_rs']})")
    if algo.get("opsm") is True:
        used.append("OPSM (algo.opsm)")
    return used


def _rollout_corr_on(run: RunData) -> bool:
    """False when no step logged rollout_corr/* and config.yaml turns no correction on (algo.rollout_is and
    algo.rollout_rs none, algo.opsm false: the default), or there is no config.yaml: the run did not use one,
    which the report's header says ("Rollout corrections: not used"), instead of listing the figure as
    skipped for missing metrics."""
    if any(k.startswith("rollout_corr/") for r in run.records for k in r):
        return True
    return bool(rollout_corrections_used(run.config))
