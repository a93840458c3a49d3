"""analysis.claims: per-run scalars computed by hand from small metrics files, run discovery, and the
verdicts of the claims page."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from analysis.claims import claims_page, load_arms, main, run_scores
from analysis.load import load_run


def _write_run(d: Path, *, k3: float, k3_replayed: float | None = None, reward=(0.1, 0.2, 0.3, 0.4),
               done: bool = True) -> Path:
    d.mkdir(parents=True)
    rows = []
    for step, r in enumerate(reward):
        row = {"step": step, "reward/mean": r, "mismatch/k3_kl": k3 * (1 + step % 2),  # k3, 2k3, k3, 2k3
               "mismatch/extreme_frac_ln2": 0.01, "routing/layer_disagree": [0.02, 0.04],
               "routing/any_layer_flip": 0.05, "ratio/token_var": [4.0, 9.0, 30.0, 1.0][step],
               "ratio/seq_var": [2.0, 1.0, 3.0, 1.0][step],  # quotients 2, 9, 10, 1: median 5.5
               "actor/entropy": [4.0, 3.0, 2.0, 1.5][step], "reward/frac_zero_std": 0.25 * step}
        if k3_replayed is not None:
            row["mismatch_replayed/k3_kl"] = k3_replayed
        if step % 2 == 0:
            row["update/expert_change_frac"] = 0.1 if step == 0 else 0.2
            row["update/layer_change"] = [0.1, 0.3] if step == 0 else [0.2, 0.2]
        rows.append(row)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if done:
        (d / "done.json").write_text(json.dumps({"step": len(reward)}))
    return d


def test_run_scores_by_hand(tmp_path):
    s = run_scores(load_run(_write_run(tmp_path / "grpo-r3-fp8-s0", k3=2e-5, k3_replayed=1e-5)))
    assert s["k3_natural"] == pytest.approx(3e-5)  # mean of 2e-5, 4e-5, 2e-5, 4e-5
    assert s["k3_replayed"] == pytest.approx(1e-5)
    assert s["k3_reduction"] == pytest.approx(3.0)
    assert s["k3_loss"] == pytest.approx(1e-5)  # R3's loss uses the replayed pass
    assert s["layer_disagree"] == pytest.approx(0.03) and s["any_layer_flip"] == pytest.approx(0.05)
    assert s["var_quotient"] == pytest.approx(5.5)
    assert s["update_change"] == pytest.approx(0.15) and s["update_layer_change"] == pytest.approx(0.2)
    assert s["final_entropy"] == pytest.approx(1.5) and s["final_zero_std"] == pytest.approx(0.75)  # last step
    assert s["reward_auc"] == pytest.approx(0.25) and s["final_reward"] == pytest.approx(0.4)
    s = run_scores(load_run(_write_run(tmp_path / "grpo-none-fp8-s0", k3=2e-5)))
    assert np.isnan(s["k3_replayed"]) and np.isnan(s["k3_reduction"]) and s["k3_loss"] == pytest.approx(3e-5)


def test_load_arms_and_verdicts(tmp_path):
    for seed, (nat, rep) in enumerate([(2e-5, 1e-5), (3e-5, 1.2e-5), (2.5e-5, 0.9e-5)]):
        _write_run(tmp_path / f"grpo-r3-fp8-s{seed}", k3=nat, k3_replayed=rep)
        _write_run(tmp_path / f"grpo-none-fp8-s{seed}", k3=nat * 2)
    _write_run(tmp_path / "grpo-none-fp8-s9", k3=1.0, done=False)  # unfinished: left out
    (tmp_path / "comparison").mkdir()  # not a run
    arms = load_arms(tmp_path)
    assert sorted(arms) == ["grpo-none-fp8", "grpo-r3-fp8"] and [len(v) for v in arms.values()] == [3, 3]
    page = claims_page(arms, reps=200)
    # R3's loss-side k3 (replayed, ~1e-5) is below GRPO's natural one (~5e-5) on every seed
    assert ("| grpo-r3-fp8 vs grpo-none-fp8 | k3 KL, rollout vs the pi_old the loss uses |" in page
            and "grpo-r3-fp8 better than grpo-none-fp8: the 95% CI of the difference excludes 0" in page)
    # equal rewards: the stability comparison cannot be decided
    assert "| grpo-r3-fp8 vs grpo-none-fp8 | final reward | 0 [0, 0] |" in page
    assert "| gspo-none-fp8 vs grpo-none-fp8 | all | n/a | n/a | not run |" in page


def test_cli_errors_and_writes(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2 and "no finished run" in capsys.readouterr().err
    _write_run(tmp_path / "gspo-none-bf16-s0", k3=1e-5)
    out = tmp_path / "claims.md"
    assert main([str(tmp_path), "--out", str(out), "--bootstrap-reps", "50"]) == 0
    assert "### (c) GSPO" in out.read_text()


def test_saved_metrics_give_the_same_page(tmp_path):
    for seed in range(2):
        _write_run(tmp_path / "runs" / f"grpo-r3-bf16-s{seed}", k3=2e-5 * (seed + 1), k3_replayed=1e-5)
    out = tmp_path / "m.jsonl.gz"
    assert main([str(tmp_path / "runs"), "--save-metrics", str(out), "--out", str(tmp_path / "a.md"),
                 "--bootstrap-reps", "50"]) == 0
    assert main([str(out), "--out", str(tmp_path / "b.md"), "--bootstrap-reps", "50"]) == 0
    assert (tmp_path / "a.md").read_text() == (tmp_path / "b.md").read_text()
    assert "grpo-r3-bf16 | 2 |" in (tmp_path / "a.md").read_text()
