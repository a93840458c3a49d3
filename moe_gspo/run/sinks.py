"""Where per-step metrics go: RUN_DIR/metrics.jsonl, wandb (offline by default), the console.

Only rank 0 writes. `metrics.jsonl` holds one JSON object per step, appended and flushed after each
step (`eval.jsonl` one per evaluation, `samples.jsonl` one per saved sample); on resume, lines of steps
at or after the resumed step are dropped first (atomically), so each file equals that of an
uninterrupted run.

W&B: the run's id is its name plus a digest of its directory (`wandb_run_id`), so that a resumed run continues
its W&B run and two runs of one name (two ablations' `gspo-none-s0`) stay two. Its group, job type and tags are
W&B's own variables (WANDB_RUN_GROUP, WANDB_JOB_TYPE, WANDB_TAGS), which `moe_gspo.ablate` sets per run.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from pathlib import Path
from typing import Any

from moe_gspo.files import atomic_write_text, disk_full_message, is_disk_full
from moe_gspo.run.wandb_shims import skip_unstaged_launch_inputs


def _jsonable(v: Any) -> Any:
    if hasattr(v, "tolist"):
        v = v.tolist()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return v


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


def append_jsonl_line(path: Path, rec: dict[str, Any], what: str) -> None:
    """Append one JSON line and fsync it; on any failure (a full disk, an interrupt) the file is cut
    back to where it was, so no torn line is left behind and every complete row before it is kept (a full
    disk: one ValueError saying so)."""
    data = memoryview((json.dumps({k: _jsonable(v) for k, v in rec.items()}, ensure_ascii=False) + "\n").encode())
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)  # no descriptor held between steps
    end = os.lseek(fd, 0, os.SEEK_END)
    try:
        while data:
            data = data[os.write(fd, data):]
        os.fsync(fd)
    except BaseException as e:
        try:
            os.ftruncate(fd, end)
            outcome = (f"the row was not written: {path.name} was cut back to its last complete row, and every row "
                       "before it is kept")
        except OSError:
            outcome = (f"cutting {path.name} back to its last complete row failed too: its last line may be torn; "
                       f"--resume moves a damaged line to {path.name}.damaged")
        if isinstance(e, Exception) and is_disk_full(e):
            raise ValueError(disk_full_message(path, what, outcome=outcome)) from e
        raise
    finally:
        os.close(fd)


def wandb_run_id(run_dir: Path, run_name: str) -> str:
    """`{run name}-{8 hex of the run directory's absolute path}` (W&B's id characters, at most 64): the same for
    the same directory (a resume continues the W&B run), different for two directories of one run name."""
    digest = hashlib.sha1(str(Path(os.path.abspath(run_dir))).encode()).hexdigest()[:8]
    return f"{re.sub(r'[^A-Za-z0-9_.-]', '_', run_name)[:55]}-{digest}"


class MetricsSink:
    """Rank 0's writer of metrics.jsonl (one row per step), eval.jsonl (one row per evaluation,
    `moe_gspo.run.evaluation`), samples.jsonl (saved samples, `moe_gspo.run.samples`) and wandb. On
    resume every file first loses its rows of steps >= the resumed step (they are produced again)."""

    FILES = ("metrics.jsonl", "eval.jsonl", "samples.jsonl")

    def __init__(self, run_dir: Path, *, enabled: bool, wandb_mode: str, project: str, run_name: str,
                 config: dict, start_step: int):
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self.eval_path, self.samples_path = run_dir / "eval.jsonl", run_dir / "samples.jsonl"
        self._wandb = None
        if not enabled:
            return
        for path in (self.path, self.eval_path, self.samples_path):
            truncate_metrics(path, start_step)
        self.path.touch()
        if wandb_mode != "disabled":
            os.environ.setdefault("WANDB_SILENT", "true")
            import wandb

            skip_unstaged_launch_inputs()
            self._wandb = wandb.init(project=project, name=run_name, dir=str(run_dir), config=config,
                                     mode=wandb_mode, resume="allow", id=wandb_run_id(run_dir, run_name))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        rec = {"step": step, **{k: _jsonable(v) for k, v in sorted(metrics.items())}}
        append_jsonl_line(self.path, rec, "metrics")
        if self._wandb is not None:
            scalars = {k: v for k, v in rec.items() if isinstance(v, (int, float)) and k != "step"}
            for k, v in rec.items():  # per-layer lists become layer-indexed scalars
                if isinstance(v, list) and v and isinstance(v[0], (int, float)):
                    scalars.update({f"{k}/{i}": x for i, x in enumerate(v)})
            self._wandb.log(scalars, step=step)

    def log_eval(self, version: int, metrics: dict[str, Any], *, in_step_row: bool) -> None:
        """An evaluation of the policy after `version` updates; `in_step_row`: its numbers also go into
        step `version`'s metrics row (and so to wandb with it), else to wandb here (the final one)."""
        if not self.enabled:
            return
        append_jsonl_line(self.eval_path, {"step": version, **metrics}, "eval results")
        if self._wandb is not None and not in_step_row:
            self._wandb.log(dict(metrics), step=version)

    def log_samples(self, rows: list[dict[str, Any]]) -> None:
        if not self.enabled:
            return
        for row in rows:
            append_jsonl_line(self.samples_path, row, "samples")

    def close(self) -> None:
        if not self.enabled:
            return
        if self._wandb is not None:
            self._wandb.finish()
