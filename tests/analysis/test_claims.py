"""analysis.claims (with claims_runs / claims_stats / claims_figures): per-run scalars by hand from small
metrics files, the pre-registered tests and their Holm family on synthetic runs where some collapse or
stall, the page regenerated exactly from the saved metrics, and the old experiment's saved file."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from analysis import stats as st
from analysis.claims import claims_page, main
from analysis.claims_runs import claim_run, load_arms, method_of
from analysis.claims_stats import claim_family, r3_family
from analysis.load import load_run

REPO = Path(__file__).resolve().parents[2]
T = 40


def _write_run(d: Path, reward, zero_std=None, *, k3: float = 1e-4, k3_replayed: float | None = None,
               done: bool = True) -> Path:
    d.mkdir(parents=True)
    zero_std = np.zeros(len(reward)) if zero_std is None else zero_std
    rows = []
    for step, (r, z) in enumerate(zip(reward, zero_std)):
        row = {"step": step, "reward/mean": float(r), "reward/frac_zero_std": float(z),
               "mismatch/k3_kl": k3 * (1 + step % 2),  # k3, 2 k3, ...
               "routing/layer_disagree": [0.02, 0.04], "routing/any_layer_flip": 0.05,
               "ratio/token_var": 10.0, "ratio/seq_var": 1.0, "actor/entropy": 1.0,
               "train/lr": 1e-3 if step < 30 else 1e-3 * (T - step) / 11,  # decays over the last 10 steps
               "update/expert_change_frac": 0.5 if step == 0 else (0.04 if step < 30 else 0.01)}
        if k3_replayed is not None:
            row["mismatch_replayed/k3_kl"] = k3_replayed * (2 if step == 0 else 1)
        rows.append(row)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if done:
        (d / "done.json").write_text(json.dumps({"step": len(reward)}))
    return d


LEARN = np.linspace(0.2, 0.95, T)
COLLAPSE = np.r_[np.full(10, 0.8), np.full(30, 0.3)]  # 10-step mean ≤ 0.5 from step 15
STALL = np.full(T, 0.6)
STALL_Z = np.r_[np.zeros(5), np.full(35, 1.0)]  # trailing mean ≥ 0.9 from step 13 (9 of 10 steps at 1)


def test_run_scores_by_hand(tmp_path):
    c = claim_run(load_run(_write_run(tmp_path / "grpo-r3-w8a8-s3", COLLAPSE, k3=2e-4, k3_replayed=1e-4)))
    assert (c.arm, c.seed, c.failure.kind, c.failure.step, c.duration, c.observed) == (
        "grpo-r3-w8a8", 3, "collapse", 15, 15.0, True)
    s = c.scores
    assert s["k3_natural"] == pytest.approx(3e-4) and s["k3_replayed"] == pytest.approx(1e-4 * 41 / 40)
    # per-step ratios: step 0 2e-4/2e-4 = 1, odd steps 4, even steps > 0 2: median of {1, 2 x 19, 4 x 20} = 3
    assert s["k3_ratio_median"] == pytest.approx(3.0)
    assert s["k3_ratio_of_means"] == pytest.approx(3e-4 / (1e-4 * 41 / 40))
    # step 0 (0.5) left out; constant lr: steps 1-29 at 0.04; decay: steps 30-39 at 0.01
    assert s["update_change"] == pytest.approx((29 * 0.04 + 10 * 0.01) / 39)
    assert (s["update_change_const"], s["update_change_decay"]) == pytest.approx((0.04, 0.01))
    assert s["num_moe_layers"] == 2 and s["layer_disagree"] == pytest.approx(0.03)
    assert s["var_quotient"] == 10.0 and s["final_reward"] == pytest.approx(0.3)
    c = claim_run(load_run(_write_run(tmp_path / "grpo-none-bf16_tis-s0", STALL, STALL_Z)))
    assert (c.failure.kind, c.failure.step, c.scores["stall"]) == ("stall", 13, 1.0)
    assert math.isnan(c.scores["k3_ratio_median"]) and method_of(c.arm) == "grpo-none+tis"
    c = claim_run(load_run(_write_run(tmp_path / "gspo-none-fp32-s0", LEARN)))
    assert (c.failure.kind, c.duration, c.observed) == (None, 39.0, False)
    # routing/layer_disagree logged as one float per step: its mean, and no layer count
    d = _write_run(tmp_path / "grpo-none-fp8-s1", LEARN)
    rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        r["routing/layer_disagree"] = 0.07
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = claim_run(load_run(d)).scores
    assert s["layer_disagree"] == pytest.approx(0.07) and s["num_moe_layers"] == 0


SEEDS = range(8)


def _experiment(root: Path) -> Path:
    """fp32 / bf16 / w8a8 GRPO-none (w8a8: every seed collapses, bf16: two stall), fixes at w8a8, zero point."""
    plan = {
        "grpo-none-fp32": [LEARN] * 8, "grpo-none-bf16": [STALL, LEARN, STALL, LEARN] * 2,
        "grpo-none-w8a8": [COLLAPSE] * 8, "grpo-r3-w8a8": [LEARN, LEARN, LEARN, COLLAPSE] * 2,
        "gspo-none-w8a8": [LEARN] * 8, "grpo-none-w8a8_tis": [COLLAPSE, LEARN, COLLAPSE, LEARN] * 2,
        "gspo-none-fp32": [LEARN] * 8, "grpo-r3-fp32": [LEARN] * 8,
    }
    for arm, curves in plan.items():
        for seed, curve in zip(SEEDS, curves):
            z = STALL_Z if curve is STALL else None
            _write_run(root / f"{arm}-s{seed}", curve + 0.001 * seed, z,
                       k3=1e-4 * (seed + 1), k3_replayed=3e-5 if "-r3-" in arm else None)
    _write_run(root / "grpo-none-fp32-s9", COLLAPSE, done=False)  # unfinished: left out
    (root / "comparison").mkdir()  # not a run
    return root


def test_family_verdicts_and_holm(tmp_path):
    arms = load_arms(_experiment(tmp_path / "runs"))
    assert [len(v) for v in arms.values()] == [8] * 8
    tests = claim_family(arms, reps=200, seed=0)
    labels = [t.label for t in tests]
    assert "grpo-none-w8a8 vs grpo-none-fp32: time to failure" in labels
    assert "grpo-none-bf16 vs grpo-none-fp32: time to failure" in labels
    assert {"grpo-r3-w8a8 vs grpo-none-w8a8: final reward", "gspo-none-w8a8 vs grpo-none-w8a8: reward AUC",
            "grpo-none-w8a8_tis vs grpo-none-w8a8: time to failure",
            "gspo-none-fp32 vs grpo-none-fp32: time to failure", "grpo-r3-fp32 vs grpo-none-fp32: time to failure"
            } <= set(labels)
    assert len(tests) == 2 + 3 * 3 + 2  # dose, 3 fixes x 3 (no R2 arm), zero point
    r3 = r3_family(arms, reps=200, seed=0)  # (a): exploratory, its own Holm family
    assert [t.label for t in r3] == ["grpo-r3-fp32: k3 natural vs replayed", "grpo-r3-w8a8: k3 natural vs replayed"]
    assert [t.p_holm for t in r3] == pytest.approx(st.holm([t.p for t in r3]))
    assert [t.p_holm for t in tests] == pytest.approx(st.holm([t.p for t in tests]))
    by = {t.label: t for t in tests}
    dose = by["grpo-none-w8a8 vs grpo-none-fp32: time to failure"]
    assert dose.agrees is True and dose.p < 0.01 and dose.verdict.startswith("reproduces (Holm-adjusted p = ")
    gspo = by["gspo-none-w8a8 vs grpo-none-w8a8: time to failure"]
    assert gspo.agrees is True and gspo.verdict.startswith("reproduces")
    # 8 seeds paired, GSPO higher on every seed: the smallest two-sided Wilcoxon p, 2/256
    fr = by["gspo-none-w8a8 vs grpo-none-w8a8: final reward"]
    assert fr.test == "Wilcoxon signed-rank (paired by seed, n=8)" and fr.p == pytest.approx(2 / 256)
    assert fr.agrees is True and fr.p_holm > 0.05 and fr.verdict.startswith("not decided (Holm-adjusted p = ")
    zero = by["gspo-none-fp32 vs grpo-none-fp32: time to failure"]
    assert zero.p == 1.0 and zero.verdict.startswith("not decided: no difference at the Holm-adjusted level")


def test_page_and_round_trip(tmp_path):
    runs = _experiment(tmp_path / "runs")
    saved, a_md, b_md, figs = (tmp_path / "m.jsonl.gz", tmp_path / "a.md", tmp_path / "b.md", tmp_path / "figs")
    assert main([str(runs), "--save-metrics", str(saved), "--out", str(a_md), "--figures", str(figs),
                 "--bootstrap-reps", "200"]) == 0
    assert main([str(saved), "--out", str(b_md), "--bootstrap-reps", "200"]) == 0
    page = a_md.read_text()
    assert page == b_md.read_text()
    assert sorted(p.name for p in figs.iterdir()) == ["dose_response.png", "km_bf16.png", "km_fp32.png",
                                                      "km_w8a8.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in figs.iterdir())
    # pre-registered: GRPO-none at bf16 fails in at least half its seeds (4/8: holds, CI from 16 %)
    assert ("grpo-none-bf16: failed 4/8 (50 %, 95% CI 16–84 %) → the positive control **holds** "
            "(point estimate ≥ 0.5; the 95% CI's lower bound is below 0.5)") in page
    assert "At the strongest drift present, grpo-none-w8a8 failed 8/8 (100 %, 95% CI 63–100 %)." in page
    assert "| grpo-none-bf16 | 8 | 4/8 (50 %, 95% CI 16–84 %) | 0 | 4 | 13 |" in page  # KM: S(13) = 0.5
    assert "| grpo-none-w8a8 | 8 | 8/8 (100 %, 95% CI 63–100 %) | 8 | 0 | 15 |" in page
    assert "| papers (Qwen3-30B-A3B) |  | ~10% (R3 paper) |" in page
    assert "### (c) Sanity check, not a reproduction" in page and "4 (paper: 48)" not in page
    # (d): (29 x 0.04 + 10 x 0.01) / 39 without step 0; constant across seeds: a degenerate CI, 4 digits
    assert ("| grpo-none-fp32 | 8 | 0.03231 [0.03231, 0.03231] | 0.04 [0.04, 0.04] | 0.01 [0.01, 0.01] "
            "| 2 (paper: 48) |") in page
    assert "Arms: 8; seeds per arm: 8; pre-registered tests: 13" in page
    assert main([str(runs), "--bootstrap-reps", "200", "--seed", "1", "--out", str(b_md)]) == 0
    assert b_md.read_text() != page  # another base seed: other bootstrap streams


def test_claims_page_is_independent_of_other_arms_for_an_arms_cells(tmp_path):
    arms = load_arms(_experiment(tmp_path / "runs"))
    only = {a: arms[a] for a in ("grpo-none-w8a8",)}
    row = lambda page: next(l for l in page.splitlines() if l.startswith("| grpo-none-w8a8 | 8 | 8/8"))  # noqa: E731
    assert row(claims_page(only, reps=200)) == row(claims_page(arms, reps=200))


def test_cli_errors(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2 and "no finished run" in capsys.readouterr().err
    assert main([str(tmp_path / "nope")]) == 2 and "does not exist" in capsys.readouterr().err


def test_the_old_experiments_saved_metrics_still_load(tmp_path):
    saved = REPO / "reports" / "paper_claims_fine" / "metrics.jsonl.gz"
    if not saved.is_file():
        pytest.skip("reports/paper_claims_fine/metrics.jsonl.gz not in this checkout")
    out = tmp_path / "old.md"
    assert main([str(saved), "--out", str(out), "--bootstrap-reps", "100"]) == 0
    page = out.read_text()
    assert "Arms: 8; seeds per arm: 8" in page
    assert "### Fixes at the strongest drift (fp8): against grpo-none-fp8" in page
    assert "### Dose–response" in page and "No test: its arms are not in this experiment." in page
    assert "| grpo-r3-fp8 vs grpo-none-fp8: final reward | Wilcoxon signed-rank (paired by seed, n=8) |" in page
    assert "grpo-none-bf16: failed 1/8 (12 %, 95% CI 0.3–53 %) → the positive control **does not hold**" in page
