"""Report figures of the router diagnostics (`router/*` metrics, router margins in the routing traces).

- `flip_vs_margin`: for the response rows of the traced steps (the rows that produce response log-probs,
  as `routing/*`), the share of (token, MoE layer) pairs whose top-k expert set differs between the
  rollout engine and the learner's old-policy pass (natural routing), per bin of the learner's router
  margin (and of the rollout engine's, when its traces carry margins): low-margin tokens are the ones
  that flip. Needs traces with `router_margin` (`moe_gspo.routing.trace`; the learner always records it,
  the transformers engine with `rollout.record_probs`, vLLM never).
- `router_over_steps`: MaxVio (mean over layers) of both sides, and the share of low-margin pairs with
  their flip rates, per step.

`ROUTER_FIGURES` lists them as `analysis.figures.FigureSpec`s for `analysis.report`; every function takes a
`RunData` or a run directory. Runs that logged no `router/*` metric (older runs) leave both out silently.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from analysis.figure_kit import FigureSpec, SkipFigure, _fig, _fraction_axis, _lines, _need
from analysis.load import RunData, load_run
from moe_gspo.routing.drift import per_token_layer_diff
from moe_gspo.routing.router_stats import flip_rate_by_margin_bin
from moe_gspo.routing.trace import RoutingTrace, load_trace

MARGIN_EDGES = np.array([0.0, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, np.inf])
"""Bins of the router margin (router-logit units): log-spaced around the default threshold 0.01."""
DEFAULT_THRESHOLD = 0.01


def _as_run(run: RunData | str | Path) -> RunData:
    return run if isinstance(run, RunData) else load_run(run)


def response_rows(a: RoutingTrace, b: RoutingTrace) -> tuple[np.ndarray, np.ndarray]:
    """Row indices into `a` and `b` of the rows that produce response log-probs, positions P-1 .. P+R-2
    of every sequence (the rows `routing/*` compares), as far as both traces have them."""
    p = a.prompt_lens.astype(np.int64)
    r = a.response_lens.astype(np.int64)
    lo = np.maximum(p - 1, 0)
    hi = np.minimum(np.where(r > 0, p + r - 1, lo), np.minimum(a.seq_lens, b.seq_lens))
    lo = np.minimum(lo, hi)
    counts = hi - lo
    seq = np.repeat(np.arange(a.num_sequences), counts)
    within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    return a.seq_offsets[:-1][seq] + lo[seq] + within, b.seq_offsets[:-1][seq] + lo[seq] + within


def _same_tokens(a: RoutingTrace, b: RoutingTrace) -> bool:
    return (a.num_sequences == b.num_sequences and a.topk_ids.shape[1:] == b.topk_ids.shape[1:]
            and np.array_equal(a.prompt_lens, b.prompt_lens) and np.array_equal(a.response_lens, b.response_lens))


def flip_margin_pairs(run: RunData | str | Path) -> dict[str, np.ndarray]:
    """Pooled over every traced step with a rollout and a learner trace (one file each) whose learner trace
    carries margins: `flip` bool [M] (top-k set differs, per (row, layer) pair), `learner_margin` [M],
    `rollout_margin` [M] (absent when a rollout trace has none), `steps` (the steps used)."""
    run = _as_run(run)
    flips, margins_le, margins_ro, steps = [], [], [], []
    for step, kinds in sorted(run.traces.items()):
        if len(kinds.get("rollout", [])) != 1 or len(kinds.get("learner", [])) != 1:
            continue
        ro, le = load_trace(kinds["rollout"][0]), load_trace(kinds["learner"][0])
        if le.router_margin is None or not _same_tokens(ro, le):
            continue
        rows_ro, rows_le = response_rows(ro, le)
        flips.append(per_token_layer_diff(ro.topk_ids[rows_ro], le.topk_ids[rows_le]).ravel())
        margins_le.append(le.router_margin[rows_le].astype(np.float64).ravel())
        margins_ro.append(None if ro.router_margin is None else ro.router_margin[rows_ro].astype(np.float64).ravel())
        steps.append(step)
    if not steps:
        raise SkipFigure("no traced step has a rollout and a learner routing trace with router margins "
                         "(logging.trace_every > 0; traces written before the margins existed have none)")
    out = {"flip": np.concatenate(flips), "learner_margin": np.concatenate(margins_le), "steps": np.asarray(steps)}
    if all(m is not None for m in margins_ro):
        out["rollout_margin"] = np.concatenate(margins_ro)
    return out


def _bin_labels(edges: np.ndarray) -> list[str]:
    fmt = lambda x: "∞" if np.isinf(x) else f"{x:g}"  # noqa: E731
    return [f"[{fmt(lo)}, {fmt(hi)})" for lo, hi in zip(edges[:-1], edges[1:])]


def _threshold(run: RunData) -> float:
    value = ((run.config or {}).get("logging") or {}).get("router_margin_threshold", DEFAULT_THRESHOLD)
    return float(value) if isinstance(value, (int, float)) else DEFAULT_THRESHOLD


def fig_flip_vs_margin(run: RunData | str | Path) -> Figure:
    """Left: flip rate per margin bin (learner's margin; rollout's too when recorded). Right: the share of
    (token, layer) pairs in each bin. The dashed line marks `logging.router_margin_threshold`."""
    run = _as_run(run)
    data = flip_margin_pairs(run)
    edges, x = MARGIN_EDGES, np.arange(MARGIN_EDGES.size - 1)
    fig, (ax_rate, ax_share) = _fig(2, width=7.5, height=3.6)
    sides = [("learner", "binned by the learner's margin")]
    if "rollout_margin" in data:
        sides.append(("rollout", "binned by the rollout engine's margin"))
    for i, (side, label) in enumerate(sides):
        rate, count = flip_rate_by_margin_bin(data[f"{side}_margin"], data["flip"], edges)
        ax_rate.plot(x, rate, marker="o", markersize=4, color=f"C{i}", label=label)
        ax_share.bar(x + (i - (len(sides) - 1) / 2) * 0.4, count / max(count.sum(), 1), width=0.4, color=f"C{i}",
                     label=label)
    thr = _threshold(run)
    for ax in (ax_rate, ax_share):
        ax.axvline(np.searchsorted(edges, thr) - 0.5, color="k", linestyle="--", linewidth=1,
                   label=f"threshold {thr:g}" if ax is ax_rate else None)
        ax.set_xticks(x, _bin_labels(edges), rotation=45, ha="right", fontsize="x-small")
        ax.set_xlabel("router margin (k-th minus (k+1)-th router logit)")
    _fraction_axis(ax_rate)
    ax_rate.set(ylabel="share of (token, layer) pairs flipped",
                title=f"Rollout vs learner top-k flips ({data['flip'].sum()} of {data['flip'].size} pairs)")
    ax_share.set(ylabel="share of (token, layer) pairs", title=f"Margin distribution ({len(data['steps'])} traced steps)")
    ax_rate.legend(fontsize="x-small", frameon=False)
    return fig


def logs_router_metrics(run: RunData) -> bool:
    """Whether the run logged `router/*` (runs from before the router diagnostics leave the figures out
    silently, as `FigureSpec.applies` does for features a run never turned on)."""
    return any(k.startswith("router/") for r in run.records for k in r)


def fig_router_over_steps(run: RunData | str | Path) -> Figure:
    run = _as_run(run)
    _need(run, "router/max_vio_learner_mean", "router/max_vio_rollout_mean")
    fig, (ax_vio, ax_margin) = _fig(2, width=7.5)
    _lines(ax_vio, run, [("router/max_vio_rollout_mean", "rollout, mean over layers"),
                         ("router/max_vio_rollout_max", "rollout, worst layer"),
                         ("router/max_vio_learner_mean", "learner, mean over layers"),
                         ("router/max_vio_learner_max", "learner, worst layer")])
    ax_vio.set(xlabel="step", ylabel="MaxVio", title="Expert-load imbalance")
    _lines(ax_margin, run, [("router/margin_small_frac_rollout_mean", "low-margin share, rollout"),
                            ("router/margin_small_frac_learner_mean", "low-margin share, learner"),
                            ("router/flip_frac_small_margin", "flip rate, low margin"),
                            ("router/flip_frac_large_margin", "flip rate, other")])
    _fraction_axis(ax_margin)
    ax_margin.set(xlabel="step", ylabel="fraction of (token, layer) pairs", title="Low-margin tokens and flips")
    return fig


ROUTER_FIGURES: list[FigureSpec] = [
    FigureSpec("flip_vs_margin", "Routing flips vs router margin",
               "Response rows of the traced steps (the rows that produce response log-probs): share of "
               "(token, MoE layer) pairs whose top-k expert set differs between the rollout engine and the "
               "learner's old-policy pass (natural routing), per bin of the router margin, the gap between "
               "the k-th and (k+1)-th router logit (left), and how the pairs spread over the bins (right). "
               "Dashed: logging.router_margin_threshold, the boundary of router/margin_small_frac_* and "
               "router/flip_frac_{small,large}_margin.", fig_flip_vs_margin, applies=logs_router_metrics),
    FigureSpec("router_over_steps", "Router diagnostics over steps",
               "MaxVio = (max − mean) / mean expert load per layer (0 = balanced; verl's max_vio), mean over "
               "layers and the worst layer, on both sides (left); share of (token, layer) pairs below the "
               "margin threshold and the flip rate below / above it (right).", fig_router_over_steps,
               applies=logs_router_metrics),
]
