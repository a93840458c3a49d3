"""`--resume` and the rows already written: nothing lost (issue 49).

Before a checkpoint is chosen, `scan_rows` reads RUN_DIR/metrics.jsonl: an intact row is a line holding a JSON
object with an integer `step`; any other non-blank line is damaged (a cut-off write, a disk error, an edit). The
first missing step is the smallest step >= 0 without an intact row. A checkpoint at step c (the next step to
run) needs rows 0 .. c-1, so `--resume` continues from the newest checkpoint at or before the first missing step
(`moe_gspo.run.checkpoint.resume(max_step=...)`), or from the initial policy when none is that old: the rows from
there on are produced again, bit for bit as an uninterrupted run writes them (resume is exact). It says so in
one line.

Damaged lines of metrics.jsonl, eval.jsonl and samples.jsonl are never deleted: once a checkpoint has loaded,
`keep_damaged` appends them to a sidecar file beside their file (`metrics.jsonl.damaged`, ...; appended, never
overwritten), each line as it was, and only then removes them from the file (atomically), before the sink drops
the rows of the steps to be produced again (`moe_gspo.run.sinks.truncate_metrics`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from moe_gspo.files import atomic_write_text, writing

ROW_FILES = ("metrics.jsonl", "eval.jsonl", "samples.jsonl")
SIDECAR_SUFFIX = ".damaged"


@dataclass(kw_only=True)
class RowScan:
    """What `scan_rows` found in one JSONL file of a run."""

    path: Path
    steps: set[int] = field(default_factory=set)
    """The steps of its intact rows."""
    damaged: list[int] = field(default_factory=list)
    """1-based numbers of its damaged lines."""

    @property
    def first_missing(self) -> int:
        """The smallest step >= 0 without an intact row."""
        k = 0
        while k in self.steps:
            k += 1
        return k


def _intact_step(line: bytes) -> int | None:
    try:
        rec = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return None
    step = rec.get("step") if isinstance(rec, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None


def scan_rows(path: Path) -> RowScan:
    """The intact rows' steps and the damaged lines of JSONL file `path` (none when it does not exist)."""
    scan = RowScan(path=path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return scan
    for lineno, line in enumerate(data.split(b"\n"), 1):
        if not line.strip():
            continue
        step = _intact_step(line)
        if step is None:
            scan.damaged.append(lineno)
        else:
            scan.steps.add(step)
    return scan


def _lines(numbers: list[int]) -> str:
    shown = ", ".join(map(str, numbers[:5])) + (f" and {len(numbers) - 5} more" if len(numbers) > 5 else "")
    return f"line{'s' if len(numbers) > 1 else ''} {shown}"


def resume_note(scan: RowScan, *, newest: int | None, resumed: int | None) -> str | None:
    """The one line `--resume` prints about metrics.jsonl, or None when it is intact up to the checkpoint.
    `newest`: the step of the newest checkpoint (None: none); `resumed`: the step resumed from (0 = the
    initial policy)."""
    missing = scan.first_missing
    gap = newest is not None and missing < newest
    if not gap and not scan.damaged:
        return None
    kept = f"kept in {scan.path.name}{SIDECAR_SUFFIX}"
    damaged = f"{scan.path.name} {_lines(scan.damaged)} damaged ({kept})" if scan.damaged else ""
    if not gap:
        return f"--resume: {damaged}; the rows before step {resumed} are intact"
    where = (f"checkpoint step_{resumed:06d}" if resumed else
             "the initial policy (no checkpoint is that old)")
    why = f"{scan.path.name} has no intact row of step {missing}" + (f" ({damaged})" if damaged else "")
    return (f"--resume: {why}; resuming from {where} instead of step_{newest:06d}, so that its rows from step "
            f"{resumed} on are produced again")


def keep_damaged(run_dir: Path) -> list[Path]:
    """Move the damaged lines of RUN_DIR's row files into their sidecars (appended and fsynced first, then
    the file rewritten without them, atomically); returns the sidecars written to. Rank 0, after the
    checkpoint has loaded."""
    written = []
    for name in ROW_FILES:
        path = run_dir / name
        scan = scan_rows(path)
        if not scan.damaged:
            continue
        lines = path.read_bytes().split(b"\n")
        bad = set(scan.damaged)
        sidecar = path.with_name(path.name + SIDECAR_SUFFIX)
        with writing(sidecar, "damaged rows"):
            fd = os.open(sidecar, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                data = b"".join(lines[i - 1] + b"\n" for i in scan.damaged)
                while data:
                    data = data[os.write(fd, data):]
                os.fsync(fd)
            finally:
                os.close(fd)
        kept = b"".join(l + b"\n" for i, l in enumerate(lines, 1) if i not in bad and l.strip())
        atomic_write_text(path, kept.decode("utf-8"))
        written.append(sidecar)
    return written
