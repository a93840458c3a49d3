"""analysis.compare: seed bands, the per-arm table, and the comparison report of an ablation."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from analysis.compare import MAX_TABLE_LAYERS, build_comparison, main
from analysis.compare_arms import ArmRun, arm_runs_from_dirs
from analysis.compare_figures import COMPARE_FIGURES, seed_band
from analysis.load import ReportInputError, RunData
from analysis.stats import Estimate, fmt_ci
from synth_run import NUM_STEPS, assert_real_png, write_degenerate_run, write_synthetic_run


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
    """Runs without traces: every figure but the length one (skipped, with its reason); the arms table
    has the steps, final reward IQM [95% CI] and its min–max across seeds; the seed-statistics and
    pairwise-verdict tables follow."""
    arm_runs = []
    for i, arm in enumerate(("gspo-none", "grpo-r2")):
        for seed in (0, 1):
            d = write_synthetic_run(tmp_path / f"{arm}-s{seed}", seed=10 * i + seed, with_traces=False)
            arm_runs.append(ArmRun(arm, seed, d))
    arm_runs.append(ArmRun("grpo-r2", 2, tmp_path / "grpo-r2-s2"))  # never ran
    paths = build_comparison(arm_runs, tmp_path / "comparison")
    assert {p.stem for p in paths.figures} == {s.name for s in COMPARE_FIGURES} - {"cmp_gate", "cmp_ratio_var_length"}
    assert [(s.name, s.reason) for s in paths.skipped] == [
        ("cmp_gate", "metric(s) gate/weight_mean, gate/token_frac_below_half missing from all runs"),
        ("cmp_ratio_var_length", "no run has traces/step_*_logprobs.npz files (logging.trace_every 0 or "
                                 "traces missing)")]
    for p in paths.figures:
        assert_real_png(p)
    md = paths.markdown.read_text()
    rows = _table_rows(md, "Arms")
    assert rows["gspo-none"][1] == "2/2" and rows["grpo-r2"][1] == "2/3"
    finals = [_final_reward(tmp_path / f"gspo-none-s{s}") for s in (0, 1)]
    assert rows["gspo-none"][2] == str(NUM_STEPS) and rows["grpo-r2"][2] == str(NUM_STEPS)
    # 2 seeds: the IQM is their mean; a quarter of the resamples is each seed twice, so the CI is [min, max]
    assert rows["gspo-none"][3] == fmt_ci(Estimate(float(np.mean(finals)), min(finals), max(finals), 2))
    assert rows["gspo-none"][4] == f"{min(finals):.4g}–{max(finals):.4g}"
    assert "grpo-r2 seed 2: left out" in md
    seeds = _table_rows(md, "Seed statistics")
    assert seeds["header"] == ["arm", "seeds", "final reward", "reward AUC", "steps to threshold",
                               "failure (collapse or stall) rate", "mismatch k3 KL"]
    assert seeds["gspo-none"][2] == rows["gspo-none"][3] and seeds["grpo-r2"][1] == "2"
    assert seeds["gspo-none"][4] == "13 [13, 13]; 2/2 not reached"  # synthetic rewards stay below 0.8
    section = md.split("## Pairwise verdicts")[1].split("\n## ")[0]
    verdicts = [[c.strip() for c in line.strip("|").split("|")] for line in section.splitlines()
                if line.startswith("| gspo-none vs grpo-r2 |")]
    assert [v[1] for v in verdicts] == ["final reward", "reward AUC", "steps to threshold",
                                        "failure (collapse or stall) rate", "mismatch k3 KL"]
    # both arms have seeds 0 and 1 (grpo-r2's seed 2 never ran): paired by seed
    assert verdicts[3][2:] == ["paired by seed (n=2)", "0 [0, 0]", "0.5 [0.5, 0.5]", "1 (Wilcoxon signed-rank)", "1",
                               "not decided (Holm-adjusted p = 1; no difference measured)"]
    assert seeds["gspo-none"][5] == "0/2 (0 %, 95% CI 0–84 %)"  # Clopper-Pearson, not a bootstrap


def _curve_run(run_dir: Path, rewards: list[float], k3_kl: float) -> Path:
    return _write_run(run_dir, [{"step": i, "reward/mean": r, "mismatch/k3_kl": k3_kl}
                                for i, r in enumerate(rewards)])


def test_seed_statistics_options_from_the_command_line(tmp_path, capsys):
    """--reward-threshold and --collapse-drop reach the per-run quantities; --pair picks the pairs."""
    curves = {"up": [0.1, 0.3, 0.5, 0.7] + [0.9] * 36, "peak": [0.1] + [0.9] * 9 + [0.4] * 30,
              "flat": [0.3] * 40}
    dirs = [str(_curve_run(tmp_path / f"{arm}-s{s}", [r + 0.01 * s for r in curve], 1e-3 * (s + 1)))
            for arm, curve in curves.items() for s in range(3)]
    out = tmp_path / "cmp"
    assert main([str(out), *dirs, "--reward-threshold", "0.65", "--collapse-drop", "0.4",
                 "--pair", "up,peak", "--bootstrap-reps", "200"]) == 0
    md = (out / "report.md").read_text()
    rows = _table_rows(md, "Seed statistics")
    # 40 steps, window 4: up's moving average reaches 0.65 over steps 3-6 (0.75), peak's over steps 1-4
    assert rows["up"][4] == "6 [6, 6]" and rows["peak"][4] == "4 [4, 4]"
    assert rows["flat"][4] == "41 [41, 41]; 3/3 not reached"
    # peak: 10-step trailing mean from 0.9 down to 0.4, 0.5 below its best from step 17 on (≤ 40 - 20)
    assert [rows[a][5] for a in ("up", "peak", "flat")] == [
        "0/3 (0 %, 95% CI 0–71 %)", "3/3 (100 %, 95% CI 29–100 %)", "0/3 (0 %, 95% CI 0–71 %)"]
    assert rows["up"][6] == "0.0020 [0.0010, 0.0030]"  # k3 KL per seed 1e-3, 2e-3, 3e-3: digits the CI supports
    verdicts = _table_rows(md, "Pairwise verdicts")
    assert set(verdicts) - {"header"} == {"up vs peak"}
    assert "reaches 0.6" in md and "≥ 0.4 below" in md
    assert main([str(out), *dirs, "--collapse-drop", "0.6", "--bootstrap-reps", "50"]) == 0
    rows = _table_rows((out / "report.md").read_text(), "Seed statistics")
    assert rows["peak"][5].startswith("0/3 ") and rows["up"][4] == "7 [7, 7]"  # defaults: threshold 0.8
    assert main([str(out), *dirs, "--pair", "up,nope"]) == 2
    assert "unknown arm(s) nope" in capsys.readouterr().err


def test_comparison_without_any_metrics_is_an_error(tmp_path):
    with pytest.raises(ReportInputError, match="nothing to compare"):
        build_comparison([ArmRun("a", 0, tmp_path / "missing")], tmp_path / "out")


def test_comparison_of_degenerate_runs(tmp_path):
    arm_runs = [ArmRun("a", 0, write_degenerate_run(tmp_path / "a-s0", 0.0)),
                ArmRun("a", 1, write_degenerate_run(tmp_path / "a-s1", None))]
    paths = build_comparison(arm_runs, tmp_path / "comparison")
    assert len(paths.figures) == len(COMPARE_FIGURES) - 2
    assert [s.name for s in paths.skipped] == ["cmp_gate", "cmp_ratio_var_length"]  # no sapo arm, no traces
    row = [l for l in paths.markdown.read_text().splitlines() if l.startswith("| a |")][0]  # arms table first
    assert "| 0 (1 seed) |" in row  # the null seed has no finite reward; the zero seed gives 0


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


def test_arms_table_shows_clip_gate_and_generation_rounds_per_algorithm(tmp_path):
    """CISPO arms: binding 0 and the truncated-weight fraction; SAPO arms: the gate columns (n/a elsewhere);
    dynamic sampling: the mean generation rounds per step; entropy and zero-std share when logged. Means over steps (a null step left out), then seeds."""
    per_arm = {
        "cispo-none": [{"clip/token_frac": 0.0, "clip/out_of_range_frac": 0.02 * (k + 1)} for k in range(3)],
        "sapo-none": [{"gate/weight_mean": 0.9 + 0.01 * k, "gate/token_frac_below_half": [0.0, None, 0.3][k]}
                      for k in range(3)],
        "grpo-none-dapo": [{"clip/token_frac": 0.01, "sampling/num_gen_batches": float(k + 1),
                            "actor/entropy": 1.0 - 0.25 * k, "reward/frac_zero_std": 0.5} for k in range(3)],
    }
    arm_runs = []
    for arm, extra in per_arm.items():
        d = tmp_path / f"{arm}-s0"
        d.mkdir()
        d.joinpath("metrics.jsonl").write_text("".join(
            json.dumps({"step": k, "reward/mean": 0.5, **e}) + "\n" for k, e in enumerate(extra)))
        arm_runs.append(ArmRun(arm, 0, d))
    paths = build_comparison(arm_runs, tmp_path / "comparison")
    rows = _table_rows(paths.markdown.read_text(), "Arms")
    col = {name: rows["header"].index(name) for name in rows["header"]}
    get = lambda arm, name: rows[arm][col[name]]  # noqa: E731
    assert (get("cispo-none", "clip token frac (binding)"), get("cispo-none", "clip out-of-range frac")) == ("0", "0.04")
    assert get("cispo-none", "gate weight mean (sapo)") == "n/a"
    assert (get("sapo-none", "gate weight mean (sapo)"), get("sapo-none", "gate frac < 0.5 (sapo)")) == ("0.91", "0.15")
    assert get("sapo-none", "clip token frac (binding)") == "n/a"
    assert get("grpo-none-dapo", "gen batches/step") == "2" and get("sapo-none", "gen batches/step") == "n/a"
    assert (get("grpo-none-dapo", "actor/entropy"), get("grpo-none-dapo", "reward/frac_zero_std")) == ("0.75", "0.5")
    assert "cmp_gate" in {p.stem for p in paths.figures}


def _write_run(run_dir: Path, records: list[dict], logprobs: list[dict] | None = None) -> Path:
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if logprobs is not None:
        (run_dir / "traces").mkdir()
        for i, lp in enumerate(logprobs):
            np.savez(run_dir / "traces" / f"step_{10 * (i + 1):06d}_logprobs.npz", **lp)
    return run_dir


def _table_rows(md: str, title_start: str) -> dict[str, list[str]]:
    section = md.split(f"## {title_start}")[1].split("\n## ")[0]
    lines = [l for l in section.splitlines() if l.startswith("| ")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    return {"header": header} | {c[0]: c for c in ([x.strip() for x in l.strip("|").split("|")]
                                                    for l in lines[1:])}


def test_layer_table_and_figure_hand_values(tmp_path):
    """Per layer: per seed the mean over steps (null steps left out), then the mean over seeds."""
    change = {0: [[0.1, 0.2], [0.3, None]], 1: [[0.5, 0.4]]}  # arm means [0.35, 0.3]
    arm_runs = []
    for seed, rows in change.items():
        recs = [{"step": i, "reward/mean": 0.5, "update/layer_change": r} for i, r in enumerate(rows)]
        arm_runs.append(ArmRun("grpo-none", seed, _write_run(tmp_path / f"grpo-none-s{seed}", recs)))
    recs = [{"step": 0, "reward/mean": 0.5, "routing/layer_disagree": [0.02, 0.04]},
            {"step": 1, "reward/mean": 0.5, "routing/layer_disagree": [0.04, 0.08]}]
    arm_runs.append(ArmRun("gspo-none", 0, _write_run(tmp_path / "gspo-none-s0", recs)))
    paths = build_comparison(arm_runs, tmp_path / "comparison")
    rows = _table_rows(paths.markdown.read_text(), "Routing change per MoE layer")
    assert rows["header"] == ["arm", "update change L0", "update change L1", "rollout/learner disagree L0",
                              "rollout/learner disagree L1"]
    assert rows["grpo-none"][1:] == ["0.35", "0.3", "n/a", "n/a"]
    assert rows["gspo-none"][1:] == ["n/a", "n/a", "0.03", "0.06"]
    assert "cmp_layer_change" in {p.stem for p in paths.figures}
    assert_real_png(tmp_path / "comparison" / "cmp_layer_change.png")


def test_layer_table_of_a_deep_model_is_compact(tmp_path):
    num_layers = MAX_TABLE_LAYERS + 1
    vals = [0.01 * i for i in range(num_layers)]  # mean over layers 0.06, largest on the last layer
    recs = [{"step": 0, "reward/mean": 0.5, "update/layer_change": vals}]
    paths = build_comparison([ArmRun("a", 0, _write_run(tmp_path / "a-s0", recs))], tmp_path / "out")
    rows = _table_rows(paths.markdown.read_text(), "Routing change per MoE layer")
    assert rows["header"][1:3] == ["update change, mean over layers", "update change, max layer"]
    assert rows["a"][1:] == ["0.06", f"L{num_layers - 1}: 0.12", "n/a", "n/a"]


def test_no_per_layer_metrics_no_layer_table_and_a_skip_reason(tmp_path):
    d = _write_run(tmp_path / "a-s0", [{"step": 0, "reward/mean": 0.5}])
    paths = build_comparison([ArmRun("a", 0, d)], tmp_path / "out")
    assert "Routing change per MoE layer" not in paths.markdown.read_text()
    reasons = {s.name: s.reason for s in paths.skipped}
    assert reasons["cmp_layer_change"] == ("per-layer metrics update/layer_change, routing/layer_disagree "
                                           "missing from all runs")


def _lp(d_per_seq: list[list[float]]) -> dict[str, np.ndarray]:
    d = np.concatenate([np.asarray(x, np.float64) for x in d_per_seq])
    return {"rollout_logp": np.zeros(d.size, np.float32), "learner_logp": d.astype(np.float32),
            "response_lens": np.asarray([len(x) for x in d_per_seq], np.int32)}


def test_ratio_variance_length_figure_from_traces(tmp_path):
    arm_runs = [ArmRun(arm, seed, write_synthetic_run(tmp_path / f"{arm}-s{seed}", seed=10 * i + seed))
                for i, arm in enumerate(("gspo-none", "grpo-none")) for seed in (0, 1)]
    arm_runs.append(ArmRun("grpo-r3", 0, write_synthetic_run(tmp_path / "grpo-r3-s0", with_traces=False)))
    paths = build_comparison(arm_runs, tmp_path / "comparison")
    assert [s.name for s in paths.skipped] == ["cmp_gate"]  # no sapo arm
    assert_real_png(tmp_path / "comparison" / "cmp_ratio_var_length.png")
    # the layer table is labelled with the traces' model layer ids (1, 2) and recomputes from the JSONL
    rows = _table_rows(paths.markdown.read_text(), "Routing change per MoE layer")
    assert rows["header"][1:3] == ["update change L1", "update change L2"]
    per_seed = [np.mean([json.loads(l)["update/layer_change"]
                         for l in (tmp_path / f"gspo-none-s{s}" / "metrics.jsonl").read_text().splitlines()], 0)
                for s in (0, 1)]
    assert rows["gspo-none"][1:3] == [f"{v:.4g}" for v in np.mean(per_seed, 0)]


@pytest.mark.parametrize("traces,reason", [
    ("corrupt", "every step_*_logprobs.npz file was unreadable"),
    ("one_per_bin", "fewer than 2 responses per length bin in every arm's logprob traces"),
    ("empty", "no non-empty responses in the logprob traces"),
])
def test_ratio_variance_length_skip_reasons(tmp_path, traces, reason):
    lps = {"one_per_bin": [_lp([[0.1]])],
           "empty": [{"rollout_logp": np.zeros(0, np.float32), "learner_logp": np.zeros(0, np.float32),
                      "response_lens": np.zeros(2, np.int32)}]}.get(traces, [])
    d = _write_run(tmp_path / "a-s0", [{"step": 0, "reward/mean": 0.5}], lps)
    if traces == "corrupt":
        (d / "traces" / "step_000010_logprobs.npz").write_bytes(b"not an npz")
    paths = build_comparison([ArmRun("a", 0, d)], tmp_path / "out")
    assert {s.name: s.reason for s in paths.skipped}["cmp_ratio_var_length"] == reason
    if traces == "corrupt":  # the unreadable file is named in the report's input notes
        assert "a seed 0: skipped step_000010_logprobs.npz" in paths.markdown.read_text()
