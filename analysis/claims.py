"""The paper-claims experiment's verdicts: `python -m analysis.claims RUNS_DIR [--out FILE.md]`.

RUNS_DIR holds the runs of `configs/ablation_paper_claims_fine.yaml` (`<algo>-<replay>-<precision>-s<seed>`,
precision bf16 or fp8). For each claim the page states the per-arm interquartile means with 95%
stratified-bootstrap CIs over seeds and, where two arms are compared, the IQM difference, the
probability of improvement and a verdict (`analysis.seed_stats`, rliable):

- (a) R3 lowers the rollout/learner mismatch KL (R3 paper ~2x, prime-rl 3-7x on Qwen3-30B-A3B): per R3
  run, mean over steps of `mismatch/k3_kl` (learner with its natural routing) over that of
  `mismatch_replayed/k3_kl` (the learner pass replaying the rollout's routes: the pi_old R3's loss uses);
  and across arms, the k3 KL of the pi_old each loss uses (replayed for R3, natural otherwise).
- (b) when routing drifts (FP8), GRPO without replay is less stable than GRPO+R3 and GSPO: final
  reward, reward AUC and collapse, GRPO-fp8 against GRPO+R3-fp8 and GSPO-fp8, and each method's
  bf16 against its FP8 arm.
- (c) GSPO's sequence-ratio variance stays far below the token ratio's, and GSPO trains as stably under
  FP8 as under bf16: per run, the median over steps of `ratio/token_var` / `ratio/seq_var` (new/old
  policy ratios inside the update); GSPO bf16 against GSPO fp8.
- (d) about 10% of experts change per update (GSPO paper): mean over the measured steps of
  `update/expert_change_frac` (learner routing of the step's response rows before vs after the first
  optimizer step: the share of (token, layer) top-k entries that changed).

Pure reading and statistics (no plotting); numbers per run come from `metrics.jsonl` only.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import re
import sys
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from analysis.load import ReportInputError, RunData, finite_mean, load_run, matrix_series, series
from analysis.report import fmt_number
from analysis.seed_report import fmt_estimate, run_quantities
from analysis.seed_stats import QUANTITY, Quantity, arm_estimates, compare_arms

_RUN_RE = re.compile(r"^(?P<algo>[a-z_]+)-(?P<replay>none|r2|r3)-(?P<precision>[A-Za-z0-9_.]+)-s(?P<seed>\d+)$")

EXTRA = {q.key: q for q in (
    Quantity("k3_natural", "k3 KL, rollout vs learner (natural routing)", False),
    Quantity("k3_replayed", "k3 KL, rollout vs learner replaying the rollout routes", False),
    Quantity("k3_reduction", "k3 natural / k3 replayed", True),
    Quantity("k3_loss", "k3 KL, rollout vs the pi_old the loss uses", False),
    Quantity("extreme_natural", "|dlogp| > ln 2, natural", False),
    Quantity("extreme_replayed", "|dlogp| > ln 2, replayed", False),
    Quantity("layer_disagree", "routing disagreement per MoE layer (mean over layers)", False),
    Quantity("any_layer_flip", "tokens routed differently in >= 1 layer", False),
    Quantity("var_quotient", "median over steps of token_var / seq_var", True),
    Quantity("update_change", "update/expert_change_frac", False),
    Quantity("final_entropy", "entropy, last 10% of steps (nats/token)", True),
    Quantity("final_zero_std", "groups with all-equal rewards, last 10%", False),
    Quantity("update_any_layer", "update/any_layer_change", False),
    Quantity("update_layer_change", "update/layer_change (mean over layers)", False),
)}
QUANTITIES = {**QUANTITY, **EXTRA}
PRECISIONS = ("bf16", "fp8")


def _mean(run, key: str) -> float:
    return finite_mean(series(run.records, key)[1])


def _last10(run, key: str) -> float:
    vals = series(run.records, key)[1]
    return finite_mean(vals[-max(1, vals.size // 10):]) if vals.size else math.nan


DEFAULT_THRESHOLD = 0.5
"""Reward level for `steps_to_threshold` here: 250-step runs of the fine model end near 0.55-0.8."""


def run_scores(run, reward_threshold: float = DEFAULT_THRESHOLD) -> dict[str, float]:
    """Every per-run scalar the claims use (NaN where the run did not log the metric)."""
    q = run_quantities(run, reward_threshold=reward_threshold)
    k3_nat, k3_rep = _mean(run, "mismatch/k3_kl"), _mean(run, "mismatch_replayed/k3_kl")
    _, ld = matrix_series(run.records, "routing/layer_disagree")
    _, lc = matrix_series(run.records, "update/layer_change")
    _, tok = series(run.records, "ratio/token_var")
    _, seq = series(run.records, "ratio/seq_var")
    ok = np.isfinite(tok) & np.isfinite(seq) & (seq > 0)
    return {
        "final_reward": q.final_reward, "reward_auc": q.reward_auc,
        "steps_to_threshold": float(q.steps_to_threshold), "collapsed": float(q.collapsed),
        "mismatch_kl": k3_nat, "k3_natural": k3_nat, "k3_replayed": k3_rep,
        "k3_reduction": k3_nat / k3_rep if k3_rep > 0 else math.nan,
        "k3_loss": k3_rep if math.isfinite(k3_rep) else k3_nat,
        "extreme_natural": _mean(run, "mismatch/extreme_frac_ln2"),
        "extreme_replayed": _mean(run, "mismatch_replayed/extreme_frac_ln2"),
        "layer_disagree": finite_mean(ld.mean(axis=1)) if ld.size else math.nan,
        "any_layer_flip": _mean(run, "routing/any_layer_flip"),
        "var_quotient": float(np.median(tok[ok] / seq[ok])) if ok.any() else math.nan,
        "update_change": _mean(run, "update/expert_change_frac"),
        "update_any_layer": _mean(run, "update/any_layer_change"),
        "update_layer_change": finite_mean(lc.mean(axis=1)) if lc.size else math.nan,
        "final_entropy": _last10(run, "actor/entropy"), "final_zero_std": _last10(run, "reward/frac_zero_std"),
    }


CLAIM_KEYS = ("step", "reward/mean", "mismatch/k3_kl", "mismatch_replayed/k3_kl", "mismatch/extreme_frac_ln2",
              "mismatch_replayed/extreme_frac_ln2", "routing/layer_disagree", "routing/any_layer_flip",
              "ratio/token_var", "ratio/seq_var", "update/expert_change_frac", "update/any_layer_change",
              "update/layer_change", "actor/entropy", "reward/frac_zero_std")
"""The metrics the claims read: `--save-metrics` keeps only these (a few % of metrics.jsonl)."""


def _finished_runs(runs_dir: Path) -> list[RunData]:
    runs = []
    for d in sorted(runs_dir.iterdir()):
        if _RUN_RE.match(d.name) and (d / "done.json").is_file():
            runs.append(load_run(d))
    return runs


def _saved_runs(path: Path) -> list[RunData]:
    with gzip.open(path, "rt") as f:
        return [RunData(source=Path(row["run"]), records=row["records"], traces={}) for row in map(json.loads, f)]


def load_runs(source: str | Path) -> list[RunData]:
    """The finished runs (with done.json) of a matrix directory, or those saved by `save_metrics`."""
    source = Path(source)
    if not source.exists():
        raise ReportInputError(f"{str(source)!r} does not exist; pass the matrix's out_dir or a .jsonl.gz file "
                               "written by --save-metrics")
    runs = _saved_runs(source) if source.is_file() else _finished_runs(source)
    if not runs:
        raise ReportInputError(f"no finished run named <algo>-<replay>-<precision>-s<seed> under {source}")
    return runs


def save_metrics(runs: list[RunData], path: str | Path) -> None:
    """One gzip'd JSON line per run with the `CLAIM_KEYS` of its records (temp file, then rename)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with gzip.open(tmp, "wt") as f:
        for run in runs:
            recs = [{k: r[k] for k in CLAIM_KEYS if k in r} for r in run.records]
            f.write(json.dumps({"run": run.source.name, "records": recs}) + "\n")
    tmp.replace(path)


def load_arms(source: str | Path | list[RunData],
              reward_threshold: float = DEFAULT_THRESHOLD) -> dict[str, list[dict[str, float]]]:
    """{arm name: per-seed scores} of the finished runs of `source` (see `load_runs`)."""
    runs = load_runs(source) if not isinstance(source, list) else source
    arms: dict[str, list[dict[str, float]]] = {}
    for run in runs:
        m = _RUN_RE.match(run.source.name)
        if m:
            arms.setdefault(f"{m['algo']}-{m['replay']}-{m['precision']}", []).append(
                run_scores(run, reward_threshold))
    return dict(sorted(arms.items()))


def _columns(seeds: list[dict[str, float]]) -> dict[str, list[float]]:
    return {k: [s[k] for s in seeds] for k in seeds[0]}


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return out + ["| " + " | ".join(r) + " |" for r in rows]


def arm_table(arms: Mapping[str, list[dict[str, float]]], keys: list[str], reps: int) -> list[str]:
    """One row per arm: seeds, then IQM [95% CI] of each key (the mean for a rate)."""
    rows = []
    for arm, seeds in arms.items():
        est = arm_estimates(_columns(seeds), reps=reps, quantities=QUANTITIES)
        rows.append([arm, str(len(seeds))] + [fmt_estimate(est[k]) for k in keys])
    return _table(["arm", "seeds"] + [QUANTITIES[k].label for k in keys], rows)


def pair_table(arms: Mapping[str, list[dict[str, float]]], pairs: list[tuple[str, str]], keys: list[str],
               reps: int) -> list[str]:
    """Per pair and key: IQM difference A - B [CI], P(A better) [CI], verdict."""
    rows = []
    for a, b in pairs:
        if a not in arms or b not in arms:
            rows.append([f"{a} vs {b}", "all", "n/a", "n/a", "not run"])
            continue
        ca, cb = _columns(arms[a]), _columns(arms[b])
        ca, cb = {k: ca[k] for k in keys}, {k: cb[k] for k in keys}
        for c in compare_arms(a, b, ca, cb, reps=reps, quantities={k: QUANTITIES[k] for k in keys}):
            rows.append([f"{a} vs {b}", QUANTITIES[c.key].label, fmt_estimate(c.diff), fmt_estimate(c.poi),
                         c.verdict])
    return _table(["pair (A vs B)", "quantity", "IQM difference A − B [95% CI]", "P(A better) [95% CI]",
                   "verdict"], rows)


def claims_page(arms: Mapping[str, list[dict[str, float]]], reps: int = 2000,
                reward_threshold: float = DEFAULT_THRESHOLD) -> str:
    """The Markdown tables of claims (a)-(d) and the drift levels."""
    a = lambda algo, rep, prec: f"{algo}-{rep}-{prec}"  # noqa: E731
    n = sorted({len(s) for s in arms.values()})
    lines = [f"Arms: {len(arms)}; seeds per arm: {', '.join(map(str, n))}. Cells: interquartile mean over seeds "
             "[95% stratified-bootstrap CI] (rliable; rates: the mean). Verdicts: the 95% CI of the IQM difference "
             "excludes 0, else 'not decided'. Final reward: mean of the last 10% of steps; reward AUC: mean over all "
             f"steps; steps to threshold: first step whose 10%-window moving average reaches {reward_threshold:g} "
             "(never: steps + 1); collapse: that average ends >= 0.3 below its best.", ""]
    lines += ["### Drift levels (rollout engine vs learner, response tokens, mean over steps)", ""]
    lines += arm_table(arms, ["layer_disagree", "any_layer_flip", "k3_natural"], reps) + [""]
    lines += ["### (a) R3 and the rollout/learner mismatch", ""]
    r3 = {k: v for k, v in arms.items() if "-r3-" in k}
    if r3:
        lines += arm_table(r3, ["k3_natural", "k3_replayed", "k3_reduction", "extreme_natural", "extreme_replayed"],
                           reps) + [""]
    lines += pair_table(arms, [(a("grpo", "r3", p), a("grpo", "none", p)) for p in PRECISIONS], ["k3_loss"], reps)
    lines += ["", "### (b) Stability when routing drifts", ""]
    lines += arm_table(arms, ["final_reward", "reward_auc", "steps_to_threshold", "collapsed", "final_entropy",
                              "final_zero_std"], reps) + [""]
    pairs = [(a("grpo", "r3", "fp8"), a("grpo", "none", "fp8")), (a("gspo", "none", "fp8"), a("grpo", "none", "fp8")),
             (a("grpo", "r2", "fp8"), a("grpo", "none", "fp8")), (a("grpo", "r3", "bf16"), a("grpo", "none", "bf16")),
             (a("gspo", "none", "bf16"), a("grpo", "none", "bf16")), (a("grpo", "none", "bf16"), a("grpo", "none", "fp8")),
             (a("grpo", "r3", "bf16"), a("grpo", "r3", "fp8"))]
    lines += pair_table(arms, pairs, ["final_reward", "reward_auc", "collapsed", "final_entropy"], reps)
    lines += ["", "### (c) GSPO: token vs sequence ratio variance, and FP8 against bf16", ""]
    lines += arm_table(arms, ["var_quotient"], reps) + [""]
    lines += pair_table(arms, [(a("gspo", "none", "bf16"), a("gspo", "none", "fp8"))],
                        ["final_reward", "reward_auc", "collapsed"], reps)
    lines += ["", "### (d) Experts changed by one optimizer step", ""]
    lines += arm_table(arms, ["update_change", "update_layer_change", "update_any_layer"], reps)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m analysis.claims", description=__doc__.split("\n\n")[0])
    p.add_argument("runs_dir", help="the matrix's out_dir, or a .jsonl.gz written by --save-metrics")
    p.add_argument("--save-metrics", default=None, metavar="FILE.jsonl.gz",
                   help="also save the metrics the claims read, per finished run (to regenerate the page)")
    p.add_argument("--out", default=None, help="write the Markdown here (temp file, then rename); else stdout")
    p.add_argument("--bootstrap-reps", type=int, default=2000)
    p.add_argument("--reward-threshold", type=float, default=DEFAULT_THRESHOLD)
    args = p.parse_args(argv)
    try:
        runs = load_runs(args.runs_dir)
        if args.save_metrics:
            save_metrics(runs, args.save_metrics)
        text = claims_page(load_arms(runs, args.reward_threshold), reps=args.bootstrap_reps,
                           reward_threshold=args.reward_threshold)
    except (ReportInputError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.out is None:
        print(text)
        return 0
    from moe_gspo.run.sinks import atomic_write_text

    atomic_write_text(Path(args.out), text)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
