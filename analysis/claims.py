"""The claims page of the drift experiment: `python -m analysis.claims RUNS_DIR|METRICS.jsonl.gz
[--out FILE.md] [--figures DIR] [--save-metrics FILE.jsonl.gz]`.

RUNS_DIR holds runs named `<algo>-<replay>-<variant>-s<seed>` (`moe_gspo.ablate`; variant = drift level
fp32 / bf16 / fp8 / w8a8, optionally `_tis`); the page has the sections whose arms are present, with
these pre-registered tests, all Holm-adjusted as one family (`analysis.claims_stats`):

- positive control: GRPO-none with bf16 rollouts (else at the strongest drift level present) fails in at
  least half its runs (the failure rate's point estimate; its Clopper-Pearson CI is reported, no test);
- dose-response: GRPO-none at each drift level against GRPO-none at fp32, log-rank on time to failure;
- fixes at the strongest drift: GRPO+R3, GRPO+R2, GRPO token-TIS and GSPO against GRPO-none, log-rank
  (primary), paired-by-seed final reward and reward AUC (secondary);
- zero point: GSPO-fp32 and GRPO+R3-fp32 against GRPO-fp32 (log-rank; the claim: no difference);

Exploratory, a Holm family of its own (not pre-registered): (a) R3, per R3 arm, k3 KL of the learner's
natural routing against the pass replaying the rollout routes, within runs (Wilcoxon over seeds); beside
it the median per-step ratio and the absolute k3.

Described, not tested: the drift per level against the papers' ~10% / ~94% / 1.5e-3, (c) the
token/sequence ratio-variance quotient (a sanity check: ≈ the response length for near-independent
token ratios), (d) experts changed per update without step 0, at constant lr and during the lr decay.
A run fails when `moe_gspo.algos.collapse.detect_failure` finds a collapse or a stall (pre-registered
`FailureCriteria`). Numbers per run come from `metrics.jsonl` only, so the saved metrics regenerate
the same tables.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping

from analysis import stats as st
from analysis.claims_runs import (
    CLAIM_KEYS, ClaimRun, arm_level, level_rank, load_arms, load_runs, save_metrics,
)
from analysis.claims_stats import (
    ClaimTest, arm_survival, claim_family, failure_rate, fix_arms, fmt_median, positive_control_arm, r3_family,
    strongest_level,
)
from analysis.load import ReportInputError
from analysis.matrix_runs import emit_page
from moe_gspo.algos.collapse import FailureCriteria

__all__ = ["CLAIM_KEYS", "claims_page", "load_arms", "main"]

PAPER_DRIFT = {"layer_disagree": "~10% (R3 paper)", "any_layer_flip": "~94% of tokens in ≥ 1 of 48 layers (R3 paper)",
               "k3_natural": "~1.5e-3 (R3 paper)"}
LABELS = {
    "final_reward": "final reward", "reward_auc": "reward AUC", "layer_disagree": "per-layer flips",
    "any_layer_flip": "any-layer flips", "k3_natural": "k3 KL natural", "k3_replayed": "k3 KL replayed",
    "k3_ratio_of_means": "ratio of means (k3 natural / replayed)",
    "k3_ratio_median": "median per-step ratio", "var_quotient": "median token_var / seq_var",
    "update_change": "expert change, steps > 0", "update_change_const": "at constant lr",
    "update_change_decay": "during lr decay", "final_entropy": "entropy, last 10%",
    "final_zero_std": "zero-signal groups, last 10%",
}


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return out + ["| " + " | ".join(r) + " |" for r in rows] + [""]


def _est(arm: str, runs: list[ClaimRun], key: str, reps: int, seed: int) -> str:
    return st.fmt_ci(st.bootstrap_ci([r.scores[key] for r in runs], reps=reps, seed=st.stream_seed(seed, key, arm)))


def _arm_rows(arms: Mapping[str, list[ClaimRun]], keys: list[str], reps: int, seed: int) -> list[list[str]]:
    return [[arm, str(len(runs))] + [_est(arm, runs, k, reps, seed) for k in keys] for arm, runs in arms.items()]


def _by_level(arms: Mapping[str, list[ClaimRun]]) -> dict[str, list[ClaimRun]]:
    return dict(sorted(arms.items(), key=lambda kv: (level_rank(arm_level(kv[0])), kv[0])))


def _tests_table(tests: list[ClaimTest]) -> list[str]:
    if not tests:
        return ["No test: its arms are not in this experiment.", ""]
    return _table(["test", "statistic", "estimate", "p", "Holm-adjusted p", "verdict"],
                  [[t.label, t.test, t.estimate, st.fmt_p(t.p), st.fmt_p(t.p_holm), t.verdict] for t in tests])


def failure_table(arms: Mapping[str, list[ClaimRun]], reps: int, seed: int) -> list[str]:
    rows = []
    for arm, runs in _by_level(arms).items():
        s = arm_survival(runs)
        kinds = [r.failure.kind for r in runs]
        rows.append([arm, str(len(runs)), st.fmt_rate(failure_rate(runs)), str(kinds.count("collapse")),
                     str(kinds.count("stall")), fmt_median(s)]
                    + [_est(arm, runs, k, reps, seed) for k in ("final_reward", "reward_auc", "final_entropy",
                                                                 "final_zero_std")])
    return _table(["arm", "seeds", "failed (collapse or stall)", "collapses", "stalls", "median time to failure (KM)",
                   "final reward", "reward AUC", "entropy, last 10%", "zero-signal groups, last 10%"], rows)


def _header(arms: Mapping[str, list[ClaimRun]], tests: list[ClaimTest], reps: int, seed: int) -> list[str]:
    c = FailureCriteria()
    n = sorted({len(rs) for rs in arms.values()})
    return [
        f"Arms: {len(arms)}; seeds per arm: {', '.join(map(str, n))}; pre-registered tests: {len(tests)}, "
        "Holm-adjusted as one family (alpha 0.05).", "",
        f"Failure (pre-registered, `moe_gspo.algos.collapse.FailureCriteria`): with R̄ / Z̄ the {c.window}-step "
        "trailing means of reward/mean and reward/frac_zero_std, a run collapses at step t when R̄ is ≥ "
        f"{c.drop:g} below its running best and stays there to the end, and stalls when Z̄ ≥ {c.stall_enter:g} "
        f"and R̄ < {c.solved:g} at t and Z̄ ≥ {c.stall_stay:g}, R̄ < {c.solved:g} to the end; the event counts "
        f"when t is ≥ {c.min_persist} steps before the end (else censored at the last step). Time to failure: "
        "Kaplan–Meier (lifelines), log-rank tests.", "",
        f"Cells: interquartile mean over seeds [95% percentile bootstrap CI, {reps} resamples, each arm and "
        f"quantity its own stream from seed {seed}], printed to the digits the CI supports; rates: k/n with the "
        "exact Clopper–Pearson 95% CI. Pairs sharing train.seed values are paired by seed (Wilcoxon "
        "signed-rank), others unpaired (Mann–Whitney U). Verdicts: reproduces / does not reproduce when the "
        "Holm-adjusted p < 0.05 (by the effect's direction), else not decided with the seeds per arm a "
        "two-sided t-test at 0.05 (before Holm's correction) would need for 80% power at the observed effect size "
        "(log-rank rows: on the 0/1 failure indicator). Final reward: mean reward/mean "
        "of the last 10% of steps; reward AUC: mean over all steps.", ""]


def _positive_control(arms: Mapping[str, list[ClaimRun]], top: str | None) -> list[str]:
    base = positive_control_arm(arms)
    if base is None:
        return ["No GRPO-none arm.", ""]
    r = failure_rate(arms[base])
    holds = "holds" if r.point >= 0.5 else "does not hold"
    lo = ("its 95% CI's lower bound is at or above 0.5 too" if r.lo >= 0.5
          else "the 95% CI's lower bound is below 0.5")
    out = [f"Pre-registered: GRPO-none with bf16 rollouts fails in at least half its seeds. {base}: failed "
           f"{st.fmt_rate(r)} → the positive control **{holds}** (point estimate {'≥' if r.point >= 0.5 else '<'} "
           f"0.5; {lo})."]
    if top is not None and f"grpo-none-{top}" != base:
        strongest = f"grpo-none-{top}"
        out.append(f"At the strongest drift present, {strongest} failed {st.fmt_rate(failure_rate(arms[strongest]))}.")
    return out + [""]


def _dose_table(arms: Mapping[str, list[ClaimRun]]) -> list[str]:
    rows = []
    for arm, runs in _by_level(arms).items():
        rows.append([arm, arm_level(arm), st.fmt_rate(failure_rate(runs)), fmt_median(arm_survival(runs))])
    return _table(["arm", "drift level", "failure rate", "median time to failure (KM)"], rows)


def claims_page(arms: Mapping[str, list[ClaimRun]], reps: int = st.DEFAULT_REPS, seed: int = 0) -> str:
    """The Markdown of the page (tables only; `--figures` draws the figures)."""
    tests = claim_family(arms, reps, seed)
    sec = lambda name: [t for t in tests if t.section == name]  # noqa: E731
    top = strongest_level(arms)
    lines = _header(arms, tests, reps, seed)
    lines += ["### Drift per level (rollout engine vs learner, response tokens, mean over steps)", ""]
    keys = ["layer_disagree", "any_layer_flip", "k3_natural"]
    rows = _arm_rows(_by_level(arms), keys, reps, seed)
    rows.append(["papers (Qwen3-30B-A3B)", ""] + [PAPER_DRIFT[k] for k in keys])
    lines += _table(["arm", "seeds"] + [LABELS[k] for k in keys], rows)
    lines += ["### Failures per arm", ""] + failure_table(arms, reps, seed)
    lines += ["### Positive control", ""] + _positive_control(arms, top)
    lines += ["### Dose–response: GRPO-none at each drift level against fp32", ""]
    lines += _dose_table({a: r for a, r in arms.items() if a.startswith("grpo-none-") and "_" not in a})
    lines += _tests_table(sec("dose-response"))
    present = [f"{label} ({a})" for a, label in fix_arms(top)] if top else []
    lines += [f"### Fixes at the strongest drift ({top or 'n/a'}): against grpo-none-{top or '?'}", "",
              f"Fixes looked for: {', '.join(present) or 'none'}.", ""] + _tests_table(sec("fixes"))
    lines += ["### Zero point (fp32 rollouts: no routing drift)", ""] + _tests_table(sec("zero point"))
    lines += ["### (a) R3 lowers the rollout/learner mismatch (R3 paper ~2×, prime-rl 3–7×; k3 ~1.5e-3)", ""]
    r3 = {a: r for a, r in _by_level(arms).items() if a.startswith("grpo-r3-")}
    keys = ["k3_natural", "k3_replayed", "k3_ratio_of_means", "k3_ratio_median"]
    lines += (_table(["arm", "seeds"] + [LABELS[k] for k in keys], _arm_rows(r3, keys, reps, seed)) if r3
              else ["No R3 arm.", ""])
    lines += ["Exploratory (not pre-registered): Holm over these tests only.", ""]
    lines += _tests_table(r3_family(arms, reps, seed))
    lines += ["### (c) Sanity check, not a reproduction: token vs sequence ratio variance", "",
              "Median over steps of ratio/token_var / ratio/seq_var (new/old policy ratios in the update). For "
              "near-independent per-token ratios the quotient is about the response length, whatever the method.", ""]
    lines += _table(["arm", "seeds", LABELS["var_quotient"]], _arm_rows(_by_level(arms), ["var_quotient"], reps, seed))
    lines += ["### (d) Experts changed by one optimizer step (GSPO paper: ~10%, 48 MoE layers)", "",
              "update/expert_change_frac without step 0 (Adam's first step alone changes ~half); constant lr: steps "
              "at the run's largest train/lr; decay: steps below it (n/a where train/lr was not logged).", ""]
    keys = ["update_change", "update_change_const", "update_change_decay"]
    layers = lambda arm: ", ".join(sorted({str(int(r.scores["num_moe_layers"])) for r in arms[arm]  # noqa: E731
                                           if r.scores["num_moe_layers"] > 0})) or "n/a"
    rows = [row + [f"{layers(row[0])} (paper: 48)"] for row in _arm_rows(_by_level(arms), keys, reps, seed)]
    lines += _table(["arm", "seeds"] + [LABELS[k] for k in keys] + ["MoE layers"], rows)
    lines += ["### All pre-registered tests (one Holm family)", ""] + _tests_table(tests)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m analysis.claims", description=__doc__.split("\n\n")[0])
    p.add_argument("runs_dir", help="the matrix's out_dir, or a .jsonl.gz written by --save-metrics")
    p.add_argument("--save-metrics", default=None, metavar="FILE.jsonl.gz",
                   help="also save the metrics the claims read, per finished run (to regenerate the page)")
    p.add_argument("--out", default=None, help="write the Markdown here (temp file, then rename); else stdout")
    p.add_argument("--figures", default=None, metavar="DIR", help="write the dose-response and KM figures here")
    p.add_argument("--bootstrap-reps", type=int, default=st.DEFAULT_REPS)
    p.add_argument("--seed", type=int, default=0, help="base seed of the bootstrap streams")
    args = p.parse_args(argv)
    from analysis.outputs import check_outputs, read_error_message, writing_output

    try:
        check_outputs(dirs={"--figures": args.figures}, files={"--out": args.out, "--save-metrics": args.save_metrics})
        try:
            runs = load_runs(args.runs_dir)
        except OSError as e:  # a run directory's file that cannot be read
            raise ReportInputError(read_error_message(e, "an input file")) from None
        if args.save_metrics:
            with writing_output("--save-metrics", args.save_metrics):
                save_metrics(runs, args.save_metrics)
        arms = load_arms(runs)
        if not arms:
            raise ReportInputError(f"no run named <algo>-<replay>-<variant>-s<seed> in {args.runs_dir}")
        text = claims_page(arms, reps=args.bootstrap_reps, seed=args.seed)
        if args.figures:
            from analysis.claims_figures import write_figures

            with writing_output("--figures", args.figures):
                write_figures(arms, args.figures)
        return emit_page(text, args.out)
    except ReportInputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
