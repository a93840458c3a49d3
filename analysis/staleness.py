"""Staleness, R2's regime (issue 47, experiment 3S): `python -m analysis.staleness RUNS_DIR|METRICS.jsonl.gz
[--out FILE.md] [--figures DIR] [--save-metrics FILE.jsonl.gz] [--bootstrap-reps N] [--seed S]`.

RUNS_DIR is an ablation's out_dir whose runs are named `<algo>-<replay>-mb<N>-s<seed>`
(`python -m moe_gspo.ablate --config configs/ablation_phase_staleness.yaml`): N is `train.num_minibatches`, the
optimizer steps one rollout feeds. The k-th of them updates a policy k − 1 optimizer steps newer than the one the
old log-probs (and GRPO's token ratios) were computed with: the staleness the GSPO paper's Routing Replay (R2)
targets, at zero rollout drift (fp32 rollouts, no dial). The page, per method (`<algo>-<replay>`) and N:
- final reward (mean `reward/mean` over the last 10% of steps), reward AUC (over all steps), failures and entropy
  collapses: the same per-run scalars as `analysis.phase` (`analysis.phase_runs`);
- experts changed per update: `update/expert_change_frac` (the learner's natural routing of the step's response
  rows, before vs after the step's **first** optimizer step; the GSPO paper's "~10% of activated experts change
  after one update") and `update_all_minibatches/expert_change_frac` (after **all** N), mean over the steps that
  logged them (`logging.update_drift_every`);
- per method, statsmodels OLS of final reward on log2 N with seed fixed effects (descriptive);
- the pre-registered Holm family (docs/paper_claims.md, 3S): GRPO+R2 vs GRPO and GSPO vs GRPO at the largest N,
  final reward, Wilcoxon signed-rank paired by seed (on the seeds both arms finished).
Numbers come from `metrics.jsonl` only, so `--save-metrics`' file regenerates the same page. `--figures` draws
final reward and experts changed against N (`analysis.staleness_figures`). `--controls` appends experiment 6's
pre-registered instrument checks (docs/experiment6_training.md), outside the family: zero mismatch (GRPO+R2 vs GRPO
at N = 1, where R2 replays the learner's own routes) and positive (GRPO at N = 4 vs N = 1, a known large effect).
`--exploratory` appends a post-hoc look, written after experiment 6's endpoint was seen (`analysis.staleness_exploratory`:
paired means with a sign-flip p, and stalls with McNemar's exact p), marked as such; it tests nothing.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping

from analysis import stats as st
from analysis.claims_stats import ClaimTest, apply_holm
from analysis.load import ReportInputError
from analysis.matrix_runs import load_matrix_runs, md_table, page_parser, run_page, tests_table
from analysis.phase_runs import RUN_RE, SOLVED, PhaseRun, load_phase, save_metrics
from analysis.phase_stats import GRPO, arms, paired_compare
from moe_gspo.run.dose_names import STALENESS_DOSE

MB_RE = STALENESS_DOSE
"""`mb<N>`, N = train.num_minibatches >= 1 without a leading zero (`moe_gspo.run.dose_names`)."""
FIXES = ("grpo-r2", "gspo-none")
"""The pre-registered comparisons against `GRPO` at the largest N, in their listed order."""

StalenessArms = dict[str, dict[int, dict[int, PhaseRun]]]
"""method -> N (mini-batches per rollout) -> seed -> run."""


def staleness_arms(runs: list[PhaseRun]) -> StalenessArms:
    """The runs whose dose label is `mb<N>`, by method, N and seed (methods and N sorted)."""
    out: StalenessArms = {}
    bad = sorted({r.name for r in runs if r.dose.startswith("mb") and not MB_RE.match(r.dose)})
    if bad:  # mb0 (log2 0), mb01 (a second name for mb1), ...
        raise ReportInputError(f"run {bad[0]}" + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "") + ": a "
                               "staleness dose is mb<N> with N = train.num_minibatches >= 1 written without a leading "
                               "zero (mb1, mb4, mb16)")
    for method, marms in arms(runs).items():
        by_n = {int(m["n"]): arm for dose, arm in marms.items() if (m := MB_RE.match(dose))}
        if by_n:
            out[method] = dict(sorted(by_n.items()))
    if not out:
        raise ReportInputError("no run is named <algo>-<replay>-mb<N>-s<seed> (N = train.num_minibatches); is this "
                               "the staleness matrix (configs/ablation_phase_staleness.yaml)?")
    return out


def load_runs(source) -> list:
    """The finished runs (with done.json) of a staleness matrix directory, or those saved by `--save-metrics`; the
    errors name this matrix's runs (`<algo>-<replay>-mb<N>-s<seed>`), not the phase matrix's."""
    return load_matrix_runs(source, RUN_RE, matrix="the staleness matrix's out_dir",
                            names="<algo>-<replay>-mb<N>-s<seed> (a run is finished when its done.json exists)")


def _est(values, reps: int, seed: int, *names) -> str:
    vals = [v for v in values if math.isfinite(v)]
    if not vals:
        return "n/a"
    return st.fmt_ci(st.bootstrap_ci(vals, reps=reps, seed=st.stream_seed(seed, *names)))


def arm_table(by_method: StalenessArms, reps: int, seed: int) -> list[str]:
    rows = []
    for method, by_n in by_method.items():
        for n, arm in by_n.items():
            runs = list(arm.values())
            sc = lambda k: [r.scores[k] for r in runs]  # noqa: E731
            rows.append([method, str(n), str(len(runs)), _est(sc("final_reward"), reps, seed, method, n, "final"),
                         _est(sc("reward_auc"), reps, seed, method, n, "auc"),
                         _est(sc("expert_change"), reps, seed, method, n, "change1"),
                         _est(sc("expert_change_all"), reps, seed, method, n, "change_all"),
                         st.fmt_rate(st.rate(sum(r.failed for r in runs), len(runs))),
                         st.fmt_rate(st.rate(sum(r.collapsed for r in runs), len(runs)))])
    return md_table(["method", "mini-batches per rollout N", "seeds", "final reward", "reward AUC",
                   "experts changed by the first update", "experts changed by all N updates", "failed",
                   "entropy collapses"], rows)


def reward_slope(by_n: Mapping[int, Mapping[int, PhaseRun]]) -> tuple[float, float, float, float, int]:
    """statsmodels OLS `final_reward ~ log2(N) + C(seed)` (seed effects when several seeds): slope per doubling of
    N, its 95% CI, p, and the number of seeds; NaNs with fewer than two values of N."""
    import numpy as np
    import pandas as pd
    import statsmodels.formula.api as smf

    df = pd.DataFrame([{"reward": r.scores["final_reward"], "log2n": float(np.log2(n)), "seed": str(s)}
                       for n, arm in by_n.items() for s, r in arm.items()])
    if df.empty or df["log2n"].nunique() < 2 or len(df) <= df["seed"].nunique() + 1:
        return math.nan, math.nan, math.nan, math.nan, 0 if df.empty else int(df["seed"].nunique())
    res = smf.ols("reward ~ log2n + C(seed)" if df["seed"].nunique() > 1 else "reward ~ log2n", data=df).fit()
    lo, hi = res.conf_int().loc["log2n"].tolist()
    return float(res.params["log2n"]), float(lo), float(hi), float(res.pvalues["log2n"]), int(df["seed"].nunique())


def slope_table(by_method: StalenessArms) -> list[str]:
    rows = []
    for method, by_n in by_method.items():
        slope, lo, hi, p, seeds = reward_slope(by_n)
        rows.append([method, "n/a" if not math.isfinite(slope) else
                     f"{slope:+.3f} [{lo:+.3f}, {hi:+.3f}] (p {st.fmt_p(p)})", str(seeds)])
    return md_table(["method", "OLS: final reward per doubling of N, seed effects (95% CI)", "seeds"], rows)


def staleness_family(by_method: StalenessArms, *, reps: int, seed: int) -> list[ClaimTest]:
    """The pre-registered Holm family of 3S: each of `FIXES` vs GRPO at the largest N both have (claim: the fix
    scores higher), final reward, paired by seed; a test whose arms are missing is left out."""
    tests: list[ClaimTest] = []
    grpo = by_method.get(GRPO, {})
    for fix in FIXES:
        shared = sorted(grpo.keys() & by_method.get(fix, {}).keys())
        if not shared:
            continue
        n = shared[-1]
        tests.append(paired_compare("staleness", f"{fix} vs {GRPO} at N = {n}: final reward", by_method[fix][n],
                                    grpo[n], "final_reward", a_better=True, reps=reps, seed=seed))
    return apply_holm(tests)


CONTROLS = (("zero mismatch", "grpo-r2", 1, GRPO, 1, True), ("positive", GRPO, 4, GRPO, 1, False))
"""Experiment 6's instrument checks: (name, method A, N of A, method B, N of B, null claim). The zero-mismatch
check expects no difference (R2 at N = 1 replays the learner's own routes); the positive one expects A higher."""


def staleness_controls(by_method: StalenessArms, *, reps: int, seed: int) -> list[ClaimTest]:
    """`CONTROLS` whose two arms exist, each a family of one (two-sided Wilcoxon signed-rank paired by seed at
    alpha 0.05: its Holm-adjusted p is its p), final reward."""
    tests = []
    for name, ma, na, mb, nb, null in CONTROLS:
        a, b = by_method.get(ma, {}).get(na), by_method.get(mb, {}).get(nb)
        if a and b:
            tests += apply_holm([paired_compare("control", f"{name}: {ma} at N = {na} vs {mb} at N = {nb}: final "
                                                "reward", a, b, "final_reward", a_better=not null, reps=reps,
                                                seed=seed, null_claim=null)])
    return tests


def staleness_page(runs: list[PhaseRun], reps: int = st.DEFAULT_REPS, seed: int = 0, controls: bool = False,
                    exploratory: bool = False) -> str:
    by_method = staleness_arms(runs)
    n_seeds = sorted({len(a) for m in by_method.values() for a in m.values()})
    lines = [
        f"Methods: {len(by_method)}; arms: {sum(len(m) for m in by_method.values())}; seeds per arm: "
        f"{', '.join(map(str, n_seeds))}. N: `train.num_minibatches`, the optimizer steps one rollout feeds (the "
        "k-th of them updates a policy k − 1 steps newer than the one the old log-probs came from). Cells: "
        f"interquartile mean over seeds [95% percentile bootstrap CI, {reps} resamples, each cell its own stream "
        f"from seed {seed}]; rates: k/n with the exact Clopper–Pearson CI.", "",
        "Final reward: mean reward/mean over the last 10% of steps; reward AUC: over all steps; failed and entropy "
        "collapse as on the phase page (`analysis.phase_runs`). Experts changed: `update/expert_change_frac` (the "
        "learner's natural routing of the step's response rows before vs after the first optimizer step of the "
        "step) and `update_all_minibatches/expert_change_frac` (after all N), each the mean over the steps that "
        "logged it; 'n/a' where a run logged neither (`logging.update_drift_every` 0).", "",
        "### Arms", ""] + arm_table(by_method, reps, seed)
    lines += ["### Final reward against staleness (descriptive)", ""] + slope_table(by_method)
    lines += ["### Pre-registered tests (one Holm family)", ""] + tests_table(
        staleness_family(by_method, reps=reps, seed=seed),
        "No test: GRPO-none and a fix (grpo-r2, gspo-none) share no N in this matrix.")
    if controls:
        lines += ["### Controls (checks of the instrument, outside the family; each a test of its own at α = 0.05, "
                  "so its Holm-adjusted p is its p)", ""] + tests_table(
            staleness_controls(by_method, reps=reps, seed=seed),
            "No control: the matrix lacks grpo-none at N = 1 and grpo-r2 at N = 1 or grpo-none at N = 4.")
    if exploratory:
        from analysis.staleness_exploratory import exploratory_table

        lines += ["### Exploratory (post hoc: written after experiment 6's endpoint was seen; no family, no verdicts)",
                  "", "Paired by seed. Mean of the per-seed differences of final reward with a t CI and a two-sided "
                  "sign-flip permutation p (a test of the mean, which stalls move; the signed-rank test above ranks "
                  f"them); stalls: final reward < {SOLVED:g}, discordant seeds and McNemar's exact p "
                  "(`analysis.staleness_exploratory`). Hypotheses for fresh seeds, not results.", ""]
        lines += exploratory_table(by_method, FIXES, CONTROLS)
    return "\n".join(lines)


def _write_figures(runs: list[PhaseRun], out_dir, *, reps: int, seed: int):
    from analysis.staleness_figures import write_figures

    return write_figures(staleness_arms(runs), out_dir, reps=reps, seed=seed)


def main(argv: list[str] | None = None) -> int:
    p = page_parser("python -m analysis.staleness", __doc__.split("\n\n")[0],
                    matrix="the staleness matrix's out_dir", figure="the staleness figure")
    p.add_argument("--controls", action="store_true",
                   help="append experiment 6's instrument checks (zero mismatch: grpo-r2 vs grpo-none at N = 1; "
                        "positive: grpo-none at N = 4 vs N = 1), outside the Holm family")
    p.add_argument("--exploratory", action="store_true",
                   help="append a post-hoc look (paired means with a sign-flip p, stalls with McNemar's exact p; "
                        "analysis.staleness_exploratory), marked as exploratory: it tests nothing")
    return run_page(p, argv, load_raw=load_runs, parse=load_phase, page=staleness_page, save=save_metrics,
                    figures=_write_figures,
                    page_options=lambda a: {"controls": a.controls, "exploratory": a.exploratory})


if __name__ == "__main__":
    sys.exit(main())
