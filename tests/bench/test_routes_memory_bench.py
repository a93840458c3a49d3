"""`python -m moe_gspo.bench.routes_memory_bench` at a toy size: it runs, and its held bytes are the plan's."""

from __future__ import annotations

import json

from moe_gspo.bench.routes_memory_bench import main


def test_routes_memory_bench_small(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["--seqs", "4", "--seq-len", "256", "--json", str(out)]) == 0
    assert "bytes per representation" in capsys.readouterr().out
    res = json.loads(out.read_text())
    st, plan, tokens = res["stages"], res["plan_bytes_per_token"], res["tokens"]
    assert tokens == 4 * 256 and plan["rollout"] == 48 * 8
    assert st["samples"]["held_bytes"] == 4 * 255 * 48 * 8  # uint8 [T - 1, L, K] per sequence
    assert st["packed_batch"]["routes_shared_with_samples"] is True
    assert st["route_checks"]["views"] is True and st["route_checks"]["fallback_token_frac"] == 0
    assert st["learner_record"]["held_bytes"] == tokens * plan["learner_kept"]
    assert st["int64_whole_batch"]["held_bytes"] == 8 * st["samples"]["held_bytes"]
    assert st["learner_record"]["traced_peak_bytes"] >= tokens * (plan["learner_kept"] + plan["learner_gather"])
