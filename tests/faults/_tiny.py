"""The tiny run the fault tests start: `configs/tiny_cpu_copy_first.yaml` cut down to seconds per run, in process
at world size 1 (the real entry point, `moe_gspo.train.main`)."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--config", str(ROOT / "configs/tiny_cpu_copy_first.yaml"), "parallel.expert_parallel_size=1",
        "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=2",
        "train.num_minibatches=2", "logging.wandb_mode=disabled", "logging.progress=false",
        "logging.trace_every=0", "train.export_hf=false", "train.checkpoint_every=1"]


def train(run_dir: Path, *args: str) -> int:
    from moe_gspo import train as train_mod

    return train_mod.main([*TINY, "--run-dir", str(run_dir), *args])


def errors(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


def warnings_of(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("warning:")]


def rows(run_dir: Path, name: str = "metrics.jsonl") -> list[dict]:
    return [json.loads(line) for line in (run_dir / name).read_text().splitlines() if line.strip()]


def steady(row: dict) -> dict:
    """A metrics row without its timings (`perf/*`), which differ between two runs of the same steps."""
    return {k: v for k, v in row.items() if not k.startswith("perf/")}
