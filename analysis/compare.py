"""Comparison of several training runs grouped into arms (an arm = one algorithm × routing-replay
setting, run with several seeds): the report the ablation runner writes at the end.

    python -m analysis.compare OUT_DIR RUN_DIR [RUN_DIR ...]

groups run directories named `<arm>-s<seed>` by `<arm>` (as `python -m moe_gspo.ablate` names them;
`analysis.compare_arms`: a RUN_DIR that does not exist, or is given twice, is an error naming it) and
writes `report.html`, `report.md` and the PNGs into OUT_DIR. Figures (`analysis.compare_figures`): reward per
arm (mean over seeds with a min/max band across seeds), binding and out-of-range clip fractions (for CISPO the
out-of-range fraction is the share of truncated weights, its binding fraction 0), SAPO's gate (mean gate
weight, share of tokens whose gradient it more than halves), token and sequence ratio variances, routing drift (rollout-vs-learner any-layer flip, old→new expert change after the
first optimizer step), train-inference mismatch with natural routing (`mismatch/*`) next to the
pass that replays the rollout routes (`mismatch_replayed/*`, R3 arms only); from the logprob traces
(`traces/step_*_logprobs.npz`), learner/rollout token- and length-normalised sequence-ratio variance
against response length per arm (seeds pooled, the same length bins for every arm); and routing
change per MoE layer (`update/layer_change`, `routing/layer_disagree`) per arm as grouped bars.
Tables per arm: steps logged, final reward (per seed the mean of reward/mean over its last 10% of
steps, as in the run report and done.json, then the interquartile mean over seeds with a 95% stratified-bootstrap CI, and the min–max
across seeds); seed statistics that can rank arms (`analysis.seed_stats`: final reward, reward AUC,
steps to a reward threshold, mismatch k3 KL as IQM [95% bootstrap CI, each arm and quantity its own
stream], the failure (collapse or stall) rate as k/n with its Clopper-Pearson CI) and pairwise verdicts
(paired by seed where two arms share train.seed values, else unpaired; difference and probability of
improvement with CIs, Wilcoxon / Mann-Whitney p, Holm-adjusted over the whole table, seeds needed for
80% power; every pair up to 6 arms, else the pairs whose names differ in one '-' component, or the pairs
given); per-seed means
over steps of the drift / clip / gate / variance metrics, of the policy entropy and the share of groups
without signal (`actor/entropy`, `reward/frac_zero_std`) and of the generation rounds per step
(`sampling/num_gen_batches`, > 1 with dynamic sampling), averaged over seeds; mismatch vs mismatch_replayed
side by side, with the rollout/learner token- and sequence-ratio variances (`mismatch_ratio/*`) and, for
R3 arms, whether the replay held (`r3/replay_mismatch_frac`, max over steps) and its fallback share
(`r3/fallback_token_frac`); the per-layer routing change. When an arm ran with the routing-drift dial
(`rollout.router_flip_prob` / `router_noise_std`), a header line names those arms and a table gives each arm's
dial, its injected drift (`routing/dial_flip_frac`), the total and the natural drift (`analysis.dial_report`);
without the dial neither appears. Steps where a metric is null/NaN (e.g. a variance share
of an empty subset) are left out of its means. A figure whose inputs no run has is listed under
"Skipped" with the reason.
"""

from __future__ import annotations

import argparse
import math
import sys
import warnings
from pathlib import Path

import numpy as np

from analysis.compare_arms import ArmRun, Arms, arm_runs_from_dirs, check_run_dirs, load_arms
from analysis.compare_figures import COMPARE_FIGURES, COMPARE_STABILITY_FIGURES, all_layer_means, arm_layer_labels
from analysis.dial_report import ARM_COLUMNS, ARM_TABLE_TITLE, arm_dial_row, arms_intro_line
from analysis.figure_kit import render_figures
from analysis.load import (
    FINAL_REWARD_LABEL, ReportInputError, RunData, RunDataWarning, finite_mean, headline_numbers, series,
)
from analysis.outputs import check_outputs, read_error_message
from analysis.report import Page, ReportPaths, Table, fmt_number, write_page
from analysis.seed_report import arm_seed_statistics, fmt_estimate, seed_notes, seed_tables
from analysis.seed_stats import DEFAULT_COLLAPSE_DROP, DEFAULT_REPS, DEFAULT_REWARD_THRESHOLD, SeedStatistics

__all__ = ["ArmRun", "Arms", "arm_runs_from_dirs", "build_comparison", "comparison_tables", "load_arms", "main"]


TABLE_COLUMNS = ["arm", "seeds", "steps", f"{FINAL_REWARD_LABEL}: IQM over seeds [95% CI]",
                 f"{FINAL_REWARD_LABEL}: seed range (min–max)", "any-layer flip", "update expert change",
                 "clip token frac (binding)", "clip out-of-range frac", "gate weight mean (sapo)",
                 "gate frac < 0.5 (sapo)", "new/old ratio/token_var", "new/old ratio/seq_var", "actor/entropy",
                 "reward/frac_zero_std", "gen batches/step"]
MISMATCH_COLUMNS = ["arm", "k3 KL natural", "k3 KL replayed", "|Δ log p| > ln 2 natural",
                    "|Δ log p| > ln 2 replayed", "mean |Δ log p| natural", "mean |Δ log p| replayed",
                    "rollout/learner mismatch_ratio/token_var natural",
                    "rollout/learner mismatch_ratio/seq_var natural",
                    "R3 replay mismatch (max over steps; 0 = replay held)", "R3 fallback token frac"]
_MISMATCH_KEYS = ["mismatch/k3_kl", "mismatch_replayed/k3_kl", "mismatch/extreme_frac_ln2",
                  "mismatch_replayed/extreme_frac_ln2", "mismatch/logp_abs_diff_mean",
                  "mismatch_replayed/logp_abs_diff_mean", "mismatch_ratio/token_var", "mismatch_ratio/seq_var"]
_MEAN_KEYS = {"gate_weight_mean": "gate/weight_mean", "gate_below_half": "gate/token_frac_below_half",
              "token_var": "ratio/token_var", "seq_var": "ratio/seq_var", "entropy": "actor/entropy",
              "frac_zero_std": "reward/frac_zero_std", "num_gen_batches": "sampling/num_gen_batches"}
"""Arm-table numbers that are plain means over steps of one metric."""
_ROW_KEYS = ["any_layer_flip", "update_expert_change", "clip_token_frac", "clip_out_of_range_frac",
             "gate_weight_mean", "gate_below_half", "token_var", "seq_var", "entropy", "frac_zero_std",
             "num_gen_batches"]
_SUMMARY_KEYS = ["final_reward", *_ROW_KEYS] + _MISMATCH_KEYS


def arm_summary(runs: list[tuple[int, RunData]]) -> dict[str, float]:
    """Per-arm numbers of the comparison tables (NaN where no seed logged the metric)."""
    per_seed = []
    for _, run in runs:
        h = headline_numbers(run.records)
        row = {
            "final_reward": h["reward_last10_mean"],
            "num_steps": h["num_steps"],
            "any_layer_flip": h["any_layer_flip_mean"],
            "update_expert_change": h["update_expert_change_mean"],
            "clip_token_frac": h["clip_token_frac_mean"],
            "clip_out_of_range_frac": h["clip_out_of_range_frac_mean"],
        }
        row.update({k: finite_mean(series(run.records, key)[1]) for k, key in _MEAN_KEYS.items()})
        row.update({k: finite_mean(series(run.records, k)[1]) for k in _MISMATCH_KEYS})
        r3 = series(run.records, "r3/replay_mismatch_frac")[1]
        row["r3_mismatch_max"] = float(np.nanmax(r3)) if np.isfinite(r3).any() else math.nan
        row["r3_fallback"] = finite_mean(series(run.records, "r3/fallback_token_frac")[1])
        per_seed.append(row)
    out = {k: finite_mean(np.asarray([s[k] for s in per_seed])) for k in _SUMMARY_KEYS}
    r3 = np.asarray([s["r3_mismatch_max"] for s in per_seed], np.float64)
    out["r3_mismatch_max"] = float(np.nanmax(r3)) if np.isfinite(r3).any() else math.nan  # the worst seed
    out["r3_fallback"] = finite_mean(np.asarray([s["r3_fallback"] for s in per_seed]))
    finals = np.asarray([s["final_reward"] for s in per_seed], np.float64)
    finals = finals[np.isfinite(finals)]
    out["final_reward_min"] = float(finals.min()) if finals.size else math.nan
    out["final_reward_max"] = float(finals.max()) if finals.size else math.nan
    steps = [s["num_steps"] for s in per_seed]
    out["num_steps_min"] = min(steps, default=math.nan)
    out["num_steps_max"] = max(steps, default=math.nan)
    return out


def _range(lo: float, hi: float, integer: bool = False) -> str:
    """'lo–hi', or one number when they are equal (one seed); 'n/a' when unknown."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return "n/a"
    if lo == hi:
        return fmt_number(lo, integer)
    return f"{fmt_number(lo, integer)}–{fmt_number(hi, integer)}"


def comparison_tables(arms: Arms, stats: SeedStatistics | None = None) -> list[Table]:
    stats = stats if stats is not None else arm_seed_statistics(arms.runs)
    rows, mismatch_rows = [], []
    for arm, runs in arms.runs.items():
        s = arm_summary(runs)
        reward = fmt_estimate(stats.arms[arm]["final_reward"]) if arm in stats.arms else "n/a"
        rows.append([arm, f"{len(runs)}/{arms.expected[arm]}",
                     _range(s["num_steps_min"], s["num_steps_max"], integer=True), reward,
                     _range(s["final_reward_min"], s["final_reward_max"])]
                    + [fmt_number(s[k]) for k in _ROW_KEYS])
        mismatch_rows.append([arm] + [fmt_number(s[k]) for k in (*_MISMATCH_KEYS, "r3_mismatch_max", "r3_fallback")])
    dial, _ = dial_table(arms)
    return ([Table("Arms (means over steps, then over seeds)", TABLE_COLUMNS, rows)] + ([dial] if dial else [])
            + seed_tables(stats)
            + [Table("Train-inference mismatch: learner with natural routing vs replaying the rollout routes "
                     "(R3 arms; n/a elsewhere)", MISMATCH_COLUMNS, mismatch_rows)] + layer_table(arms))


def dial_table(arms: Arms) -> tuple[Table | None, list[str]]:
    """The routing-drift dial per arm (`analysis.dial_report`): (its table, the arms that ran with it); (None, [])
    when no arm did, so an undialled comparison reads as before."""
    rows, dialled = [], []
    for arm, runs in arms.runs.items():
        row, on = arm_dial_row(arm, [(run.config, run.records) for _, run in runs], fmt_number)
        rows.append(row)
        if on:
            dialled.append(arm)
    return (Table(ARM_TABLE_TITLE, ARM_COLUMNS, rows), dialled) if dialled else (None, [])


MAX_TABLE_LAYERS = 12
"""Up to this many MoE layers the per-layer table has one column per layer and metric; beyond it,
the mean over layers and the most-changed layer (the figure shows every layer)."""


def layer_table(arms: Arms) -> list[Table]:
    """Per arm, `update/layer_change` and `routing/layer_disagree` per MoE layer (mean over steps,
    then over seeds); no table when neither metric was logged."""
    means, num_layers = all_layer_means(arms)
    if num_layers == 0:
        return []
    labels = arm_layer_labels(arms, num_layers)
    names = {"update/layer_change": "update change", "routing/layer_disagree": "rollout/learner disagree"}
    per_layer = num_layers <= MAX_TABLE_LAYERS
    columns = ["arm"]
    for key, name in names.items():
        columns += ([f"{name} L{lab}" for lab in labels] if per_layer
                    else [f"{name}, mean over layers", f"{name}, max layer"])
    rows = []
    for arm in arms.runs:
        row = [arm]
        for key in names:
            m = means[key][arm]
            vals = np.full(num_layers, np.nan) if m is None else np.pad(
                m.mean_L, (0, num_layers - m.mean_L.size), constant_values=np.nan)
            if per_layer:
                row += [fmt_number(v) for v in vals]
            elif np.isfinite(vals).any():
                top = int(np.nanargmax(vals))
                row += [fmt_number(finite_mean(vals)), f"L{labels[top]}: {fmt_number(vals[top])}"]
            else:
                row += ["n/a", "n/a"]
        rows.append(row)
    return [Table("Routing change per MoE layer (fraction of tokens; mean over steps, then over seeds)",
                  columns, rows)]


def step_count_warning(arms: Arms) -> str | None:
    """One line when the runs compared have different numbers of steps (last logged step + 1), naming each
    length's runs; None when they agree. Per-run scalars (steps to threshold, final reward, reward AUC) of
    runs of different lengths are not comparable (20/30/10-step runs gave "steps to threshold −10")."""
    lengths: dict[int, list[str]] = {}
    for arm, runs in arms.runs.items():
        for seed, run in runs:
            steps = [r["step"] for r in run.records if isinstance(r.get("step"), int)]
            if steps:
                lengths.setdefault(max(steps) + 1, []).append(f"{arm} seed {seed}")
    if len(lengths) < 2:
        return None
    parts = "; ".join(f"{n} step{'s' if n != 1 else ''}: {', '.join(names)}" for n, names in sorted(lengths.items()))
    return (f"the runs compared have different numbers of steps ({parts}); steps to threshold, final reward "
            "and reward AUC then compare runs of different lengths")


def build_comparison(arm_runs: list[ArmRun], out_dir: str | Path,
                     title: str = "Ablation comparison", *,
                     reward_threshold: float = DEFAULT_REWARD_THRESHOLD,
                     collapse_drop: float = DEFAULT_COLLAPSE_DROP,
                     pairs: list[tuple[str, str]] | None = None, reps: int = DEFAULT_REPS) -> ReportPaths:
    """Write the comparison report of `arm_runs` into `out_dir`. Seed statistics: see
    `analysis.seed_stats` (`pairs` None: `arm_pairs`). Raises `ReportInputError` when no run has
    metric records or `pairs` names an arm without a readable run. Runs of different lengths: a
    `RunDataWarning` and a note at the top of the report (`step_count_warning`)."""
    arms = load_arms(arm_runs)  # a directory given twice: ReportInputError (analysis.compare_arms)
    if not any(arms.runs.values()):
        raise ReportInputError("no run of the comparison has metric records; nothing to compare")
    lengths_differ = step_count_warning(arms)
    if lengths_differ:
        warnings.warn(lengths_differ, RunDataWarning, stacklevel=2)
    stats = arm_seed_statistics(arms.runs, reward_threshold=reward_threshold, collapse_drop=collapse_drop,
                                pairs=pairs, reps=reps)
    dialled = dial_table(arms)[1]
    page = Page(title=title, intro=[f"{sum(map(len, arms.runs.values()))} runs in {len(arms.runs)} arms",
                                    *([arms_intro_line(dialled, len(arms.runs))] if dialled else []),
                                    *([f"Warning: {lengths_differ}."] if lengths_differ else []),
                                    *seed_notes(stats, reward_threshold, collapse_drop)])
    page.tables += comparison_tables(arms, stats)
    page.figures = render_figures(COMPARE_FIGURES + COMPARE_STABILITY_FIGURES, arms)
    page.notes = arms.notes
    return write_page(page, out_dir, flag="OUT_DIR")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m analysis.compare",
                                     description="Compare training runs grouped by arm.")
    parser.add_argument("out_dir", help="directory to write report.html, report.md and the figures into "
                                        "(created when missing)")
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                        help="training run directories; those named <arm>-s<seed> (as moe_gspo.ablate names them) "
                             "are grouped by arm, any other is an arm of one seed")
    parser.add_argument("--reward-threshold", type=float, default=DEFAULT_REWARD_THRESHOLD,
                        help="reward the smoothed reward/mean must reach for 'steps to threshold' (default %(default)s)")
    parser.add_argument("--collapse-drop", type=float, default=DEFAULT_COLLAPSE_DROP,
                        help="drop below the running best of the 10-step trailing mean reward that counts as "
                             "a collapse (pre-registered default %(default)s; moe_gspo.algos.collapse)")
    parser.add_argument("--bootstrap-reps", type=int, default=DEFAULT_REPS,
                        help="bootstrap resamples per arm and per pair (default %(default)s)")
    parser.add_argument("--pair", action="append", metavar="ARM_A,ARM_B",
                        help="compare these two arms (repeatable); default: every pair up to 6 arms, else the "
                             "pairs whose names differ in one '-' component")
    args = parser.parse_args(argv)
    pairs = [tuple(p.split(",", 1)) for p in args.pair] if args.pair else None
    if pairs and any(len(p) != 2 for p in pairs):
        parser.error("--pair takes ARM_A,ARM_B")
    try:
        check_outputs(dirs={"OUT_DIR": args.out_dir})  # read-only, a regular file: one line, before any compute
        check_run_dirs(args.run_dirs)  # a missing or repeated RUN_DIR: one line, exit 2, before anything is read
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RunDataWarning)
            paths = build_comparison(arm_runs_from_dirs(args.run_dirs), args.out_dir,
                                     reward_threshold=args.reward_threshold, collapse_drop=args.collapse_drop,
                                     pairs=pairs, reps=args.bootstrap_reps)
    except (ReportInputError, OSError) as e:  # an OSError left here is a run's file that cannot be read
        print(f"error: {e if isinstance(e, ReportInputError) else read_error_message(e, 'an input file')}",
              file=sys.stderr)
        return 2
    for w in caught:
        if issubclass(w.category, RunDataWarning):
            print(f"warning: {w.message}", file=sys.stderr)
    print(paths.markdown)
    print(paths.html)
    return 0


if __name__ == "__main__":
    sys.exit(main())
