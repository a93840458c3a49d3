"""The stability phase diagram of a drift-dial matrix (issue 47): `python -m analysis.phase RUNS_DIR|METRICS.jsonl.gz
[--out FILE.md] [--figures DIR] [--save-metrics FILE.jsonl.gz] [--bootstrap-reps N] [--seed S] [--tests N,N]`.

RUNS_DIR is an ablation's out_dir whose runs are named `<algo>-<replay>-<dose>[_<fix>]-s<seed>`
(`analysis.phase_runs`): e.g. `python -m moe_gspo.ablate --config configs/ablation_phase.yaml`. The page answers
"how much routing drift does each method tolerate?": per method, the final-reward drop against the method's own
zero-drift arm (`p0`) at each realised per-layer flip rate, the critical mismatch x* (the drop reaches 0.1) with
a seed-bootstrap CI, or the largest dose tolerated when no dose reaches it; each fix's shift of x*; failure rates
(exact CIs); where the rollout precisions (bf16, FP8, W8A8 arms, when present) and the papers' ~10% fall on the
same axis; and the pre-registered Holm family (`analysis.phase_stats.phase_family`). `--figures` draws the
diagram (`analysis.phase_figures`). Numbers come from `metrics.jsonl` only, so `--save-metrics`' file regenerates
the same page.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence

from analysis import stats as st
from analysis.matrix_runs import md_table, page_parser, run_page, tests_table
from analysis.phase_runs import (
    ENTROPY_FLOOR, ENTROPY_WINDOW, FAILURE_V2, PhaseRun, check_dose_names, load_phase, load_runs, save_metrics,
)
from analysis.phase_stats import (
    FAMILY_TESTS, GRPO, REWARD_DROP, ZERO_DOSE, MethodFit, arms, failure_glm, fit_method, ladder, ols_slope, phase_family,
    shared_boot_seeds, shift, tolerated_by_ci, tolerated_text,
)

PAPERS = "the papers' Qwen3-30B-A3B: ~10% per-layer flips, k3 ~1.5e-3 (R3 paper)"
PRECISIONS = ("bf16", "fp8", "w8a8")
SMALL_ARM = 10
"""Arms with fewer seeds get the page's warning that their percentile-bootstrap intervals are not 95% CIs."""


def _est(values, reps: int, seed: int, *names) -> str:
    return st.fmt_ci(st.bootstrap_ci(list(values), reps=reps, seed=st.stream_seed(seed, *names)))


def _pct(x: float) -> str:
    return "n/a" if not math.isfinite(x) else f"{100 * x:.3g}%"


def fmt_critical(fit: MethodFit) -> str:
    c = fit.critical
    if c.kind == "not_reached":
        upper = f"> {_pct(fit.x.max())}"
        return f"not reached: the fitted drop stays above −{REWARD_DROP:g} at every dose tested ({upper})"
    lo, hi = fit.ci_log10
    ci = (f"[{_pct(10 ** lo)}, {_pct(10 ** hi)}]" if math.isfinite(lo) else "[n/a]")
    if fit.not_reached_share > 0.025:
        ci = f"[{_pct(10 ** lo) if math.isfinite(lo) else 'n/a'}, > {_pct(fit.x.max())}]"
    where = "at or below the first dose, " if c.kind == "at_or_below_first" else ""
    return f"{where}{_pct(c.value)} {ci} (not reached in {100 * fit.not_reached_share:.0f}% of resamples)"


def arm_table(by_method, reps: int, seed: int) -> list[str]:
    rows = []
    for method, marms in by_method.items():
        for dose in ladder(marms) + sorted(d for d in marms if d not in ladder(marms)):
            runs = list(marms[dose].values())
            sc = lambda k: [r.scores[k] for r in runs]  # noqa: E731
            fails = st.rate(sum(r.failed for r in runs), len(runs))
            coll = st.rate(sum(r.collapsed for r in runs), len(runs))
            rows.append([method, dose, str(len(runs)), _est(sc("layer_disagree"), reps, seed, method, dose, "x"),
                         _est(sc("k3"), reps, seed, method, dose, "k3"),
                         _est(sc("final_reward"), reps, seed, method, dose, "final"),
                         _est(sc("reward_auc"), reps, seed, method, dose, "auc"), st.fmt_rate(fails), st.fmt_rate(coll)])
    return md_table(["method", "dose", "seeds", "per-layer flips (realised)", "k3 KL", "final reward", "reward AUC",
                   "failed", "entropy collapses"], rows)


def fits(by_method, reps: int, seed: int) -> dict[str, MethodFit]:
    boot = shared_boot_seeds({m: a for m, a in by_method.items() if ZERO_DOSE in a}, reps, seed)
    out = {}
    for method, marms in by_method.items():
        f = fit_method(method, marms, reps=reps, seed=seed, boot_seeds=boot if boot.size else None)
        if f is not None:
            out[method] = f
    return out


def _drop(e: st.Estimate) -> str:
    if not math.isfinite(e.point):
        return "n/a"
    return f"{e.point:+.2f}" + (f" [{e.lo:+.2f}, {e.hi:+.2f}]" if math.isfinite(e.lo) else " [n/a]")


def critical_table(fitted: dict[str, MethodFit], by_method, reps: int, seed: int) -> list[str]:
    rows = []
    for method, f in fitted.items():
        slope, lo, hi, p = ols_slope(by_method[method])
        largest, per_dose = tolerated_by_ci(by_method[method], reps=reps, seed=seed, method=method)
        drops = ", ".join(f"{_pct(x)}: {_drop(e)}" for x, e in per_dose)
        cf = f.critical_fail
        fail = ("not reached" if cf.kind == "not_reached" else
                f"{'≤ ' if cf.kind == 'at_or_below_first' else ''}{_pct(cf.value)}")
        ols = "not fitted (fewer than two dosed arms, or too few runs)" if not math.isfinite(slope) else f"{slope:+.3f} [{lo:+.3f}, {hi:+.3f}] (p {st.fmt_p(p)})"
        shown = tolerated_text(largest)  # the probe and its gate word it the same (analysis.phase_gate)
        g = failure_glm(by_method[method])
        glm = (f"not fitted: {g.why_not}" if g.why_not else
               f"{g.slope:+.2f} [{g.lo:+.2f}, {g.hi:+.2f}] (p {st.fmt_p(g.p)})")
        rows.append([method, fmt_critical(f), shown, fail, glm, ols, drops])
    return md_table(["method", f"critical mismatch x* (final reward −{REWARD_DROP:g}), 95% CI",
                   f"largest dose tolerated (drop's 95% CI above −{REWARD_DROP:g} there and below)",
                   "failure rate ≥ 50% at", "binomial GLM: log-odds of failure per decade of flips",
                   "OLS: final reward per decade of flips, seed effects",
                   "mean paired drop vs own zero dose [95% CI], by realised flips"], rows)


def shift_table(fitted: dict[str, MethodFit]) -> list[str]:
    base = fitted.get(GRPO)
    if base is None:
        return ["No GRPO-none fit: no shift to report.", ""]
    rows = []
    for method, f in fitted.items():
        if method == GRPO:
            continue
        point, lo, hi, both = shift(f, base)
        if not math.isfinite(point):
            why = ("neither reaches its critical mismatch" if f.critical.kind == base.critical.kind == "not_reached"
                   else f"{method if f.critical.kind == 'not_reached' else GRPO} does not reach it")
            rows.append([method, f"not decided: {why}", f"{100 * both:.0f}%"])
        else:
            ci = f"[{lo:.3g}, {hi:.3g}]" if math.isfinite(lo) else "[n/a]"
            rows.append([method, f"{point:.3g}× {ci}", f"{100 * both:.0f}%"])
    return md_table(["method", "x*(method) / x*(GRPO), 95% CI", "resamples where both are reached"], rows)


def reference_points(by_method, reps: int, seed: int) -> list[str]:
    grpo = by_method.get(GRPO, {})
    rows = [[d, _est([r.scores["layer_disagree"] for r in grpo[d].values()], reps, seed, "ref", d, "x"),
             _est([r.scores["k3"] for r in grpo[d].values()], reps, seed, "ref", d, "k3")]
            for d in PRECISIONS if d in grpo]
    rows.append(["papers (Qwen3-30B-A3B)", "~10% (R3 paper)", "~1.5e-3 (R3 paper)"])
    return md_table(["rollout precision (GRPO-none, no dial)", "per-layer flips", "k3 KL"], rows)


def phase_page(runs: list[PhaseRun], reps: int = st.DEFAULT_REPS, seed: int = 0,
               tests: Sequence[int] | None = None) -> str:
    """The page of a dial matrix; `tests`: the pre-registered tests to keep (their numbers in experiment 3's list),
    all by default."""
    check_dose_names(runs)  # no zero-dose and dosed arm: one line naming the dose-naming rule
    by_method = arms(runs)
    fitted = fits(by_method, reps, seed)
    family = phase_family(by_method, reps=reps, seed=seed, only=tests)
    c = FAILURE_V2
    n = sorted({len(a) for m in by_method.values() for a in m.values()})
    lines = [
        f"Methods: {len(by_method)}; arms: {sum(len(m) for m in by_method.values())}; seeds per arm: "
        f"{', '.join(map(str, n))}. Dose: the realised per-layer flip rate (`routing/layer_disagree`, rollout engine "
        "vs the learner's natural routing, response tokens, mean over layers and steps; the arm's median over "
        "seeds). Cells: interquartile mean over seeds [95% percentile bootstrap CI, "
        f"{reps} resamples, each cell its own stream from seed {seed}]; rates: k/n with the exact Clopper–Pearson CI."
        + (f" Arms of {n[0]} seeds: a percentile bootstrap over so few seeds is not a 95% CI (it covers less; "
           "`python -m benchmarks.phase_pilot.power_phase` simulates how much): read their intervals as the spread "
           "of the seeds." if n and n[0] < SMALL_ARM else ""),
        "",
        f"Final reward: mean reward/mean over the last 10% of steps; reward AUC: over all steps. Entropy collapse: "
        f"the first step at which the trailing {ENTROPY_WINDOW}-step mean of actor/entropy is below {ENTROPY_FLOOR:g} "
        f"nats and the trailing reward stays below 0.9 to the end. Failed: the pre-registered collapse/stall detector of experiments 1–2 plus a run "
        f"that ends with its trailing reward ≤ {c.dead_reward:g} (`moe_gspo.algos.collapse`, `dead_reward`).", "",
        "### Arms", ""] + arm_table(by_method, reps, seed)
    lines += ["### Critical mismatch per method", "",
              f"The dose at which the isotonic (non-increasing) fit of the paired final-reward drop against the "
              f"method's own {ZERO_DOSE} arm first reaches −{REWARD_DROP:g}, interpolated in log10(dose); CI: cluster "
              f"bootstrap over seeds ({reps} resamples, shared by all methods so that shifts pair). The largest dose "
              f"tolerated is the pre-registered rule: the largest realised dose at which the mean paired drop's 95% "
              f"percentile bootstrap CI (over the seeds, {reps} resamples) lies above −{REWARD_DROP:g}, as it does "
              f"at every lower dose. Descriptive fits over each method's dosed runs, each at its own realised dose: "
              f"statsmodels OLS of final reward on log10(flips) with seed effects, and a binomial GLM (logit) of "
              f"failure on log10(flips) without them (95% Wald CIs), not fitted when failures do not vary or "
              f"separate by dose.", ""]
    lines += critical_table(fitted, by_method, reps, seed) if fitted else ["No method has a zero-dose arm and a dosed one.", ""]
    lines += ["### Each fix's shift of the critical mismatch", ""] + shift_table(fitted)
    lines += ["### Where real precisions and the papers fall on the same axis", ""] + reference_points(by_method, reps, seed)
    head = ["### Pre-registered tests (one Holm family)", ""]
    if tests is not None:
        head += [f"The family: tests {', '.join(map(str, sorted(set(tests))))} of the numbered list "
                 "(docs/paper_claims.md; `--tests`), those whose arms are in this matrix, Holm over them alone.", ""]
    lines += head + tests_table(family, "No test: their arms are not in this matrix.")
    return "\n".join(lines)


def _write_figures(runs, out_dir, *, reps: int, seed: int):
    from analysis.phase_figures import write_figures

    return write_figures(runs, out_dir, reps=reps, seed=seed)


def main(argv: list[str] | None = None) -> int:
    p = page_parser("python -m analysis.phase", __doc__.split("\n\n")[0], matrix="the phase matrix's out_dir",
                    figure="the phase diagram")
    p.add_argument("--tests", default=None, type=_test_numbers, metavar="N[,N...]",
                   help="the pre-registered tests to run, by their number on docs/paper_claims.md "
                        f"({FAMILY_TESTS[0]}-{FAMILY_TESTS[-1]}: experiment 3's 1-9, 10 = GRPO+R2 at the top dose, "
                        "11-12 = experiment 4's middle doses vs zero and vs the top; e.g. 3F: 1,7); Holm then "
                        "adjusts over them alone (default: experiment 3's family, 1-10)")
    return run_page(p, argv, load_raw=load_runs, parse=load_phase, page=phase_page, save=save_metrics,
                    figures=_write_figures, page_options=lambda a: {"tests": a.tests})


def _test_numbers(text: str) -> tuple[int, ...]:
    try:
        numbers = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give test numbers separated by commas, e.g. 1,7") from None
    bad = [n for n in numbers if n not in FAMILY_TESTS]
    if bad:
        raise argparse.ArgumentTypeError(f"{bad}: the family's tests are numbered {FAMILY_TESTS[0]}-{FAMILY_TESTS[-1]}")
    return numbers


if __name__ == "__main__":
    sys.exit(main())
