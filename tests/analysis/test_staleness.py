"""analysis.staleness (experiment 3S's page): arms by N, experts changed per update, the OLS slope by hand, the
pre-registered two-test Holm family on a synthetic staleness matrix, the page regenerated exactly from the saved
metrics, the figure, and bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from analysis.phase_runs import load_phase
from analysis.staleness import (main, reward_slope, staleness_arms, staleness_controls, staleness_family,
                                staleness_page)

T = 40
NS = (1, 4, 16)
# final reward per method and N: GRPO loses 0.1 per doubling from N = 4 on; R2 and GSPO hold
FINAL = {"grpo-none": {1: 0.9, 4: 0.9, 16: 0.7}, "grpo-r2": {1: 0.9, 4: 0.9, 16: 0.88},
         "gspo-none": {1: 0.9, 4: 0.92, 16: 0.9}}
CHANGE = {1: 0.02, 4: 0.02, 16: 0.02}  # the first update changes the same share whatever N
CHANGE_ALL = {1: 0.02, 4: 0.06, 16: 0.2}  # all N updates change more


def _write(d: Path, final: float, n: int, *, drift_every: int = 5):
    d.mkdir(parents=True)
    rows = []
    for step in range(T):
        row = {"step": step, "reward/mean": final if step >= T - 4 else 0.5, "reward/frac_zero_std": 0.2,
               "actor/entropy": 0.8, "routing/layer_disagree": [0.0, 0.0], "mismatch/k3_kl": 1e-12}
        if drift_every and step % drift_every == 0:
            row["update/expert_change_frac"] = CHANGE[n]
            row["update_all_minibatches/expert_change_frac"] = CHANGE_ALL[n]
        rows.append(row)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "done.json").write_text(json.dumps({"step": T}))


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    root = tmp_path_factory.mktemp("staleness")
    for method, finals in FINAL.items():
        algo, replay = method.split("-")
        for n, final in finals.items():
            for seed in range(1000, 1008):
                _write(root / f"{algo}-{replay}-mb{n}-s{seed}", final + 0.005 * ((seed % 3) - 1), n)
    _write(root / "grpo-none-p10-s1000", 0.1, 4)  # a dial arm in the same folder: not a staleness arm
    return root


def test_arms_by_n_and_experts_changed(matrix):
    by = staleness_arms(load_phase(matrix))
    assert list(by) == ["grpo-none", "grpo-r2", "gspo-none"]
    assert all(list(by_n) == [1, 4, 16] and all(len(a) == 8 for a in by_n.values()) for by_n in by.values())
    run = by["grpo-none"][16][1000]
    assert run.scores["expert_change"] == pytest.approx(0.02) and run.scores["expert_change_all"] == pytest.approx(0.2)
    assert run.scores["final_reward"] == pytest.approx(0.7 + 0.005 * ((1000 % 3) - 1))


def test_reward_slope_by_hand(matrix):
    by = staleness_arms(load_phase(matrix))
    # GRPO: 0.9, 0.9, 0.7 at log2 N = 0, 2, 4 (seed effects absorb the per-seed offset): slope by least squares
    x, y = np.array([0.0, 2.0, 4.0]), np.array([0.9, 0.9, 0.7])
    want = float(((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum())
    slope, lo, hi, p, seeds = reward_slope(by["grpo-none"])
    assert slope == pytest.approx(want, abs=1e-9) and lo < slope < hi and seeds == 8 and p < 0.05
    assert math.isnan(reward_slope({4: by["grpo-none"][4]})[0])  # one N: no slope


def test_the_family_is_the_two_fixes_at_the_largest_n(matrix):
    tests = staleness_family(staleness_arms(load_phase(matrix)), reps=300, seed=0)
    assert [t.label for t in tests] == ["grpo-r2 vs grpo-none at N = 16: final reward",
                                        "gspo-none vs grpo-none at N = 16: final reward"]
    for t in tests:
        assert t.test.startswith("Wilcoxon") and t.num_seeds == 8 and t.agrees is True
        # 8 paired seeds, every difference positive: exact two-sided p = 2 / 2**8
        assert t.p == pytest.approx(2 / 256) and t.p_holm == pytest.approx(2 * 2 / 256)
        assert t.verdict.startswith("reproduces")


def test_a_stopped_matrix_tests_on_the_seeds_both_arms_finished(tmp_path):
    for seed in range(1000, 1006):
        _write(tmp_path / f"grpo-none-mb16-s{seed}", 0.7, 16)
    for seed in range(1000, 1004):
        _write(tmp_path / f"grpo-r2-mb16-s{seed}", 0.9, 16)
    tests = staleness_family(staleness_arms(load_phase(tmp_path)), reps=200, seed=0)
    assert [t.num_seeds for t in tests] == [4]  # no GSPO arm: one test, paired on seeds 1000-1003


def test_page_regenerates_from_saved_metrics_and_draws_the_figure(matrix, tmp_path):
    saved, figs = tmp_path / "m.jsonl.gz", tmp_path / "figs"
    assert main([str(matrix), "--out", str(tmp_path / "a.md"), "--save-metrics", str(saved), "--figures", str(figs),
                 "--bootstrap-reps", "200"]) == 0
    assert main([str(saved), "--out", str(tmp_path / "b.md"), "--bootstrap-reps", "200"]) == 0
    page = (tmp_path / "a.md").read_text()
    assert page == (tmp_path / "b.md").read_text()
    assert "| grpo-none | 16 | 8 |" in page and "Pre-registered tests" in page and "p10" not in page
    assert (figs / "staleness.png").stat().st_size > 10_000
    assert sorted(p.name for p in figs.iterdir()) == ["staleness.png"]


def _control_matrix(root: Path) -> Path:
    """Experiment 6's control arms: GRPO at N = 4 scores 0.15 above N = 1 on every seed; GRPO+R2 at N = 1 differs
    from GRPO at N = 1 by +-0.01 alternating with the seed."""
    for seed in range(6000, 6008):
        _write(root / f"grpo-none-mb1-s{seed}", 0.8, 1)
        _write(root / f"grpo-none-mb4-s{seed}", 0.95, 4)
        _write(root / f"grpo-r2-mb1-s{seed}", 0.8 + (0.01 if seed % 2 else -0.01), 1)
    return root


def test_the_controls_are_each_a_test_of_their_own(tmp_path):
    zero, pos = staleness_controls(staleness_arms(load_phase(_control_matrix(tmp_path))), reps=300, seed=0)
    assert zero.label == "zero mismatch: grpo-r2 at N = 1 vs grpo-none at N = 1: final reward" and zero.null_claim
    # 4 differences +0.01 and 4 -0.01, all of one rank: T+ = 4 * 4.5 is the null's centre, so p = 1
    assert zero.p == pytest.approx(1.0) and zero.p_holm == zero.p and zero.verdict.startswith("not decided")
    assert pos.label == "positive: grpo-none at N = 4 vs grpo-none at N = 1: final reward" and not pos.null_claim
    # every one of 8 paired differences +0.15: exact two-sided p = 2 / 2**8, a family of one (no Holm factor)
    assert pos.p == pytest.approx(2 / 256) and pos.p_holm == pos.p and pos.verdict.startswith("reproduces")
    assert pos.num_seeds == 8 and pos.agrees is True


def test_the_controls_section_only_on_request(tmp_path):
    runs = load_phase(_control_matrix(tmp_path / "m"))
    plain, with_controls = staleness_page(runs, reps=200), staleness_page(runs, reps=200, controls=True)
    assert "Controls" not in plain and with_controls.startswith(plain)  # the pre-registered page is unchanged
    assert "| positive: grpo-none at N = 4 vs grpo-none at N = 1: final reward |" in with_controls
    assert main([str(tmp_path / "m"), "--controls", "--bootstrap-reps", "200", "--out", str(tmp_path / "c.md")]) == 0
    assert (tmp_path / "c.md").read_text().rstrip("\n") == with_controls.rstrip("\n")
    lone = tmp_path / "lone"
    _write(lone / "grpo-none-mb16-s1", 0.8, 16)
    _write(lone / "grpo-none-mb16-s2", 0.8, 16)
    assert "No control" in staleness_page(load_phase(lone), reps=200, controls=True)


def test_a_run_without_update_drift_says_n_a(tmp_path):
    for seed in (1, 2):
        _write(tmp_path / f"grpo-none-mb4-s{seed}", 0.8, 4, drift_every=0)
    page = staleness_page(load_phase(tmp_path), reps=200)
    row = next(line for line in page.splitlines() if line.startswith("| grpo-none | 4 |"))
    assert row.count("n/a") == 2
    assert "No test" in page


def test_bad_input_is_one_line(tmp_path, capsys):
    assert main([str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    _write(tmp_path / "runs" / "grpo-none-p10-s1", 0.5, 4)
    assert main([str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "mb<N>" in err


@pytest.mark.parametrize("dose", ["mb0", "mb01", "mb00"])
def test_degenerate_mb_names_are_one_line(tmp_path, capsys, dose):
    """Issue 59: a run named mb0 raised LinAlgError (log2 0 in the OLS); mb01 would be a second name for mb1."""
    for seed in (1, 2):
        for n in ("mb1", "mb4"):
            _write(tmp_path / "runs" / f"grpo-none-{n}-s{seed}", 0.5, 4)
    _write(tmp_path / "runs" / f"grpo-none-{dose}-s1", 0.5, 4)
    assert main([str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"run grpo-none-{dose}-s1: a staleness dose is mb<N>" in err
    assert "N = train.num_minibatches >= 1" in err
