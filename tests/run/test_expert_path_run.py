"""Issue 61: a run says once which expert path it runs and why (stdout and run.json), and with the grouped
layout logs `perf/expert_path_fallback_frac` (0: the CPU's grouped GEMM takes every forward)."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_run_prints_and_records_its_expert_path(tmp_path, capsys):
    from moe_gspo import train

    args = ["--config", str(ROOT / "configs" / "tiny_cpu_copy_first.yaml"), "train.steps=1",
            "rollout.prompts_per_step=2", "logging.wandb_mode=disabled", "logging.progress=false",
            "train.export_hf=false"]
    assert train.main([*args, "--run-dir", str(tmp_path / "auto"), "model.expert_layout=auto"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("expert path: ")]
    assert len(lines) == 1 and lines[0].startswith("expert path: per_expert (no CUDA); "), out[-2000:]
    facts = json.loads((tmp_path / "auto" / "run.json").read_text())["expert_path"]
    assert facts["asked"] == "auto" and facts["layout"] == "per_expert" and lines[0] == f"expert path: {facts['line']}"
    rows = [json.loads(r) for r in (tmp_path / "auto" / "metrics.jsonl").read_text().splitlines()]
    assert "perf/expert_path_fallback_frac" not in rows[0]  # no grouped layout, nothing to count
    assert train.main([*args, "--run-dir", str(tmp_path / "grouped"), "model.expert_layout=grouped"]) == 0
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if line.startswith("expert path: ")] == \
        ["expert path: grouped (torch._grouped_mm)"]
    assert json.loads((tmp_path / "grouped" / "run.json").read_text())["expert_path"]["path"] == "grouped"
    rows = [json.loads(r) for r in (tmp_path / "grouped" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["perf/expert_path_fallback_frac"] == 0.0
