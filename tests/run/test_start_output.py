"""Issue 43.13: a fresh run prints one line summing up its config (the whole config goes to
RUN_DIR/config.yaml), and with logging.progress=false one plain line every logging.progress_every steps."""

from __future__ import annotations

from pathlib import Path

import yaml

from moe_gspo import train

ROOT = Path(__file__).resolve().parents[2]


def test_one_line_config_summary_and_plain_progress_lines(tmp_path, capsys):
    run_dir = tmp_path / "run"
    rc = train.main(["--config", str(ROOT / "configs/tiny_cpu_copy_first.yaml"), "--run-dir", str(run_dir),
                     "train.steps=3", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "eval.every=0",
                     "parallel.expert_parallel_size=1", "logging.progress=false", "logging.progress_every=2",
                     "logging.wandb_mode=disabled", "train.export_hf=false", "logging.trace_every=0",
                     "logging.samples_every=0"])
    assert rc == 0
    out = capsys.readouterr().out.splitlines()
    summary = [l for l in out if l.endswith(f"config: {run_dir / 'config.yaml'}")]
    assert len(summary) == 1 and "3 steps of 2 prompts x 2 samples" in summary[0]
    assert not any(l.startswith("algo:") or l.startswith("  router_margin_threshold") for l in out)  # no YAML dump
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["train"]["steps"] == 3
    steps = [l.split(":")[0] for l in out if l.startswith("step ")]
    assert steps == ["step 2/3", "step 3/3"]
