"""The runs of a comparison, grouped into arms (`python -m analysis.compare`, `moe_gspo.ablate`'s report).

`arm_runs_from_dirs` groups run directories named `<arm>-s<seed>` by `<arm>` (as `moe_gspo.ablate` names them;
any other directory is an arm of one seed); `check_run_dirs` refuses, before anything is read, a directory that
does not exist or is given twice (issue 49: the same directory twice counted as two seeds, with confidence
intervals over them; a missing one gave exit 0 and an all-n/a arm, mentioned only deep in report.md).
`load_arms` reads every run leniently: a run without usable metrics is left out with a note in the report and a
`RunDataWarning` (the command line prints it), never silently.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from pathlib import Path

from analysis.load import ReportInputError, RunData, RunDataWarning, load_run


@dataclass
class ArmRun:
    """One run of the matrix: which arm it belongs to, its seed and directory."""

    arm: str
    seed: int
    run_dir: Path


@dataclass
class Arms:
    """Loaded runs per arm, in the order the arms were first given."""

    runs: dict[str, list[tuple[int, RunData]]]
    expected: dict[str, int]
    """Number of seeds each arm was meant to have (including runs that could not be read)."""
    notes: list[str]


def check_arm_runs(arm_runs: list[ArmRun]) -> None:
    """ReportInputError when one directory is given twice, or two directories are the same arm and seed (each
    would count as a seed of its own)."""
    seen_dirs: dict[Path, Path] = {}
    seen_seeds: dict[tuple[str, int], Path] = {}
    for ar in arm_runs:
        where = Path(ar.run_dir).resolve()
        if where in seen_dirs:
            raise ReportInputError(f"run directory {str(ar.run_dir)!r} is given twice (as {str(seen_dirs[where])!r} "
                                   "too): it would count as two seeds; give each run once")
        seen_dirs[where] = Path(ar.run_dir)
        first = seen_seeds.setdefault((ar.arm, ar.seed), Path(ar.run_dir))
        if first != Path(ar.run_dir):
            raise ReportInputError(f"{str(first)!r} and {str(ar.run_dir)!r} are both arm {ar.arm} seed {ar.seed}: one "
                                   "arm cannot have a seed twice; compare them as arms of their own (rename one)")


def load_arms(arm_runs: list[ArmRun]) -> Arms:
    """Read every run leniently; runs without usable metrics are noted, warned about and left out."""
    check_arm_runs(arm_runs)
    runs: dict[str, list[tuple[int, RunData]]] = {}
    expected: dict[str, int] = {}
    notes: list[str] = []

    def left_out(text: str) -> None:
        notes.append(text)
        warnings.warn(text, RunDataWarning, stacklevel=3)

    for ar in arm_runs:
        expected[ar.arm] = expected.get(ar.arm, 0) + 1
        runs.setdefault(ar.arm, [])
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RunDataWarning)
                run = load_run(ar.run_dir)
        except ReportInputError as e:
            left_out(f"{ar.arm} seed {ar.seed}: left out ({e})")
            continue
        notes += [f"{ar.arm} seed {ar.seed}: {w}" for w in run.warnings]
        if not run.records:
            left_out(f"{ar.arm} seed {ar.seed}: left out (no metric records in {ar.run_dir})")
            continue
        if run.done is None:
            notes.append(f"{ar.arm} seed {ar.seed}: unfinished (no done.json); included as far as it got")
        runs[ar.arm].append((ar.seed, run))
    return Arms(runs, expected, notes)


_SEED_RE = re.compile(r"^(?P<arm>.+)-s(?P<seed>\d+)$")


def arm_runs_from_dirs(run_dirs: list[str | Path]) -> list[ArmRun]:
    """Group directories named `<arm>-s<seed>` by arm; other names become one-seed arms."""
    out = []
    for d in map(Path, run_dirs):
        m = _SEED_RE.match(d.name)
        out.append(ArmRun(m["arm"], int(m["seed"]), d) if m else ArmRun(d.name, 0, d))
    return out


def check_run_dirs(run_dirs: list[str | Path]) -> None:
    """The command line's RUN_DIRs: ReportInputError naming one that is not a directory (or given twice)."""
    missing = [str(d) for d in run_dirs if not Path(d).is_dir()]
    if missing:
        raise ReportInputError(f"run director{'ies' if len(missing) > 1 else 'y'} {', '.join(map(repr, missing))} "
                               f"{'do' if len(missing) > 1 else 'does'} not exist; give training run directories "
                               "(each holds metrics.jsonl)")
    check_arm_runs(arm_runs_from_dirs(run_dirs))
