"""The data an ablation's SLURM jobs leave on the shared filesystem, read by `--status` and a rerun as data
only: SLURM job ids (`check_job_id`) and each job's exit record, a small JSON file the job writes itself
(`write_exit_record`, temp then rename) and the submitting side reads with every type checked
(`read_exit_record`).

An ablation directory is data: it is shared on clusters and copied between people. Nothing in it is ever
unpickled by the submitting side (submitit's own `*_result.pkl` files are left unread); the job ids of
`jobs.json` are checked as SLURM ids before they name a path.

    {out_dir}/slurm/results/<job id>_<task>.json
        {"job_id": "4711_3", "task": 0, "exit_code": 0}                       # the run's command returned
        {"job_id": "4711_3", "task": 0, "exit_code": null, "error": "..."}    # the job raised (last line)
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from moe_gspo.files import atomic_write_text

JOB_ID_RE = re.compile(r"^[0-9]{1,20}(?:_[0-9]{1,10})?$")
"""A SLURM job id: digits, with an optional job array suffix `_N`."""
_MAX_RECORD_BYTES = 65536
_MAX_ERROR_CHARS = 300
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _printable(text: str, limit: int = _MAX_ERROR_CHARS) -> str:
    """`text` cut to `limit` characters, its control characters (a terminal's escape sequences) shown as '?'."""
    return _CONTROL_RE.sub("?", text[:limit])


def is_job_id(value: object) -> bool:
    return isinstance(value, str) and JOB_ID_RE.match(value) is not None


def check_job_id(value: object, where: str) -> str:
    """`value` when it is a SLURM job id; else a ValueError naming `where`."""
    if not is_job_id(value):
        raise ValueError(f"{where}: job_id {repr(value)[:60]} is not a SLURM job id (digits with an optional array suffix "
                         "_N, e.g. 4711 or 4711_3)")
    return value  # type: ignore[return-value]


def exit_record_path(results_dir: Path, job_id: str, task: int) -> Path:
    return Path(results_dir) / f"{check_job_id(job_id, 'exit record')}_{int(task)}.json"


def write_exit_record(results_dir: Path, job_id: str, task: int, exit_code: int | None, error: str = "") -> Path:
    """The job's own record of how it ended (temp then rename, so a reader never sees half of it)."""
    record: dict[str, object] = {"job_id": job_id, "task": int(task),
                                 "exit_code": None if exit_code is None else int(exit_code)}
    if exit_code is None:
        lines = [l.strip() for l in str(error).splitlines() if l.strip()]
        record["error"] = (lines[-1] if lines else "an error")[:_MAX_ERROR_CHARS]
    path = exit_record_path(results_dir, job_id, task)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(record) + "\n")
    return path


def read_exit_record(path: Path, job_id: str, task: int) -> tuple[int | None, str] | None:
    """None when `path` does not exist; (exit code, "") for a run's command that returned; (None, why) when the
    job raised or the record is damaged (not JSON, wrong shape or types, another job's record)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_RECORD_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as e:
        return None, f"unreadable exit record {path}: {e.strerror or e}"
    problem = _problem(raw, job_id, task)
    if problem:
        return None, f"damaged exit record {path}: {problem}"
    record = json.loads(raw)
    if record["exit_code"] is None:
        return None, f"raised {_printable(record['error'])}"
    return record["exit_code"], ""


def _problem(raw: bytes, job_id: str, task: int) -> str:
    if len(raw) > _MAX_RECORD_BYTES:
        return f"larger than {_MAX_RECORD_BYTES} bytes"
    try:
        record = json.loads(raw)
    except ValueError as e:  # UnicodeDecodeError included
        return f"not JSON ({e})"
    if not isinstance(record, dict):
        return f"not a JSON object (a {type(record).__name__})"
    extra = sorted(set(record) - {"job_id", "task", "exit_code", "error"})
    if extra or not {"job_id", "task", "exit_code"} <= set(record):
        return "expected the keys job_id, task, exit_code (and error)"
    if record["job_id"] != job_id or type(record["task"]) is not int or record["task"] != task:
        return (f"it is the record of job {_printable(repr(record['job_id']), 40)} task "
                f"{_printable(repr(record['task']), 20)}, not {job_id!r} task {task}")
    code = record["exit_code"]
    if code is None:
        if not isinstance(record.get("error"), str):
            return "exit_code null without an error text"
    elif type(code) is not int or not -255 <= code <= 255:
        return f"exit_code {_printable(repr(code), 40)} is not an exit code"
    return ""
