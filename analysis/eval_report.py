"""The evaluation part of a run report, from the run's `eval.jsonl` (one JSON object per evaluation:
`eval/reward_mean`, `eval/accuracy`, `eval/pass_at_k` when k > 1, `eval/k`, `eval/response_len_mean`,
`eval/num_prompts`, `eval/policy_step` = updates the evaluated policy had, 0 = the initial policy):
a figure of the eval numbers against policy step beside the training batches' reward/mean, and the
last evaluation's numbers for the headline table. A run without eval.jsonl gets the figure listed
as skipped and no headline rows.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from analysis.figure_kit import FigureSpec, SkipFigure, _fig, _legend_below
from analysis.load import RunData, series

EVAL_LINES = (("eval/reward_mean", "eval reward (mean)"), ("eval/accuracy", "eval accuracy"))


def _num(v: Any) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan


def policy_step(rec: dict[str, Any]) -> int:
    """Updates the evaluated policy had: `eval/policy_step`, else the record's `step`."""
    v = _num(rec.get("eval/policy_step"))
    return int(v) if math.isfinite(v) else int(rec["step"])


def eval_k(evals: list[dict[str, Any]]) -> int | None:
    """The k of pass@k of the last evaluation that logged eval/pass_at_k (None when none did)."""
    for rec in reversed(evals):
        if "eval/pass_at_k" in rec:
            k = _num(rec.get("eval/k"))
            return int(k) if math.isfinite(k) else None
    return None


def _eval_off(run: RunData) -> bool:
    """True when config.yaml says eval.every: 0 (evaluation off)."""
    section = (run.config or {}).get("eval")
    return isinstance(section, dict) and section.get("every") == 0


def fig_eval(run: RunData) -> Figure:
    if not run.evals:
        if (run.source / "eval.jsonl").is_file():
            raise SkipFigure("eval.jsonl holds no valid records")
        raise SkipFigure("no eval.jsonl in the run directory: evaluation was off (eval.every: 0)" if _eval_off(run)
                         else "no eval.jsonl in the run directory (no evaluation ran)")
    fig, (ax,) = _fig()
    steps = np.asarray([policy_step(r) for r in run.evals])
    k = eval_k(run.evals)
    lines = list(EVAL_LINES) + [("eval/pass_at_k", f"eval pass@{k if k is not None else 'k'}")]
    for key, label in lines:
        vals = np.asarray([_num(r.get(key)) for r in run.evals])
        if np.isfinite(vals).any():
            ax.plot(steps, vals, marker="o", markersize=4, label=label)
    t_steps, t_reward = series(run.records, "reward/mean")
    if t_steps.size:
        ax.plot(t_steps, t_reward, color="0.55", linewidth=1, label="training batch reward/mean")
    _legend_below(ax)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(title="Evaluation vs training reward", xlabel="policy step (updates the policy had)",
           ylabel="reward, or fraction of responses")
    return fig


EVAL_FIGURES: list[FigureSpec] = [
    FigureSpec("eval", "Evaluation",
               "Each evaluation (eval.jsonl) at the number of updates the evaluated policy had: mean reward and "
               "accuracy on the eval prompts (and pass@k when k > 1), with the training batches' reward/mean at "
               "the same policy step (a training step's rollout uses the policy after that many updates).",
               fig_eval),
]


def last_eval_rows(evals: list[dict[str, Any]]) -> list[tuple[str, float, bool]]:
    """(label, value, integer) rows of the last evaluation for the headline table; [] without one."""
    if not evals:
        return []
    last = evals[-1]
    rows = [("last evaluation: policy step (updates the evaluated policy had)", float(policy_step(last)), True),
            ("last evaluation: prompts (eval/num_prompts)", _num(last.get("eval/num_prompts")), True),
            ("last evaluation: mean reward (eval/reward_mean)", _num(last.get("eval/reward_mean")), False),
            ("last evaluation: accuracy (eval/accuracy)", _num(last.get("eval/accuracy")), False)]
    if "eval/pass_at_k" in last:
        k = _num(last.get("eval/k"))
        rows.append((f"last evaluation: pass@{int(k) if math.isfinite(k) else 'k'} (eval/pass_at_k)",
                     _num(last["eval/pass_at_k"]), False))
    rows.append(("last evaluation: mean response length (eval/response_len_mean, tokens)",
                 _num(last.get("eval/response_len_mean")), False))
    if "eval/stop_frac" in last:
        rows.append(("last evaluation: responses that ended with EOS (eval/stop_frac)", _num(last["eval/stop_frac"]),
                     False))
    return rows
