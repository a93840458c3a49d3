"""analysis.phase (phase_runs / phase_stats / phase_figures): the critical mismatch by hand, "not reached",
the fix shift, the pre-registered family on a synthetic dial matrix, and the page regenerated exactly from
the saved metrics."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from analysis.phase import main, phase_page
from analysis.phase_runs import entropy_collapse, load_phase, phase_run
from analysis.phase_runs import PhaseRun
from analysis.phase_stats import (
    arms, crossing, failure_glm, fit_method, phase_family, shift, tolerated_by_ci,
)
from analysis.load import load_run

T = 40
X = {"p0": 0.0, "p5": 0.05, "p20": 0.2, "p80": 0.8}
DROP = {"grpo-none": {"p0": 0.0, "p5": -0.02, "p20": -0.15, "p80": -0.4},
        "grpo-r3": {"p0": 0.0, "p20": 0.0, "p80": -0.05}}


def _write(d: Path, final: float, x: float, *, entropy_end: float = 0.5, k3: float = 1e-4, final_from: int = T - 4):
    d.mkdir(parents=True)
    rows = []
    for step in range(T):
        reward = final if step >= final_from else 0.5  # default: the last 10% of 40 steps, 4 steps
        ent = 1.0 if step < 20 else entropy_end
        rows.append({"step": step, "reward/mean": reward, "reward/frac_zero_std": 0.2, "actor/entropy": ent,
                     "routing/layer_disagree": [x, x], "mismatch/k3_kl": k3 * (1 + 10 * x)})
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "done.json").write_text(json.dumps({"step": T}))


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    root = tmp_path_factory.mktemp("phase")
    for method, drops in DROP.items():
        algo, replay = method.split("-")
        for dose, drop in drops.items():
            for seed in range(6):
                noise = 0.01 * ((seed % 3) - 1)  # -0.01, 0, 0.01: pairing removes most of it
                _write(root / f"{algo}-{replay}-{dose}-s{seed}", 0.9 + drop + noise + 0.001 * seed, X[dose])
    return root


def test_crossing_by_hand():
    x = np.asarray([0.0, 0.05, 0.2, 0.8])
    c = crossing(x, np.asarray([0.0, -0.02, -0.15, -0.4]), -0.1, decreasing=True)
    # between 0.05 (-0.02) and 0.2 (-0.15): 8/13 of the way in log10
    want = 10 ** (math.log10(0.05) + (0.08 / 0.13) * (math.log10(0.2) - math.log10(0.05)))
    assert c.kind == "interpolated" and c.value == pytest.approx(want, rel=1e-12)
    # a noisy, non-monotone curve is read through its isotonic fit: (-0.02, +0.04) pool to +0.01
    c = crossing(x, np.asarray([0.0, -0.02, 0.04, -0.3]), -0.1, decreasing=True)
    assert c.kind == "interpolated" and 0.2 < c.value < 0.8
    assert crossing(x, np.asarray([0.0, -0.01, -0.02, -0.05]), -0.1, decreasing=True).kind == "not_reached"
    first = crossing(x, np.asarray([0.0, -0.3, -0.4, -0.5]), -0.1, decreasing=True)
    assert first.kind == "at_or_below_first" and first.value == 0.05
    fail = crossing(x, np.asarray([0.0, 0.1, 0.7, 1.0]), 0.5, decreasing=False)
    assert fail.kind == "interpolated" and 0.05 < fail.value < 0.2


def test_fits_critical_mismatch_ci_and_the_fix_shift(matrix):
    by = arms(load_phase(matrix))
    grpo = fit_method("grpo-none", by["grpo-none"], reps=300, seed=0)
    assert grpo.doses == ["p0", "p5", "p20", "p80"]
    np.testing.assert_allclose(grpo.x, [0, 0.05, 0.2, 0.8])
    np.testing.assert_allclose(grpo.drop, [0, -0.02, -0.15, -0.4], atol=1e-12)  # paired: noise and seed cancel
    assert grpo.critical.kind == "interpolated" and grpo.critical.value == pytest.approx(0.1173, abs=1e-4)
    lo, hi = grpo.ci_log10
    assert 10 ** lo <= grpo.critical.value <= 10 ** hi and grpo.not_reached_share == 0
    r3 = fit_method("grpo-r3", by["grpo-r3"], reps=300, seed=0)
    assert r3.critical.kind == "not_reached" and r3.largest_tolerated == pytest.approx(0.8)
    point, *_ = shift(r3, grpo)
    assert math.isnan(point)  # R3 never reaches it: no ratio


def test_family_on_the_synthetic_matrix(matrix):
    tests = phase_family(arms(load_phase(matrix)), reps=300, seed=0)
    labels = [t.label for t in tests]
    assert labels[0] == "grpo-none: final reward, p80 vs p0" and labels[1].startswith("grpo-none: reward AUC")
    assert any(lbl.startswith("grpo-r3 vs grpo-none at p80") for lbl in labels)
    drop = tests[0]
    assert drop.agrees is True and drop.p < 0.05  # 6 paired seeds, all 0.4 lower: the exact Wilcoxon p 1/32
    assert all(math.isfinite(t.p_holm) and t.p_holm >= t.p for t in tests)


def test_a_subset_of_the_family_is_holm_adjusted_over_itself_alone(matrix, capsys):
    by = arms(load_phase(matrix))
    whole = {t.label: t for t in phase_family(by, reps=300, seed=0)}
    sub = phase_family(by, reps=300, seed=0, only=(1, 5))  # 3F-style: the drop at the top dose and one fix
    assert [t.label for t in sub] == ["grpo-none: final reward, p80 vs p0", "grpo-r3 vs grpo-none at p80: final reward"]
    ps = sorted(t.p for t in sub)
    for t in sub:  # the same test, the same raw p; Holm over 2: the smaller p doubled, the larger as is (at least)
        assert t.p == whole[t.label].p
        want = min(1.0, 2 * ps[0]) if t.p == ps[0] else min(1.0, max(2 * ps[0], ps[1]))
        assert t.p_holm == pytest.approx(want)
    assert len(whole) > 2 and whole["grpo-none: final reward, p80 vs p0"].p_holm >= sub[0].p_holm
    assert phase_family(by, reps=300, seed=0, only=(8,)) == []  # no positive-control arm here: nothing left
    assert main([str(matrix), "--tests", "1,5", "--bootstrap-reps", "200"]) == 0
    page = capsys.readouterr().out
    assert "The family: tests 1, 5 of the numbered list" in page and "reward AUC, p80 vs p0 |" not in page
    with pytest.raises(SystemExit):
        main([str(matrix), "--tests", "1,13"])
    assert "numbered 1-12" in capsys.readouterr().err


def test_the_middle_dose_tests_by_hand(matrix):
    """Experiment 4's tests 11-12: per seed the mean final reward over the doses strictly between zero and the top
    one, against each end; only when asked for (experiment 3's default family is 1-10)."""
    from analysis.phase_stats import middle_doses_arm

    by = arms(load_phase(matrix))
    grpo = by["grpo-none"]
    mid = middle_doses_arm(grpo)
    assert sorted(mid) == list(range(6))
    for s, r in mid.items():  # (p5 + p20) / 2 of the same seed, by hand
        want = (grpo["p5"][s].scores["final_reward"] + grpo["p20"][s].scores["final_reward"]) / 2
        assert r.scores["final_reward"] == pytest.approx(want) and r.dose == "middle"
    assert middle_doses_arm({"p0": grpo["p0"], "p80": grpo["p80"]}) == {}  # no middle dose: no arm
    t11, t12 = phase_family(by, reps=300, seed=0, only=(11, 12))
    assert t11.label == "grpo-none: final reward, mean over the middle doses (p5, p20) vs p0"
    assert t12.label.endswith("vs p80")
    assert "-0.085" in t11.estimate and t11.agrees is True  # (-0.02 - 0.15) / 2 below p0 in every seed
    assert "0.315" in t12.estimate and t12.agrees is False  # 0.4 - 0.085 above the top dose: no inverted U here
    assert not any("middle" in t.label for t in phase_family(by, reps=300, seed=0))


def test_the_ols_slope_needs_two_dosed_arms(matrix):
    """One dosed arm's seeds differ in realised dose only by noise: no slope is read from that (3F's GSPO has p0
    and p40 only); with two dosed arms it is fitted."""
    from analysis.phase_stats import ols_slope

    from dataclasses import replace

    grpo = arms(load_phase(matrix))["grpo-none"]
    jittered = {s: replace(r, scores={**r.scores, "layer_disagree": 0.8 + 0.001 * s}) for s, r in grpo["p80"].items()}
    assert all(math.isnan(v) for v in ols_slope({"p0": grpo["p0"], "p80": jittered}))
    slope, lo, hi, p = ols_slope({"p0": grpo["p0"], "p20": grpo["p20"], "p80": grpo["p80"]})
    assert slope < 0 and lo <= slope <= hi and 0 <= p <= 1


def test_the_ols_slope_is_fitted_over_the_dial_arms_alone(matrix):
    """Experiment 3's GRPO slope was once fitted with the bf16/FP8/W8A8 reference runs in it (issue 58): a
    reference arm (a rollout precision, the positive control) at a dose of its own must not move the fit."""
    from dataclasses import replace

    from analysis.phase_stats import ols_slope

    grpo = arms(load_phase(matrix))["grpo-none"]
    dial = {d: grpo[d] for d in ("p0", "p5", "p20", "p80")}
    want = ols_slope(dial)
    # reference runs on the same seeds, at a low realised dose and a far lower reward: in the fit they would pull
    # the slope up (the reward rises with the dose between them and the dial arms)
    ref = {s: replace(r, dose="bf16", scores={**r.scores, "layer_disagree": 0.005 + 0.001 * s, "final_reward": 0.0})
           for s, r in grpo["p5"].items()}
    pos = {s: replace(r, dose="pos", scores={**r.scores, "layer_disagree": 0.3, "final_reward": 0.0})
           for s, r in grpo["p5"].items()}
    for extra in ({"bf16": ref}, {"w8a8": ref}, {"pos": pos}):
        got = ols_slope({**dial, **extra})
        np.testing.assert_allclose(got, want, rtol=1e-12)
    assert want[0] < 0  # the dial arms' own slope: the reward falls with the dose


def test_entropy_collapse_needs_low_entropy_and_a_reward_never_solved_after(tmp_path):
    _write(tmp_path / "grpo-none-p0-s0", 0.5, 0.0, entropy_end=0.01)
    step, hit = entropy_collapse(load_run(tmp_path / "grpo-none-p0-s0"))
    assert hit and step == 29  # the 10-step mean first falls below 0.05 with no 1.0 left in it: steps 20-29
    _write(tmp_path / "grpo-none-p0-s1", 0.95, 0.0, entropy_end=0.01, final_from=25)  # low entropy, then solved
    r = phase_run(load_run(tmp_path / "grpo-none-p0-s1"))
    assert r.collapsed is False  # the trailing reward reaches 0.9 after step 29: a dip on the way, no collapse
    _write(tmp_path / "grpo-none-p0-s2", 0.5, 0.0, entropy_end=0.5)
    assert entropy_collapse(load_run(tmp_path / "grpo-none-p0-s2")) == (39.0, False)


def test_page_regenerates_from_saved_metrics_and_draws_the_diagram(matrix, tmp_path):
    saved, out_a, out_b = tmp_path / "m.jsonl.gz", tmp_path / "a.md", tmp_path / "b.md"
    assert main([str(matrix), "--out", str(out_a), "--save-metrics", str(saved), "--bootstrap-reps", "200",
                 "--figures", str(tmp_path / "fig")]) == 0
    assert main([str(saved), "--out", str(out_b), "--bootstrap-reps", "200"]) == 0
    assert out_a.read_text() == out_b.read_text()
    text = out_a.read_text()
    assert "| grpo-none | p80 | 6 |" in text and "not reached: the fitted drop stays above −0.1 at every dose tested" in text
    assert (tmp_path / "fig" / "phase_diagram.png").stat().st_size > 10_000


def test_bad_input_is_one_line(tmp_path, capsys):
    assert main([str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty")]) == 2
    assert "no finished run" in capsys.readouterr().err


def test_reference_arms_are_described_not_fitted(matrix, tmp_path):
    """bf16 / w8a8 / pos arms (no dial) appear in the arm table but not in the ladder, the fits or the family."""
    import shutil

    root = tmp_path / "m"
    shutil.copytree(matrix, root)
    for seed in range(3):
        _write(root / f"grpo-none-bf16-s{seed}", 0.2, 0.004)  # a low reward that a fit would read as a drop
    by = arms(load_phase(root))
    fit = fit_method("grpo-none", by["grpo-none"], reps=100, seed=0)
    assert fit.doses == ["p0", "p5", "p20", "p80"] and fit.critical.value == pytest.approx(0.1173, abs=1e-4)
    text = phase_page(load_phase(root), reps=100)
    assert "| grpo-none | bf16 | 3 |" in text and "| bf16 |" in text


def test_a_stopped_matrix_pairs_each_test_on_the_seeds_both_arms_finished(matrix):
    """The pre-registered stopping rule: every arm with the seeds it completed, and the family on the seeds both
    arms of a test share, still paired (a seed-major matrix stopped after seed 4 of p80 but 6 of p0)."""
    by = arms(load_phase(matrix))
    by["grpo-none"]["p80"] = {s: r for s, r in by["grpo-none"]["p80"].items() if s < 4}
    drop = phase_family(by, reps=200, seed=0)[0]
    assert drop.test == "Wilcoxon signed-rank (paired by seed)" and drop.num_seeds == 4
    assert drop.p == pytest.approx(0.125)  # exact two-sided Wilcoxon, 4 pairs all lower: 2/2^4


def test_largest_dose_tolerated_is_the_pre_registered_ci_rule(matrix, tmp_path):
    """The largest dose at which the paired drop's 95% CI lies above -0.1, as at every lower dose."""
    by = arms(load_phase(matrix))
    largest, per_dose = tolerated_by_ci(by["grpo-none"], reps=300, seed=0, method="grpo-none")
    assert largest == pytest.approx(0.05)  # p5 drops 0.02 exactly in every seed; p20 drops 0.15
    assert [round(x, 6) for x, _ in per_dose] == [0.05, 0.2, 0.8]
    assert [e.point for _, e in per_dose] == pytest.approx([-0.02, -0.15, -0.4])
    assert tolerated_by_ci(by["grpo-r3"], reps=300, seed=0, method="grpo-r3")[0] == pytest.approx(0.8)
    # a mean drop of 0.05 whose seeds spread from -0.25 to +0.15: the point is above -0.1, its CI is not
    for seed in range(6):
        _write(tmp_path / f"grpo-none-p0-s{seed}", 0.7, 0.0)
        _write(tmp_path / f"grpo-none-p5-s{seed}", 0.7 + (-0.25 if seed % 2 else 0.15), 0.05)
        _write(tmp_path / f"grpo-none-p20-s{seed}", 0.7, 0.2)
    noisy = arms(load_phase(tmp_path))["grpo-none"]
    largest, per_dose = tolerated_by_ci(noisy, reps=500, seed=0, method="grpo-none")
    assert per_dose[0][1].point == pytest.approx(-0.05) and per_dose[0][1].lo < -0.1
    assert math.isnan(largest)  # not shown at the first dose, so at none (p20's zero drop does not count)
    # issue 60: one meaning everywhere: the fit the probe and its gate read says none too (its point fit, which
    # never reaches x* here, used to say 0.2: "tolerated every dose tested" against the page's "none shown")
    fit = fit_method("grpo-none", noisy, reps=100, seed=0)
    assert fit.critical.kind == "not_reached" and math.isnan(fit.largest_tolerated)
    assert fit_method("grpo-r3", by["grpo-r3"], reps=300, seed=0).largest_tolerated == pytest.approx(0.8)
    assert "none shown (the CI reaches it at the first dose)" in phase_page(load_phase(tmp_path), reps=200)


def _runs(dose: str, x: float, fails: list[bool]) -> dict[int, PhaseRun]:
    return {i: PhaseRun(f"grpo-none-{dose}-s{i}", "grpo-none", dose, i, {"layer_disagree": x, "final_reward": 1.0},
                        0.0, False, 0.0, f) for i, f in enumerate(fails)}


def test_failure_glm_against_newton_by_hand_and_when_it_is_not_fitted():
    arms_ = {"p0": _runs("p0", 0.0, [True] * 4), "p1": _runs("p1", 0.01, [False, False, False, True]),
             "p10": _runs("p10", 0.1, [False, True, False, True]), "p100": _runs("p100", 1.0, [True, True, True, False]),
             "bf16": _runs("bf16", 0.005, [True] * 4)}  # p0 and the reference arm are not fitted
    g = failure_glm(arms_)
    # logistic regression of (0,0,0,1 | 0,1,0,1 | 1,1,1,0) on log10 x = -2, -1, 0 by Newton's method
    x = np.repeat([-2.0, -1.0, 0.0], 4)
    y = np.array([0, 0, 0, 1, 0, 1, 0, 1, 1, 1, 1, 0], float)
    X = np.column_stack([np.ones_like(x), x])
    beta = np.zeros(2)
    for _ in range(50):
        mu = 1 / (1 + np.exp(-X @ beta))
        beta += np.linalg.solve(X.T @ (X * (mu * (1 - mu))[:, None]), X.T @ (y - mu))
    se = math.sqrt(np.linalg.inv(X.T @ (X * (mu * (1 - mu))[:, None]))[1, 1])
    assert g.why_not == "" and g.slope == pytest.approx(beta[1], rel=1e-6)
    assert (g.lo, g.hi) == pytest.approx((beta[1] - 1.959964 * se, beta[1] + 1.959964 * se), rel=1e-4)
    assert 0 < g.p < 1
    none = failure_glm({"p1": _runs("p1", 0.01, [False] * 3), "p10": _runs("p10", 0.1, [False] * 3)})
    assert math.isnan(none.slope) and none.why_not == "failures do not vary (0/6)"
    sep = failure_glm({"p1": _runs("p1", 0.01, [False] * 3), "p10": _runs("p10", 0.1, [True] * 3)})
    assert math.isnan(sep.slope) and "separate" in sep.why_not
    assert failure_glm({"p1": _runs("p1", 0.01, [False, True])}).why_not == "fewer than two doses"


def test_variants_named_against_the_rule_name_it(tmp_path, capsys):
    """Issue 60: variants named `zero` / `n05` (not p0 / p<N> / s<X>) made analysis.phase exit 0 with a bare "No
    method has a zero-dose arm and a dosed one"; now one line naming the dose-naming rule, exit 2."""
    for dose, x in (("zero", 0.0), ("n05", 0.05)):
        for seed in range(3):
            _write(tmp_path / "runs" / f"grpo-none-{dose}-s{seed}", 0.8, x)
    assert main([str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "doses found: grpo-none: n05, zero" in err
    assert "the dose-naming rule" in err and "p0 for zero drift" in err and "s<X>" in err


def test_noise_doses_are_analysed_on_the_realised_flip_axis(tmp_path):
    """`s<X>` (rollout.router_noise_std = X) arms are dial doses: on the ladder with the flip doses, at their
    realised flip rate."""
    for dose, x, drop in (("p0", 0.0, 0.0), ("s0.25", 0.05, -0.02), ("p20", 0.2, -0.15), ("s2", 0.8, -0.4)):
        for seed in range(4):
            _write(tmp_path / f"grpo-none-{dose}-s{seed}", 0.9 + drop + 0.001 * seed, x)
    by = arms(load_phase(tmp_path))
    fit = fit_method("grpo-none", by["grpo-none"], reps=100, seed=0)
    assert fit.doses == ["p0", "s0.25", "p20", "s2"]
    np.testing.assert_allclose(fit.x, [0, 0.05, 0.2, 0.8])
    assert fit.critical.kind == "interpolated" and fit.critical.value == pytest.approx(0.1173, abs=1e-4)


def test_arms_of_few_seeds_are_warned_their_bootstrap_is_no_95_percent_ci(tmp_path):
    """3F's 3-4 seed arms (issue 58): a percentile bootstrap over so few seeds covers less than 95%; the page says
    so when an arm has fewer than 10 seeds, and not when every arm has 10."""
    for seed in range(10):
        _write(tmp_path / f"grpo-none-p0-s{seed}", 0.9 + 0.001 * seed, 0.0)
        _write(tmp_path / f"grpo-none-p20-s{seed}", 0.8 + 0.001 * seed, 0.2)
    warning = "is not a 95% CI"
    assert warning not in phase_page(load_phase(tmp_path), reps=100)
    few = [r for r in load_phase(tmp_path) if r.seed < 4 or r.dose == "p0"]
    assert "Arms of 4 seeds: a percentile bootstrap over so few seeds is not a 95% CI" in phase_page(few, reps=100)
