"""Seconds per default RL step of a git revision against this checkout, interleaved, with a CI of the ratio.

`python -m benchmarks.step_speed --against REV [--rounds 3] [--steps 20] [--skip 5] [--modes main,arm]
[--threads N] [--override section.key=value ...]`

REV is checked out read-only in a temporary `git worktree` (removed at the end; nothing in this checkout
changes). Every round runs each mode once from REV and once from this checkout, alternating which goes
first (A B, B A, A B, ...), so that the machine's drift falls on both alike:

- `main`: the main job, `python -m moe_gspo.launch --standalone --nproc-per-node 2 -m moe_gspo.train
  --config configs/tiny_cpu.yaml` (two processes);
- `arm`: one process, `python -m moe_gspo.train --config configs/tiny_cpu.yaml`, as a phase-matrix arm runs.

Both with `train.steps=STEPS`, no wandb, no progress bar, no HF export, and the overrides, with each side's
own code (`PYTHONPATH` = its tree). Per run it takes, over the steps after the first `--skip`:

- wall: the median of the run's own `perf/step_time_s` (evaluation, every `eval.every` steps, is outside it);
- cpu: user + system CPU seconds of the whole process tree (launcher and ranks, read from /proc when the
  metrics row of step `skip` and that of the last step appear), per step and per process: the figure to
  compare on a shared box, where wall times follow the neighbours (set `--threads 1` there: with more
  OpenMP threads than free cores, spinning threads add CPU time too); under heavy load (other jobs
  thrashing the caches) it still varies by ~10% run to run;
- faults: minor page faults of the same processes over the same steps, per step and process.

It prints each run, then per mode and measure the median over rounds of each side, the ratio
this checkout / REV (below 1: this checkout is faster) and a 95% bootstrap CI of that ratio (rounds
resampled with replacement on each side, 10,000 times, seeded). Three rounds give a coarse CI; use 5+ on an
idle machine. Linux only (/proc).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.interleave import JsonLinesTail, process_tree

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/tiny_cpu.yaml"
MODES = {"main": 2, "arm": 1}
"""Mode name -> processes: `main` through the launcher, `arm` one plain process."""


def command(mode: str, run_dir: Path, steps: int, overrides: list[str]) -> list[str]:
    """The training command of `mode` (module docstring)."""
    common = ["--config", CONFIG, "--run-dir", str(run_dir), f"train.steps={steps}", "logging.wandb_mode=disabled",
              "logging.progress=false", "train.export_hf=false", *overrides]
    if MODES[mode] == 1:
        return [sys.executable, "-m", "moe_gspo.train", *common]
    return [sys.executable, "-m", "moe_gspo.launch", "--standalone", "--nproc-per-node", str(MODES[mode]),
            "-m", "moe_gspo.train", *common]


def stat_counters(stat_line: str) -> tuple[int, int]:
    """(utime + stime in clock ticks, minor page faults) of one /proc/<pid>/stat line (the command name may
    hold spaces and parentheses: the fields after it start after the last ')')."""
    fields = stat_line[stat_line.rindex(")") + 2:].split()  # fields[0] is proc(5)'s field 3 (state)
    return int(fields[11]) + int(fields[12]), int(fields[7])  # utime 14, stime 15; minflt 10


def tree_counters(pid: int) -> tuple[float, int]:
    """(user + system CPU seconds, minor page faults) so far of `pid` and its living descendants."""
    ticks = faults = 0
    for p in process_tree(pid):
        try:
            t, f = stat_counters(Path(f"/proc/{p}/stat").read_text())
        except (FileNotFoundError, ProcessLookupError, ValueError):
            continue
        ticks, faults = ticks + t, faults + f
    return ticks / os.sysconf("SC_CLK_TCK"), faults


@dataclass(kw_only=True)
class RunTiming:
    wall_s: float
    """Median `perf/step_time_s` of the steps after the skipped ones."""
    cpu_s: float
    """CPU seconds per step and process over the same steps."""
    faults: float = 0.0
    """Minor page faults per step and process over the same steps."""


def timed_run(tree: Path, mode: str, run_dir: Path, *, steps: int, skip: int, overrides: list[str],
              threads: int | None, poll_s: float = 0.02) -> RunTiming:
    """Run `mode` from checkout `tree` to its end; its `RunTiming` (RuntimeError with the log tail if it fails)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    log = run_dir.with_suffix(".log")
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    rows, cpu_at = [], {}
    with open(log, "w") as out:
        proc = subprocess.Popen(command(mode, run_dir, steps, overrides), cwd=tree, env=env, stdout=out,
                                stderr=subprocess.STDOUT)
        tail = JsonLinesTail(run_dir / "metrics.jsonl")
        while True:
            done = proc.poll() is not None
            for row in tail.read():
                rows.append(row)
                if len(rows) in (skip, steps):  # the CPU clock at the end of step `skip` and of the last step
                    cpu_at[len(rows)] = tree_counters(proc.pid)
            if done:
                break
            time.sleep(poll_s)
    if proc.returncode != 0 or len(cpu_at) != 2:
        raise RuntimeError(f"{' '.join(command(mode, run_dir, steps, overrides))} (from {tree}) exited with "
                           f"{proc.returncode} after {len(rows)} metrics rows:\n{log.read_text()[-3000:]}")
    walls = [r["perf/step_time_s"] for r in rows[skip:]]
    per = (steps - skip) * MODES[mode]
    (cpu0, f0), (cpu1, f1) = cpu_at[skip], cpu_at[steps]
    return RunTiming(wall_s=statistics.median(walls), cpu_s=(cpu1 - cpu0) / per, faults=(f1 - f0) / per)


def ratio_ci(ref: list[float], new: list[float], *, resamples: int = 10_000, seed: int = 0,
             level: float = 0.95) -> tuple[float, float, float]:
    """(median(new) / median(ref), low, high): the ratio of the medians and its percentile bootstrap CI,
    each side's values resampled with replacement independently."""
    if not ref or not new:
        raise ValueError("ratio_ci needs at least one value per side")
    rng = random.Random(seed)
    ratio = statistics.median(new) / statistics.median(ref)
    boot = sorted(statistics.median(rng.choices(new, k=len(new))) / statistics.median(rng.choices(ref, k=len(ref)))
                  for _ in range(resamples))
    lo_i = int((1 - level) / 2 * resamples)
    return ratio, boot[lo_i], boot[min(resamples - 1, resamples - 1 - lo_i)]


def summary(rev: str, results: dict[tuple[str, str], list[RunTiming]]) -> list[str]:
    """The printed lines: per mode and measure, both sides' median, the ratio and its CI."""
    out = []
    for mode in dict.fromkeys(m for m, _ in results):
        for measure, unit in (("wall_s", "wall s/step"), ("cpu_s", "CPU s/step/process"),
                              ("faults", "faults/step/process")):
            ref = [getattr(t, measure) for t in results[(mode, "ref")]]
            new = [getattr(t, measure) for t in results[(mode, "new")]]
            ratio, lo, hi = ratio_ci(ref, new)
            fmt = ".0f" if measure == "faults" else ".4f"
            out.append(f"{mode:4s} {unit:19s} {rev}: {statistics.median(ref):{fmt}}  this checkout: "
                       f"{statistics.median(new):{fmt}}  ratio {ratio:.3f} (95% CI {lo:.3f}-{hi:.3f}, "
                       f"{len(ref)} + {len(new)} runs)")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--against", required=True, metavar="REV", help="the git revision to compare with")
    p.add_argument("--rounds", type=int, default=3, help="runs per side and mode (default 3)")
    p.add_argument("--steps", type=int, default=20, help="RL steps per run (default 20)")
    p.add_argument("--skip", type=int, default=5, help="warm-up steps left out (default 5)")
    p.add_argument("--modes", default="main,arm", help="comma-separated, of: main, arm (default both)")
    p.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of every run (default: inherited)")
    p.add_argument("--override", action="append", default=[], metavar="section.key=value",
                   help="a config override of every run (repeatable)")
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if bad := [m for m in modes if m not in MODES]:
        p.error(f"--modes: unknown {', '.join(bad)}; choose from {', '.join(MODES)}")
    if args.rounds < 1 or not 1 <= args.skip < args.steps:
        p.error(f"need --rounds >= 1 and 1 <= --skip < --steps (got {args.rounds}, {args.skip}, {args.steps})")
    results: dict[tuple[str, str], list[RunTiming]] = {(m, s): [] for m in modes for s in ("ref", "new")}
    with tempfile.TemporaryDirectory(prefix="step_speed_") as tmp:
        ref_tree = Path(tmp) / "ref_tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(ref_tree), args.against],
                       check=True)
        try:
            for r in range(args.rounds):
                for mode in modes:
                    order = ("ref", "new") if r % 2 == 0 else ("new", "ref")
                    for side in order:
                        tree = ref_tree if side == "ref" else ROOT
                        t = timed_run(tree, mode, Path(tmp) / f"{mode}_{side}_{r}", steps=args.steps, skip=args.skip,
                                      overrides=args.override, threads=args.threads)
                        results[(mode, side)].append(t)
                        name = args.against if side == "ref" else "this checkout"
                        print(f"round {r + 1} {mode}: {name}: wall {t.wall_s:.4f} s/step, CPU {t.cpu_s:.4f} "
                              f"s/step/process, {t.faults:.0f} minor page faults/step/process", flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(ref_tree)], check=False)
    print("\n".join(summary(args.against, results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
