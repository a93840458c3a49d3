"""`python -m benchmarks.routes_memory_bench` at a toy size: it runs, its held bytes are the plan's, and the
learner's recording peaks at the plan's count (uint8 ids on the device, per-sequence copies)."""

from __future__ import annotations

import json

import pytest

from benchmarks.routes_memory_bench import main


def test_routes_memory_bench_small(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["--seqs", "4", "--seq-len", "256", "--json", str(out)]) == 0
    assert "bytes per representation" in capsys.readouterr().out
    res = json.loads(out.read_text())
    st, plan, tokens = res["stages"], res["plan_bytes_per_token"], res["tokens"]
    L, K = 48, 8
    assert tokens == 4 * 256 and plan["rollout"] == L * K
    # kept = pass end's whole-batch arrays: uint8 ids, fp32 probs, fp32 stats; metrics: router_diagnostics'
    assert plan["learner_kept"] == plan["learner_gather"] == L * K * 5 + 8 * L
    assert plan["metrics"] == plan["metrics_router"] == 2 * L * K + 32 * L
    assert plan["metrics_compare"] == 4 * L * K + 1 + 16 + 5 * L and plan["drift_metrics"] == 2 * L * K + 17 * L
    assert set(st) >= {"learner_record_microbatch", "metrics_compare", "metrics_router", "drift_metrics"}
    assert st["samples"]["held_bytes"] == 4 * 255 * L * K  # uint8 [T - 1, L, K] per sequence
    assert st["packed_batch"]["routes_shared_with_samples"] is True
    assert st["route_checks"]["views"] is True and st["route_checks"]["fallback_token_frac"] == 0
    # the step keeps per-sequence copies only; the whole-batch arrays coexist with them at the pass end
    assert st["learner_record"]["held_bytes"] == tokens * plan["learner_kept"]
    assert st["learner_record"]["traced_peak_bytes"] == pytest.approx(
        tokens * (plan["learner_kept"] + plan["learner_gather"]), rel=0.01)
    # one micro-batch of one sequence: int64 ids + their uint8 copy (the per-sequence arrays are views)
    mb = st["learner_record_microbatch"]
    assert mb["plan_bytes_per_token"] == 9 * L * K
    assert mb["traced_peak_bytes"] == pytest.approx(256 * 9 * L * K, rel=0.01)
    assert st["int64_whole_batch"]["held_bytes"] == 8 * st["samples"]["held_bytes"]
