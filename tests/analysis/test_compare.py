"""analysis.compare: seed bands, the per-arm table, and the comparison report of an ablation."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from analysis.compare import (
    COMPARE_FIGURES, ArmRun, arm_runs_from_dirs, build_comparison, seed_band,
)
from analysis.load import ReportInputError, RunData
from synth_run import assert_real_png, write_degenerate_run, write_synthetic_run


def _run(points: list[tuple[int, float]]) -> RunData:
    return RunData(source=Path("x"), records=[{"step": s, "reward/mean": v} for s, v in points],
                   traces={})


def test_seed_band_hand_example():
    runs = [(0, _run([(0, 1.0), (1, 2.0), (2, 3.0)])), (1, _run([(1, 3.0), (2, 5.0)]))]
    steps, mean, lo, hi = seed_band(runs, "reward/mean")
    assert steps.tolist() == [0, 1, 2]
    np.testing.assert_allclose(mean, [1.0, 2.5, 4.0])
    np.testing.assert_allclose(lo, [1.0, 2.0, 3.0])
    np.testing.assert_allclose(hi, [1.0, 3.0, 5.0])
    assert seed_band(runs, "clip/token_frac")[0].size == 0


def test_arm_runs_from_dirs_groups_by_seed_suffix():
    got = arm_runs_from_dirs(["a/grpo-r2-s0", "a/grpo-r2-s11", "a/custom"])
    assert [(r.arm, r.seed) for r in got] == [("grpo-r2", 0), ("grpo-r2", 11), ("custom", 0)]


def _final_reward(run_dir: Path) -> float:
    rewards = [json.loads(l)["reward/mean"] for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    k = max(1, len(rewards) // 10)
    return sum(rewards[-k:]) / k


def test_comparison_report(tmp_path):
    arm_runs = []
    for i, arm in enumerate(("gspo-none", "grpo-r2")):
        for seed in (0, 1):
            d = write_synthetic_run(tmp_path / f"{arm}-s{seed}", seed=10 * i + seed, with_traces=False)
            arm_runs.append(ArmRun(arm, seed, d))
    arm_runs.append(ArmRun("grpo-r2", 2, tmp_path / "grpo-r2-s2"))  # never ran
    paths = build_comparison(arm_runs, tmp_path / "comparison")
    assert {p.stem for p in paths.figures} == {s.name for s in COMPARE_FIGURES}
    for p in paths.figures:
        assert_real_png(p)
    md = paths.markdown.read_text()
    arms_table = md.split("## Train-inference mismatch")[0]
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in arms_table.splitlines()
            if line.startswith("| gspo-none") or line.startswith("| grpo-r2")}
    assert rows["gspo-none"][1] == "2/2" and rows["grpo-r2"][1] == "2/3"
    finals = [_final_reward(tmp_path / f"gspo-none-s{s}") for s in (0, 1)]
    mean, std = np.mean(finals), np.std(finals)
    assert rows["gspo-none"][2] == f"{mean:.4g} ± {std:.4g}"
    assert "grpo-r2 seed 2: left out" in md


def test_comparison_without_any_metrics_is_an_error(tmp_path):
    with pytest.raises(ReportInputError, match="nothing to compare"):
        build_comparison([ArmRun("a", 0, tmp_path / "missing")], tmp_path / "out")


def test_comparison_of_degenerate_runs(tmp_path):
    arm_runs = [ArmRun("a", 0, write_degenerate_run(tmp_path / "a-s0", 0.0)),
                ArmRun("a", 1, write_degenerate_run(tmp_path / "a-s1", None))]
    paths = build_comparison(arm_runs, tmp_path / "comparison")
    assert len(paths.figures) == len(COMPARE_FIGURES) and paths.skipped == []
    row = [l for l in paths.markdown.read_text().splitlines() if l.startswith("| a |")][0]  # arms table first
    assert "0 ± 0" in row  # the null seed has no finite reward; the zero seed gives 0


def test_mismatch_table_shows_natural_and_replayed_side_by_side(tmp_path):
    arm_runs = []
    for arm, replayed in (("grpo-none", None), ("grpo-r3", 2e-4)):
        d = tmp_path / f"{arm}-s0"
        d.mkdir()
        with open(d / "metrics.jsonl", "w") as f:
            for step in range(4):
                rec = {"step": step, "reward/mean": 0.5, "mismatch/k3_kl": 1e-3 * (step + 1)}
                if replayed is not None:
                    rec["mismatch_replayed/k3_kl"] = replayed if step != 2 else None  # a null step
                f.write(json.dumps(rec) + "\n")
        arm_runs.append(ArmRun(arm, 0, d))
    paths = build_comparison(arm_runs, tmp_path / "comparison")
    md = paths.markdown.read_text()
    rows = {line.split(" | ")[0].strip("| "): [c.strip(" |") for c in line.split(" | ")]
            for line in md.split("## Train-inference mismatch")[1].splitlines() if line.startswith("| grpo-")}
    assert rows["grpo-none"][1:3] == ["0.0025", "n/a"]
    assert rows["grpo-r3"][1:3] == ["0.0025", "0.0002"]
    assert "cmp_mismatch" in {p.stem for p in paths.figures}
