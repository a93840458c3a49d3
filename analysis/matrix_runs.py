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
from pathlib import Path
from typing import Callable, Iterable

from analysis import stats as st
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
    args = p.parse_args(argv)
    if args.bootstrap_reps < 100:
        p.error(f"--bootstrap-reps={args.bootstrap_reps}: use at least 100")
    extra = page_options(args) if page_options is not None else {}
    try:
        raw = load_raw(args.runs_dir)
        runs = parse(raw)
        text = page(runs, reps=args.bootstrap_reps, seed=args.seed, **extra)
        if args.save_metrics:
            save(raw, args.save_metrics)
        if args.figures:
            figures(runs, args.figures, reps=args.bootstrap_reps, seed=args.seed)
    except (ReportInputError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return emit_page(text if args.out is None else text + "\n", args.out)
