"""Where the analysis tools (`analysis.report`, `compare`, `phase`, `staleness`, `claims`) write, and a bad disk as
one line: the output paths are checked before any compute (`moe_gspo.files.check_output_dir` / `check_output_file`,
as training checks its own), and a write that fails all the same (a read-only or full filesystem, a path through a
regular file) becomes a `ReportInputError` naming the flag and the file, which the tools print as one `error:` line
and exit 2. Every file is written to a temporary sibling, then renamed (`moe_gspo.files.atomic_write_text`,
`analysis.report.write_atomic`, `analysis.figure_kit.save_png`, `analysis.matrix_runs.save_records`), so a failed
write leaves no half-written file behind."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Mapping

from analysis.load import ReportInputError
from moe_gspo.files import check_output_dir, check_output_file, disk_full_message, is_disk_full


_EXAMPLE_FILE = {"--out": "page.md", "--save-metrics": "metrics.jsonl.gz"}


def check_outputs(*, dirs: Mapping[str, str | os.PathLike | None] | None = None,
                  files: Mapping[str, str | os.PathLike | None] | None = None) -> None:
    """`ReportInputError` naming the flag when a given output directory (`{flag: path}`) or file cannot be written:
    an existing regular file where a directory is expected (or the reverse), a path under a file, a read-only or
    unwritable directory. None entries (a flag not given) are skipped."""
    try:
        for flag, path in (dirs or {}).items():
            if path is not None:
                check_output_dir(path, flag)
        for flag, path in (files or {}).items():
            if path is not None and Path(path).is_dir():  # (moe_gspo.files' message suggests the probe's drift.json)
                example = Path(path) / _EXAMPLE_FILE.get(flag, "out")
                raise ValueError(f"{flag}={str(path)!r} is a directory; give a file path such as {str(example)!r}")
            if path is not None:
                check_output_file(path, flag)
    except ValueError as e:
        raise ReportInputError(str(e)) from None


def write_error_message(exc: BaseException, flag: str, path: str | os.PathLike) -> str | None:
    """The one line for a write to `path` (given as `flag`) that failed with `exc`; None when `exc` is no disk or
    path error (a bug keeps its traceback)."""
    if is_disk_full(exc):
        if isinstance(exc, ValueError):  # moe_gspo.files.writing's own line
            return f"{flag}: {exc}"
        return f"{flag}: " + disk_full_message(getattr(exc, "filename", None) or path, "file")
    if isinstance(exc, OSError):
        where = exc.filename if exc.filename is not None else path
        why = exc.strerror or str(exc)
        return (f"{flag}={str(path)!r}: cannot write {str(where)!r}: {why}; choose another path, or fix its "
                "filesystem or permissions")
    return None


@contextmanager
def writing_output(flag: str, path: str | os.PathLike) -> Iterator[None]:
    """Turn a failed write under `path` (given as `flag`) into a one-line `ReportInputError` (`write_error_message`)."""
    try:
        yield
    except ReportInputError:
        raise
    except Exception as e:
        msg = write_error_message(e, flag, Path(path))
        if msg is None:
            raise
        raise ReportInputError(msg) from e


def read_error_message(exc: OSError, what: str) -> str:
    """One line for an input that could not be read (permissions, a directory where a file is expected, I/O)."""
    where = f" {str(exc.filename)!r}" if exc.filename is not None else ""
    return f"cannot read {what}{where}: {exc.strerror or exc}"
