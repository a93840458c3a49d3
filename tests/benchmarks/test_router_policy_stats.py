"""benchmarks.router_policy_stats: per-run means (step 0 left out of the update metric), paired differences and
Holm over the table, on run directories written here."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks.router_policy_stats import load, run_means, table


def _run(root, name, change, flips):
    d = root / name
    d.mkdir(parents=True)
    rows = [{"step": s, "update/expert_change_frac": (0.5 if s == 0 else change), "routing/layer_disagree": [flips, flips],
             "routing/any_layer_flip": 2 * flips, "mismatch/k3_kl": 1e-5} for s in range(4)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "done.json").write_text("{}")


def _p(text: str) -> float:
    return 0.0 if text.strip().startswith("<") else float(text)


def test_run_means_leave_out_step_0_of_the_update_metric(tmp_path):
    _run(tmp_path, "gspo-none-base-s0", 0.02, 0.03)
    m = run_means(tmp_path / "gspo-none-base-s0" / "metrics.jsonl")
    assert m["update/expert_change_frac"] == pytest.approx(0.02) and m["routing/layer_disagree"] == pytest.approx(0.03)


def test_paired_differences_and_holm(tmp_path):
    for s in range(5):
        _run(tmp_path, f"gspo-none-base-s{s}", 0.02 + 0.001 * s, 0.03 + 0.002 * s)
        _run(tmp_path, f"gspo-none-frozen-s{s}", 0.02 + 0.001 * s + 0.01 + 0.0001 * s, 0.03 + 0.002 * s)  # +0.0102 mean
    (tmp_path / "gspo-none-frozen-s9").mkdir()  # unfinished: no done.json, left out
    variants = load(tmp_path)
    assert sorted(variants) == ["base", "frozen"] and sorted(variants["frozen"]) == [0, 1, 2, 3, 4]
    text = table(variants, reps=200)
    change = next(line for line in text.splitlines() if "experts changed" in line).split(" | ")
    assert change[0] == "| frozen vs base"
    assert change[4].startswith("0.010")  # the paired mean difference, 0.0102
    assert _p(change[7]) < 0.05 and change[-1].rstrip(" |") == "differs"  # 5 seeds, tiny spread
    flips = next(line for line in text.splitlines() if "per MoE layer" in line)
    assert flips.rstrip(" |").endswith("not tested")  # identical in every seed: no test
    assert np.isfinite(_p(change[6])) and _p(change[6]) <= _p(change[7])


def test_no_base_is_one_clear_error(tmp_path):
    _run(tmp_path, "gspo-none-frozen-s0", 0.02, 0.03)
    with pytest.raises(ValueError, match="no finished 'base' runs"):
        table(load(tmp_path), reps=50)


def test_a_variant_at_another_drift_level_is_compared_with_that_levels_base(tmp_path):
    for s in range(3):
        _run(tmp_path, f"gspo-none-base-s{s}", 0.02, 0.03 + 0.001 * s)
        _run(tmp_path, f"gspo-none-fp8-s{s}", 0.02, 0.13 + 0.002 * s)
        _run(tmp_path, f"gspo-none-frozen_fp8-s{s}", 0.02, 0.14 + 0.002 * s)
        _run(tmp_path, f"gspo-none-seq_aux-s{s}", 0.02, 0.05 + 0.001 * s)
    rows = [line.split(" | ") for line in table(load(tmp_path), reps=100).splitlines()[2:] if "per MoE layer" in line]
    pairs = {r[0].lstrip("| "): r[4] for r in rows}
    assert set(pairs) == {"fp8 vs base", "frozen_fp8 vs fp8", "seq_aux vs base"}
    lead = {k: float(v.split()[0]) for k, v in pairs.items()}  # the paired mean difference before its CI
    assert lead["frozen_fp8 vs fp8"] == pytest.approx(0.01) and lead["fp8 vs base"] == pytest.approx(0.101)
    assert lead["seq_aux vs base"] == pytest.approx(0.02)
