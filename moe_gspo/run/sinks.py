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
    """Write through a temporary sibling and rename; on any failure (a full disk: a ValueError
    naming `path`) the temporary file is removed and `path` is unchanged."""
    from moe_gspo.run.errors import writing

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with writing(path, "file"):
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


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
        self.path.touch()
        if wandb_mode != "disabled":
            os.environ.setdefault("WANDB_SILENT", "true")
            import wandb

            self._wandb = wandb.init(project=project, name=run_name, dir=str(run_dir), config=config,
                                     mode=wandb_mode, resume="allow", id=run_name.replace("/", "_"))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        from moe_gspo.run.errors import writing

        rec = {"step": step, **{k: _jsonable(v) for k, v in sorted(metrics.items())}}
        data = memoryview((json.dumps(rec) + "\n").encode())
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)  # no descriptor held between steps
        end = os.lseek(fd, 0, os.SEEK_END)
        try:
            with writing(self.path, "metrics"):
                while data:
                    data = data[os.write(fd, data):]
                os.fsync(fd)
        except BaseException:  # no torn line left behind (a full disk, an interrupt)
            try:
                os.ftruncate(fd, end)
            except OSError:
                pass
            raise
        finally:
            os.close(fd)
        if self._wandb is not None:
            scalars = {k: v for k, v in rec.items() if isinstance(v, (int, float)) and k != "step"}
            for k, v in rec.items():  # per-layer lists become layer-indexed scalars
                if isinstance(v, list) and v and isinstance(v[0], (int, float)):
                    scalars.update({f"{k}/{i}": x for i, x in enumerate(v)})
            self._wandb.log(scalars, step=step)

    def close(self) -> None:
        if not self.enabled:
            return
        if self._wandb is not None:
            self._wandb.finish()
