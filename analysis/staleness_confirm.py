"""Experiment 6R's pre-registered analysis (docs/experiment6r_training.md): `python -m analysis.staleness_confirm
RUNS_DIR|METRICS.jsonl.gz [--out FILE.md] [--figures DIR] [--save-metrics FILE.jsonl.gz] [--bootstrap-reps N]
[--seed S]`.

RUNS_DIR is an ablation's out_dir whose runs are named `<algo>-<replay>-<variant>-s<seed>`
(`python -m moe_gspo.ablate --config configs/ablation_training_exp6r.yaml`). The page:
- per arm: final reward (mean `reward/mean` over the last 10% of steps; `analysis.phase_runs`) as IQM [bootstrap CI]
  and mean [t CI], reward AUC, stalls (final reward < `SOLVED`, 0.9) and failures with exact Clopper-Pearson CIs;
- the one pre-registered test, `H1`: GSPO minus GRPO at N = 16 mini-batches per rollout, final reward paired by
  seed, the two-sided sign-flip permutation test of the mean difference (`analysis.staleness_exploratory.sign_flip_p`)
  with its 95% t CI; decided when p <= 0.05 and the mean is > 0; a not-decided H1 whose CI's upper end is below
  `SESOI` is "no effect of the pilot's size";
- the controls, each a test of its own at α 0.05 with the same statistic: zero mismatch (GRPO+R2 vs GRPO at N = 1,
  expected not decided) and positive (GRPO with experiment 4's `pos` overrides vs GRPO at N = 4, expected decided
  lower); the verdict line applies the pre-registered rules (a missed positive control fails the experiment);
- descriptive: H1's stalls by seed (only GSPO / only GRPO stalled) and McNemar's exact p.
Numbers come from `metrics.jsonl` only, so `--save-metrics`' file regenerates the same page; `--figures` draws the
staleness figure (`analysis.staleness_figures`) of the `mb<N>` arms.
"""

from __future__ import annotations

import math
import sys

from analysis import stats as st
from analysis.load import ReportInputError
from analysis.matrix_runs import md_table, page_parser, run_page
from analysis.phase_runs import SOLVED, PhaseRun, load_phase, save_metrics
from analysis.phase_stats import GRPO, arms
from analysis.staleness import load_runs, staleness_arms
from analysis.staleness_exploratory import fmt_mean, mcnemar_p, paired_mean

H1 = ("H1", ("gspo-none", "mb16"), (GRPO, "mb16"), 1.0)
"""(name, arm A, arm B, claimed sign of A − B): the family of one."""
CONTROLS = (("zero mismatch", ("grpo-r2", "mb1"), (GRPO, "mb1"), 0.0),
            ("positive", (GRPO, "pos"), (GRPO, "mb4"), -1.0))
"""Instrument checks, each at α 0.05: claimed sign 0 = expected not decided; -1 = expected decided, A lower."""
ALPHA = 0.05
SESOI = 0.035
"""Half of experiment 6's post-hoc estimate (+0.070): a not-decided H1 with its CI below it rules out the pilot's size."""

Arms = dict[str, dict[str, dict[int, PhaseRun]]]


def _arm(by: Arms, key: tuple[str, str]) -> dict[int, PhaseRun]:
    arm = by.get(key[0], {}).get(key[1])
    if not arm:
        raise ReportInputError(f"no run of arm {key[0]}-{key[1]} (runs named {key[0]}-{key[1]}-s<seed>); is this "
                               "experiment 6R's matrix (configs/ablation_training_exp6r.yaml)?")
    return arm


def decided(r: dict, sign: float) -> bool:
    """p <= ALPHA in the claimed direction (`sign` +1 / -1); for sign 0, in either direction."""
    if not (r["p"] <= ALPHA) or r["mean"] == 0:
        return False
    return sign == 0 or math.copysign(1.0, r["mean"]) == sign


def _fmt(r: dict) -> list[str]:
    return [str(r["n"]), fmt_mean(r), st.fmt_p(r["p"])]


def verdicts(by: Arms) -> tuple[dict, list[dict], str]:
    """(H1's result, the controls' results, the pre-registered rules' verdict line)."""
    _, ka, kb, sign = H1
    h1 = paired_mean(_arm(by, ka), _arm(by, kb))
    h1["decided"] = decided(h1, sign)
    ctrl = []
    for cname, ca, cb, csign in CONTROLS:
        r = paired_mean(_arm(by, ca), _arm(by, cb))
        r["decided"] = decided(r, csign)
        r["name"], r["expect"] = cname, csign
        ctrl.append(r)
    zero, pos = ctrl
    if not pos["decided"]:
        line = ("**The experiment failed**: the positive control was not decided, so by the pre-registered rule H1 is "
                "not interpreted.")
    elif h1["decided"]:
        line = "**H1 decided: GSPO's final reward is higher than GRPO's at N = 16.**"
        if zero["decided"]:
            line += (" The zero-mismatch control was decided too, so a difference arises without staleness: H1 is "
                     "reported as not attributable to staleness.")
    elif math.isfinite(h1["hi"]) and h1["hi"] < SESOI:
        line = f"**H1 not decided; its CI's upper end is below {SESOI:+.3f}: no effect of the pilot's size.**"
    else:
        line = "**H1 not decided.**"
    return h1, ctrl, line


def arm_rows(by: Arms, reps: int, seed: int) -> list[str]:
    rows = []
    for method, doses in by.items():
        for dose, arm in sorted(doses.items()):
            f = [r.scores["final_reward"] for r in arm.values()]
            auc = [r.scores["reward_auc"] for r in arm.values()]
            t = st.one_sample(f)
            est = lambda v, *k: st.fmt_ci(st.bootstrap_ci(v, reps=reps, seed=st.stream_seed(seed, method, dose, *k)))  # noqa: E731
            rows.append([method, dose, str(len(arm)), est(f, "final"),
                         "n/a" if not math.isfinite(t["lo"]) else f"{t['mean']:.3f} [{t['lo']:.3f}, {t['hi']:.3f}]",
                         est(auc, "auc"), st.fmt_rate(st.rate(sum(x < SOLVED for x in f), len(f))),
                         st.fmt_rate(st.rate(sum(r.failed for r in arm.values()), len(arm)))])
    return md_table(["method", "variant", "seeds", "final reward (IQM)", "final reward (mean, t CI)", "reward AUC",
                     f"stalled (final < {SOLVED:g})", "failed"], rows)


def confirm_page(runs: list[PhaseRun], reps: int = st.DEFAULT_REPS, seed: int = 0) -> str:
    by = arms(runs)
    h1, ctrl, line = verdicts(by)
    head = ["test", "seeds", "mean of A − B, final reward (95% t CI)", "sign-flip p", "claim", "decided"]
    lines = ["Experiment 6R (docs/experiment6r_training.md). Arms: IQM [95% percentile bootstrap CI, "
             f"{reps} resamples, seed {seed}], mean [95% t CI]; rates k/n with the exact Clopper–Pearson CI. Tests: "
             "final reward paired by seed, two-sided sign-flip permutation test of the mean (9999 draws, stream 0), "
             f"decided at p ≤ {ALPHA} in the claimed direction.", "", "### Arms", ""] + arm_rows(by, reps, seed)
    lines += ["### The pre-registered test (a family of one)", ""] + md_table(head, [
        ["H1: gspo-none vs grpo-none at N = 16", *_fmt(h1), "A higher", "yes" if h1["decided"] else "no"]])
    lines += ["### Controls (checks of the instrument; each its own test at α 0.05)", ""] + md_table(head, [
        [f"{c['name']}: {'grpo-r2 vs grpo-none at N = 1' if c['expect'] == 0 else 'grpo-none pos vs grpo-none at N = 4'}",
         *_fmt(c), "none expected" if c["expect"] == 0 else "A lower", "yes" if c["decided"] else "no"] for c in ctrl])
    lines += ["### Verdict (the pre-registered rules)", "", line, "",
              "### Stalls in H1's pairs (descriptive)", "",
              f"Seeds where only GSPO stalled: {h1['only_a']}; only GRPO: {h1['only_b']}; McNemar exact p "
              f"{st.fmt_p(mcnemar_p(h1['only_a'], h1['only_b']))}."]
    return "\n".join(lines)


def _write_figures(runs: list[PhaseRun], out_dir, *, reps: int, seed: int):
    from analysis.staleness_figures import write_figures

    return write_figures(staleness_arms(runs), out_dir, reps=reps, seed=seed)


def main(argv: list[str] | None = None) -> int:
    p = page_parser("python -m analysis.staleness_confirm", __doc__.split("\n\n")[0],
                    matrix="experiment 6R's out_dir", figure="the staleness figure of the mb<N> arms")
    return run_page(p, argv, load_raw=load_runs, parse=load_phase, page=confirm_page, save=save_metrics,
                    figures=_write_figures)


if __name__ == "__main__":
    sys.exit(main())
