"""Where per-step metrics go: RUN_DIR/metrics.jsonl, wandb (offline by default), the console.

Only rank 0 writes. `metrics.jsonl` holds one JSON object per step, appended and flushed after each
step; on resume, lines of steps at or after the resumed step are dropped first (atomically), so the
file equals that of an uninterrupted run.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any


def _jsonable(v: Any) -> Any:
    if hasattr(v, "tolist"):
        v = v.tolist()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return v


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def truncate_metrics(path: Path, keep_before_step: int) -> None:
    """Drop metrics lines with step >= keep_before_step (and any torn last line)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get("step", -1) < keep_before_step:
            kept.append(line)
    atomic_write_text(path, "".join(l + "\n" for l in kept))


class MetricsSink:
    """Appends metrics to metrics.jsonl and wandb; a no-op on ranks other than 0."""

    def __init__(self, run_dir: Path, *, enabled: bool, wandb_mode: str, project: str, run_name: str,
                 config: dict, start_step: int):
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self._wandb = None
        if not enabled:
            return
        truncate_metrics(self.path, start_step)
        self._file = self.path.open("a", encoding="utf-8")
        if wandb_mode != "disabled":
            os.environ.setdefault("WANDB_SILENT", "true")
            import wandb

            self._wandb = wandb.init(project=project, name=run_name, dir=str(run_dir), config=config,
                                     mode=wandb_mode, resume="allow", id=run_name.replace("/", "_"))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        rec = {"step": step, **{k: _jsonable(v) for k, v in sorted(metrics.items())}}
        self._file.write(json.dumps(rec) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        if self._wandb is not None:
            scalars = {k: v for k, v in rec.items() if isinstance(v, (int, float)) and k != "step"}
            for k, v in rec.items():  # per-layer lists become layer-indexed scalars
                if isinstance(v, list) and v and isinstance(v[0], (int, float)):
                    scalars.update({f"{k}/{i}": x for i, x in enumerate(v)})
            self._wandb.log(scalars, step=step)

    def close(self) -> None:
        if not self.enabled:
            return
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()
