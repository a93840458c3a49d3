"""Issue 43.13: an interrupted ablation says how many arms really finished (this run and before it)
and which were cut short."""

from __future__ import annotations

import json
from pathlib import Path

from moe_gspo import ablate

ROOT = Path(__file__).resolve().parents[1]


def test_the_interruption_line_counts_finished_arms_and_names_the_cut_one(tmp_path, capsys):
    out = tmp_path / "abl"
    spec = tmp_path / "spec.yaml"
    spec.write_text(json.dumps({"base_config": str(ROOT / "configs/tiny_cpu.yaml"), "algos": ["gspo", "grpo"],
                                "routing_replay": ["none"], "seeds": [0, 1], "out_dir": str(out)}))
    (out / "grpo-none-s1").mkdir(parents=True)
    (out / "grpo-none-s1" / "done.json").write_text("{}")  # finished by an earlier invocation

    def runner(arm, command, log_path):
        if arm.name == "grpo-none-s0":
            raise KeyboardInterrupt  # Ctrl-C while this arm runs
        (arm.run_dir / "done.json").write_text("{}")
        return 0

    assert ablate.main(["--config", str(spec)], arm_runner=runner) == 130
    line = [l for l in capsys.readouterr().err.splitlines() if l.startswith("interrupted")]
    assert len(line) == 1 and line[0].startswith(
        "interrupted by SIGINT; 2 of 4 arms finished (1 in this run, 1 before it); interrupted: grpo-none-s0. Rerun"), line
