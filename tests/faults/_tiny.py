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


def row_differences(got: list[dict], want: list[dict], rel: float = 1e-6, abs_: float = 1e-6) -> list[str]:
    """Where two runs' steady rows differ beyond float tolerance: `step key: got != want`, one per number.

    For rows written by two processes: their thread counts, hence their reduction orders, may differ (the rule
    of tests/conftest.py: bitwise only for the same kernel twice), so numbers agree to `rel`/`abs_`, not bit for
    bit; everything else (keys, counts, strings, None) must be equal."""
    out: list[str] = []

    def walk(where: str, a, b) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            if a.keys() != b.keys():
                out.append(f"{where} keys: {sorted(a.keys() ^ b.keys())}")
            for k in a.keys() & b.keys():
                walk(f"{where} {k}", a[k], b[k])
        elif isinstance(a, list) and isinstance(b, list):
            if len(a) != len(b):
                out.append(f"{where}: length {len(a)} != {len(b)}")
            for i, (x, y) in enumerate(zip(a, b)):
                walk(f"{where}[{i}]", x, y)
        elif isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) \
                and not isinstance(b, bool):
            if abs(a - b) > abs_ + rel * abs(b):
                out.append(f"{where}: {a!r} != {b!r}")
        elif a != b:
            out.append(f"{where}: {a!r} != {b!r}")

    if len(got) != len(want):
        out.append(f"{len(got)} rows != {len(want)}")
    for g, w in zip(got, want):
        walk(f"step {w.get('step')}", steady(g), steady(w))
    return out
