"""Start-up cost of a 1-step default run, this checkout against another revision, alternating (issue 62).

`python -m benchmarks.startup_bench [--against REV] [--rounds N] [--forms launch2,arm1]`

Runs the main job for one RL step (`train.steps=1`, everything else the default config's: W&B offline,
the HF export, a checkpoint), from start to exit, in two forms:

- `launch2`: `python -m moe_gspo.launch --standalone --nproc-per-node 2 -m moe_gspo.train
  --config configs/tiny_cpu.yaml --run-dir R train.steps=1` (the default command);
- `arm1`: the same with `--nproc-per-node 1`, as a phase-matrix arm runs it (`moe_gspo.ablate`,
  `parallel_arms: 2` on 2 cores).

Both with OMP_NUM_THREADS=1 (what torchrun and the matrix runner give each process on 2 cores). REV is
checked out read-only in a temporary `git worktree` and run with PYTHONPATH set to it; each round runs
every form once from each side, the side that goes first alternating between rounds, so that drift of a
shared machine falls on both. Per side and form it prints the median wall time, the median CPU time
(user + system of the launcher and every process it waited for: the workers, W&B's service) and the
modules imported over all processes (one extra untimed run with PYTHONPROFILEIMPORTTIME=1, counting its
`import time:` lines). Figures on a loaded machine: compare the CPU times, and say "contended".
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORMS = {"launch2": 2, "arm1": 1}
"""Form name -> processes (`--nproc-per-node`)."""


@dataclass(frozen=True, kw_only=True)
class Sample:
    """One run: wall seconds, CPU seconds (user + system, with the processes it waited for), exit code."""
    wall_s: float
    cpu_s: float
    returncode: int


def command(nproc: int, run_dir: Path) -> list[str]:
    """The 1-step default run (module docstring)."""
    return [sys.executable, "-m", "moe_gspo.launch", "--standalone", "--nproc-per-node", str(nproc), "-m",
            "moe_gspo.train", "--config", "configs/tiny_cpu.yaml", "--run-dir", str(run_dir), "train.steps=1"]


def side_env(src: Path, *, import_time: bool = False) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPROFILEIMPORTTIME"}
    env.update(PYTHONPATH=str(src), OMP_NUM_THREADS="1", WANDB_SILENT="true")
    if import_time:
        env["PYTHONPROFILEIMPORTTIME"] = "1"
    return env


def run_once(src: Path, nproc: int, tmp: Path, *, import_time: bool = False) -> tuple[Sample, str]:
    """Run the command from checkout `src` (its directory and PYTHONPATH); (the sample, its stderr)."""
    run_dir = Path(tempfile.mkdtemp(prefix="run_", dir=tmp))
    shutil.rmtree(run_dir)
    t0 = time.monotonic()
    p = subprocess.Popen(command(nproc, run_dir), cwd=src, env=side_env(src, import_time=import_time),
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    err = p.stderr.read()
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.monotonic() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    ok = p.returncode == 0 and (run_dir / "done.json").is_file()
    shutil.rmtree(run_dir, ignore_errors=True)
    return Sample(wall_s=wall, cpu_s=usage.ru_utime + usage.ru_stime, returncode=0 if ok else (p.returncode or 1)), err


def count_imports(stderr: str) -> int:
    """Modules imported over all processes: `PYTHONPROFILEIMPORTTIME` lines, less each process's header."""
    return sum(1 for line in stderr.splitlines() if line.startswith("import time:") and "self [us]" not in line)


def order(round_index: int, sides: list[str]) -> list[str]:
    """The sides of round `round_index` (0-based), the first alternating."""
    return sides if round_index % 2 == 0 else sides[::-1]


def summarize(samples: list[Sample]) -> tuple[float, float]:
    """(median wall, median CPU) of successful samples."""
    ok = [s for s in samples if s.returncode == 0]
    return statistics.median(s.wall_s for s in ok), statistics.median(s.cpu_s for s in ok)


def parse_forms(text: str) -> list[str]:
    forms = [f.strip() for f in text.split(",") if f.strip()]
    bad = [f for f in forms if f not in FORMS]
    if bad or not forms:
        raise ValueError(f"--forms {text!r}: choose from {', '.join(FORMS)} (comma-separated)")
    return forms


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.startup_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--against", metavar="REV", default=None, help="a revision to compare with (default: none, "
                   "this checkout alone)")
    p.add_argument("--rounds", type=int, default=3, help="timed runs per side and form (default 3)")
    p.add_argument("--forms", default="launch2,arm1", help="forms to run: launch2, arm1 (default both)")
    args = p.parse_args(argv)
    try:
        forms = parse_forms(args.forms)
    except ValueError as e:
        p.error(str(e))
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    with tempfile.TemporaryDirectory(prefix="startup_bench_") as tmp_name:
        tmp = Path(tmp_name)
        sides = {"this checkout": ROOT}
        if args.against is not None:
            tree = tmp / "ref_tree"
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(tree), args.against],
                           check=True)
            sides = {args.against: tree, "this checkout": ROOT}
        try:
            return _bench(sides, forms, args.rounds, tmp)
        finally:
            if args.against is not None:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tmp / "ref_tree")],
                               check=False)


def _bench(sides: dict[str, Path], forms: list[str], rounds: int, tmp: Path) -> int:
    samples: dict[tuple[str, str], list[Sample]] = {(f, s): [] for f in forms for s in sides}
    modules: dict[tuple[str, str], int] = {}
    for form in forms:
        for side, src in sides.items():
            sample, err = run_once(src, FORMS[form], tmp, import_time=True)
            modules[form, side] = count_imports(err) if sample.returncode == 0 else -1
    for r in range(rounds):
        for form in forms:
            for side in order(r, list(sides)):
                sample, err = run_once(sides[side], FORMS[form], tmp)
                samples[form, side].append(sample)
                print(f"round {r + 1} {form:8s} {side}: wall {sample.wall_s:.2f} s, CPU {sample.cpu_s:.2f} s"
                      + ("" if sample.returncode == 0 else f", FAILED (exit {sample.returncode}): {err[-500:]}"),
                      flush=True)
    print(f"\n{'form':8s}  {'side':24s}  {'median wall s':>13s}  {'median CPU s':>12s}  {'modules':>7s}  runs")
    failed = 0
    for form in forms:
        for side in sides:
            got = samples[form, side]
            ok = [s for s in got if s.returncode == 0]
            failed += len(got) - len(ok)
            wall, cpu = summarize(got) if ok else (float("nan"), float("nan"))
            print(f"{form:8s}  {side:24s}  {wall:13.2f}  {cpu:12.2f}  {modules[form, side]:7d}  {len(ok)}/{len(got)}")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"(load average now {load:.1f} on {os.cpu_count()} cores; on a loaded machine compare CPU, not wall)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
