"""An ablation matrix's runs as a report page reads them (`analysis.claims`, `analysis.phase`,
`analysis.staleness`): the finished runs of its output directory, or the metrics a page saved to regenerate itself
from (`--save-metrics`), the page written to stdout or to a file, and the pages' shared command line and tables."""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import sys
import zlib
from pathlib import Path
from typing import Callable, Iterable

from analysis import stats as st
from analysis.load import MAX_STEP, ReportInputError, RunData, load_run
from moe_gspo.run.ablation_arms import done_problem


def finished_runs(runs_dir: Path, run_re: re.Pattern) -> list[RunData]:
    """The runs of `runs_dir` whose directory name matches `run_re` and that have a valid done.json (as `ablate`
    counts them: `done_problem`); a damaged one is left out with one `warning:` line on stderr naming why."""
    runs = []
    for d in sorted(runs_dir.iterdir()):
        if not run_re.match(d.name) or not (d / "done.json").is_file():
            continue
        if why := done_problem(d):
            print(f"warning: {d.name}: left out, not finished ({why})", file=sys.stderr)
            continue
        runs.append(load_run(d))
    return runs


def load_matrix_runs(source: str | Path, run_re: re.Pattern, *, matrix: str, names: str) -> list[RunData]:
    """The finished runs of a matrix directory, or those `save_records` wrote to a file. `matrix` and `names` word
    the errors: what the directory is ("the matrix's out_dir") and the run names expected."""
    source = Path(source)
    if not source.exists():
        raise ReportInputError(f"{str(source)!r} does not exist; pass {matrix} or a .jsonl.gz file "
                               "written by --save-metrics")
    runs = finished_runs(source, run_re) if source.is_dir() else load_saved_records(source)
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


MAX_SAVED_BYTES = 512 * 2**20
"""Decompressed size at which `load_saved_records` stops reading a saved-metrics file (512 MiB, ~25x experiment 3's
169 runs): a gzip bomb fails after reading this much, never decompressed in full."""
MAX_SAVED_LINE_BYTES = 64 * 2**20
"""The longest line (one run) a saved-metrics file may hold (64 MiB, ~600x experiment 3's mean run): a bomb of one
endless line fails there, holding no more than this in memory."""
_CHUNK = 64 * 2**10
_NONBLANK_LINE = re.compile(rb"[^\n]*\S[^\n]*")


def load_saved_records(path: str | Path, *, max_bytes: int | None = None,
                       max_line_bytes: int | None = None) -> list[RunData]:
    """The runs `save_records` wrote (no traces). A file that is not one (not gzip, cut short, corrupt, a line that
    is not `{"run": <name>, "records": [{"step": <int>, <key>: <number, null or list of them>, ...}, ...]}`, a run
    twice, more than `max_bytes` (default `MAX_SAVED_BYTES`) decompressed or a line over `max_line_bytes` (default
    `MAX_SAVED_LINE_BYTES`)) is a `ReportInputError` naming the file, and the line where it applies. Read in 64 KiB
    blocks: at most `max_bytes` + 64 KiB is decompressed, blank lines are skipped at C speed."""
    path = Path(path)
    max_bytes = MAX_SAVED_BYTES if max_bytes is None else max_bytes
    max_line = MAX_SAVED_LINE_BYTES if max_line_bytes is None else max_line_bytes
    runs: list[RunData] = []
    seen: dict[str, int] = {}
    total, lineno = 0, 0  # decompressed bytes read; lines completed
    buf = bytearray()  # the line in progress

    def complete_lines(block: bytes) -> None:
        nonlocal lineno
        if not block.strip():  # blank lines only (a bomb of newlines): counted at C speed
            lineno += block.count(b"\n")
            return
        prev = 0
        for m in _NONBLANK_LINE.finditer(block):
            lineno += block.count(b"\n", prev, m.start())
            prev = m.start()
            if m.end() - m.start() > max_line:
                raise ReportInputError(f"{str(path)!r} line {lineno + 1} is longer than {max_line} bytes; not "
                                       "metrics saved by --save-metrics (a gzip bomb?)")
            run = _saved_run(m.group(), path, lineno + 1)
            if run.source.name in seen:
                raise ReportInputError(f"{str(path)!r} line {lineno + 1}: run {run.source.name!r} is also on line "
                                       f"{seen[run.source.name]}")
            seen[run.source.name] = lineno + 1
            runs.append(run)
        lineno += block.count(b"\n", prev)

    try:
        with gzip.open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                total += len(chunk)
                if total > max_bytes:
                    raise ReportInputError(f"{str(path)!r} decompresses to more than {max_bytes} bytes (stopped at "
                                           f"line {lineno + 1}); not metrics saved by --save-metrics (a gzip bomb?)")
                buf += chunk
                last = chunk.rfind(b"\n")  # in the new block only: a long line is not scanned again per block
                if last >= 0:
                    cut = len(buf) - len(chunk) + last + 1
                    complete_lines(bytes(buf[:cut]))
                    del buf[:cut]
                if len(buf) > max_line:
                    raise ReportInputError(f"{str(path)!r} line {lineno + 1} is longer than {max_line} bytes; not "
                                           "metrics saved by --save-metrics (a gzip bomb?)")
        complete_lines(bytes(buf))
    except (OSError, EOFError, zlib.error) as e:  # BadGzipFile is an OSError; a cut stream is an EOFError
        if isinstance(e, OSError) and not isinstance(e, gzip.BadGzipFile) and e.filename is not None:
            raise ReportInputError(f"cannot read {str(path)!r}: {e.strerror or e}") from None
        where = f" after line {lineno}" if lineno else ""
        raise ReportInputError(f"{str(path)!r} is not a complete gzip file{where} ({type(e).__name__}: {e}); pass a "
                               "metrics file written by --save-metrics, whole") from None
    return runs


def _saved_run(raw: bytes, path: Path, lineno: int) -> RunData:
    """One line of a saved-metrics file as a run, or a `ReportInputError` naming the file, the line and what is
    wrong."""
    where = f"{str(path)!r} line {lineno}"
    try:
        row = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ReportInputError(f"{where}: not UTF-8 text; not metrics saved by --save-metrics") from None
    except json.JSONDecodeError as e:
        raise ReportInputError(f"{where}: not valid JSON ({e.msg}, column {e.colno})") from None
    except RecursionError:
        raise ReportInputError(f"{where}: JSON nested too deep") from None
    if not isinstance(row, dict) or not isinstance(row.get("run"), str) or not isinstance(row.get("records"), list):
        raise ReportInputError(f'{where}: expected {{"run": <run name>, "records": [<metrics rows>]}}, got '
                               f"{_shape(row)}")
    name = row["run"]
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\x00" in name:
        raise ReportInputError(f"{where}: 'run' must be a run directory's name, got {name[:80]!r}")
    for i, rec in enumerate(row["records"]):
        if not isinstance(rec, dict):
            raise ReportInputError(f"{where}: run {name!r} record {i} is {_shape(rec)}, expected a JSON object")
        step = rec.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or abs(step) > MAX_STEP:
            raise ReportInputError(f"{where}: run {name!r} record {i}: 'step' is {_shape(step)}, expected an integer")
        for key, value in rec.items():
            if not _is_metric(value):
                raise ReportInputError(f"{where}: run {name!r} step {step}: {key[:80]!r} is {_shape(value)}, "
                                       "expected a number, null or a list of them")
    return RunData(source=Path(name), records=row["records"], traces={})


def _is_metric(value, depth: int = 0) -> bool:
    """A number, null, or a (nested, at most 4 deep) list of them: what `save_records` writes."""
    if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
        return True
    return isinstance(value, list) and depth < 4 and all(_is_metric(v, depth + 1) for v in value)


def _shape(value) -> str:
    """What a JSON value is, for an error line: 'a list', 'a string ("abc")', 'null or missing'."""
    if value is None:
        return "null or missing"
    kinds = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", float: "a fraction",
             int: "a number"}
    kind = next((k for t, k in kinds.items() if isinstance(value, t)), type(value).__name__)
    return f"{kind} ({json.dumps(value)[:40]})" if isinstance(value, (str, int, float)) else kind


def emit_page(text: str, out: str | None) -> int:
    """Print the page, or write it to `out` (its folder made; temp file, then rename) and print the path; 0. A
    failed write (a read-only or full filesystem, a path under a file) is a one-line `ReportInputError` naming
    `--out` (`analysis.outputs`)."""
    if out is None:
        print(text)
        return 0
    from analysis.outputs import writing_output
    from moe_gspo.files import atomic_write_text

    path = Path(out)
    with writing_output("--out", path):
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, text)
    print(out, file=sys.stdout)
    return 0


# --------------------------------------------------------------------------- the pages' shared parts

def md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A Markdown table's lines, then a blank line."""
    return (["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            + ["| " + " | ".join(r) + " |" for r in rows] + [""])


def tests_table(tests, empty: str) -> list[str]:
    """The Holm family's table (`analysis.claims_stats.ClaimTest`s), or `empty` when there is no test."""
    if not tests:
        return [empty, ""]
    return md_table(["test", "statistic", "estimate", "p", "Holm-adjusted p", "verdict"],
                    [[t.label, t.test, t.estimate, st.fmt_p(t.p), st.fmt_p(t.p_holm), t.verdict] for t in tests])


def page_parser(prog: str, description: str, *, matrix: str, figure: str) -> argparse.ArgumentParser:
    """The command line of a matrix page: RUNS_DIR|METRICS.jsonl.gz [--out] [--figures] [--save-metrics]
    [--bootstrap-reps] [--seed]; `matrix` names the directory, `figure` what --figures draws."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("runs_dir", help=f"{matrix}, or a .jsonl.gz written by --save-metrics")
    p.add_argument("--out", default=None, help="write the Markdown here (temp file, then rename); else stdout")
    p.add_argument("--figures", default=None, metavar="DIR", help=f"write {figure} (PNG) here")
    p.add_argument("--save-metrics", default=None, metavar="FILE.jsonl.gz",
                   help="also save the metrics the page reads, per finished run (to regenerate the page)")
    p.add_argument("--bootstrap-reps", type=int, default=2000, help="bootstrap resamples per CI (default 2000)")
    p.add_argument("--seed", type=int, default=0, help="base seed of the bootstrap streams (default 0)")
    return p


def run_page(p: argparse.ArgumentParser, argv: list[str] | None, *, load_raw: Callable, parse: Callable,
             page: Callable, save: Callable, figures: Callable,
             page_options: Callable[[argparse.Namespace], dict] | None = None) -> int:
    """Parse `argv` with `p` and make the page: `load_raw(source)` -> runs, `parse(runs)` -> the page's runs,
    `page(runs, reps=, seed=, **page_options(args))` -> text (`page_options` maps a page's own flags to keyword
    arguments); then `save(raw, path)` (--save-metrics) and `figures(runs, dir, reps=, seed=)` (--figures), so that
    nothing is written when the input cannot make a page; a bad input is one line on stderr and exit 2."""
    from analysis.outputs import check_outputs, read_error_message, writing_output

    args = p.parse_args(argv)
    if args.bootstrap_reps < 100:
        p.error(f"--bootstrap-reps={args.bootstrap_reps}: use at least 100")
    extra = page_options(args) if page_options is not None else {}
    try:
        check_outputs(dirs={"--figures": args.figures}, files={"--out": args.out, "--save-metrics": args.save_metrics})
        try:
            raw = load_raw(args.runs_dir)
        except OSError as e:  # a run directory's file that cannot be read
            raise ReportInputError(read_error_message(e, "an input file")) from None
        runs = parse(raw)
        text = page(runs, reps=args.bootstrap_reps, seed=args.seed, **extra)
        if args.save_metrics:
            with writing_output("--save-metrics", args.save_metrics):
                save(raw, args.save_metrics)
        if args.figures:
            with writing_output("--figures", args.figures):
                figures(runs, args.figures, reps=args.bootstrap_reps, seed=args.seed)
        return emit_page(text if args.out is None else text + "\n", args.out)
    except ReportInputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
