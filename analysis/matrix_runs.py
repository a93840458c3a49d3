"""An ablation matrix's runs as a report page reads them (`analysis.claims`, `analysis.phase`): the finished runs
of its output directory, or the metrics a page saved to regenerate itself from (`--save-metrics`), and the page
written to stdout or to a file."""

from __future__ import annotations

import gzip
import json
import os
import re
import sys
from pathlib import Path
from typing import Iterable

from analysis.load import ReportInputError, RunData, load_run


def finished_runs(runs_dir: Path, run_re: re.Pattern) -> list[RunData]:
    """The runs of `runs_dir` whose directory name matches `run_re` and that have a done.json."""
    return [load_run(d) for d in sorted(runs_dir.iterdir()) if run_re.match(d.name) and (d / "done.json").is_file()]


def load_matrix_runs(source: str | Path, run_re: re.Pattern, *, matrix: str, names: str) -> list[RunData]:
    """The finished runs of a matrix directory, or those `save_records` wrote to a file. `matrix` and `names` word
    the errors: what the directory is ("the matrix's out_dir") and the run names expected."""
    source = Path(source)
    if not source.exists():
        raise ReportInputError(f"{str(source)!r} does not exist; pass {matrix} or a .jsonl.gz file "
                               "written by --save-metrics")
    runs = load_saved_records(source) if source.is_file() else finished_runs(source, run_re)
    if not runs:
        raise ReportInputError(f"no finished run named {names} under {source}")
    return runs


def save_records(runs: list[RunData], path: str | Path, keys: Iterable[str]) -> None:
    """One gzip'd JSON line per run, `{"run": <run dir name>, "records": [<its metrics rows, only `keys`>]}`,
    written to this process's own temp file, then renamed (the committed metrics a report page regenerates from):
    a failed or concurrent write never leaves a half-written `path` or another writer's temp file behind."""
    from moe_gspo.files import writing

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    keys = tuple(keys)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with writing(path, "file"):
            with gzip.open(tmp, "wt") as f:
                for run in runs:
                    recs = [{k: r[k] for k in keys if k in r} for r in run.records]
                    f.write(json.dumps({"run": run.source.name, "records": recs}) + "\n")
            os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def load_saved_records(path: str | Path) -> list[RunData]:
    """The runs `save_records` wrote (no traces)."""
    with gzip.open(path, "rt") as f:
        return [RunData(source=Path(row["run"]), records=row["records"], traces={}) for row in map(json.loads, f)]


def emit_page(text: str, out: str | None) -> int:
    """Print the page, or write it to `out` (its folder made; temp file, then rename) and print the path; 0."""
    if out is None:
        print(text)
        return 0
    from moe_gspo.files import atomic_write_text

    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, text)
    print(out, file=sys.stdout)
    return 0
