"""Runs per hour of a phase matrix on this machine under the ablation runner's layouts.

`python -m benchmarks.matrix_throughput [--spec SPEC [--arm ARM] | --config C] [--steps N] [--layout P:R[:T] ...]
[--rounds 2] [--dry-run] [--json FILE] [overrides]`

A layout is how `python -m moe_gspo.ablate` (`executor: local`) would use the cores: P arms in parallel
(`parallel_arms`), R ranks per arm (`nproc`, torchrun processes), T threads per rank (OMP_NUM_THREADS;
omitted: the runner's own rule, `moe_gspo.ablate.local_threads_env`: cores // (P * R), at least 1, when
P > 1; for one arm at a time it sets nothing, so a rank gets what this process's environment says, else
torch's default (its cores) for one rank and 1 for several (torchrun sets OMP_NUM_THREADS=1 when it starts
more than one rank and the variable is unset). The table's "threads/rank" column says which applied.
Default layouts: 1:1, 1:2, 2:1, 2:1:2 (two arms, each rank on every core: oversubscribed) and 4:1.

What runs is a matrix of the runner itself: one round of a layout is `moe_gspo.ablate.run_ablation` on a
spec of one arm at P seeds with `parallel_arms` P and `nproc` R (so each run is exactly the command the
runner builds, `moe_gspo.run.ablation_arms.build_command`: `moe_gspo.launch --standalone --nproc-per-node R
-m moe_gspo.train ...`, its log, done.json and environment), started at once and waited for; its throughput
is P * 3600 / the round's wall seconds (start-up, evaluations and checkpoints included, as in a matrix).
The arm: `--spec SPEC` (e.g. configs/ablation_phase.yaml, a 300-step phase arm: its base config and
overrides) and `--arm` (one of its arms as the run directories name them, `<algo>-<replay>[-<variant>]`;
default its first), or `--config C` (default configs/tiny_cpu.yaml, its own algorithm, `--steps` RL steps,
default 300, no wandb, no progress bar, no HF export). The seeds are the spec's first seed and the next
P - 1 (its `exclude` rules do not apply). Rounds of the layouts alternate (A, B, C, A, B, C, ...) so that
a drift of the machine's speed meets every layout alike; the table gives each layout's median over
`--rounds` rounds, the fastest, and how it compares with the runner's default layout (the spec keys'
defaults `default_parallel_arms(nproc)` and `DEFAULT_NPROC` of `moe_gspo/run/ablation_spec.py`, which should follow
this benchmark). A matrix whose arms differ in length is not modelled.

It needs an otherwise idle machine: every layout uses all cores, and other processes change the answer.
`--dry-run` prints each round's commands and thread settings without running anything.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

DEFAULT_LAYOUTS = ("1:1", "1:2", "2:1", "2:1:2", "4:1")
DEFAULT_CONFIG = "configs/tiny_cpu.yaml"
DEFAULT_STEPS = 300


@dataclass(frozen=True, kw_only=True)
class Layout:
    """One way to run a matrix's arms on this machine."""

    parallel_arms: int
    """Arms running at the same time (the ablation spec's `parallel_arms`)."""
    nproc: int
    """torchrun processes (ranks) per arm (the spec's `nproc`)."""
    threads: int | None
    """OMP_NUM_THREADS of every rank; None: what the runner sets for this layout (`local_threads_env`)."""

    @property
    def name(self) -> str:
        return f"{self.parallel_arms}:{self.nproc}" + ("" if self.threads is None else f":{self.threads}")

    def env(self, cores: int | None = None) -> dict[str, str] | None:
        """The environment the arms get on top of this one (None: nothing added)."""
        from moe_gspo.ablate import local_threads_env

        if self.threads is not None:
            return {"OMP_NUM_THREADS": str(self.threads)}
        return local_threads_env(self.parallel_arms, self.nproc, cores)

    def threads_per_rank(self, cores: int, environ: dict[str, str]) -> str:
        """OMP_NUM_THREADS a rank runs with under this layout, launched from `environ`, and why."""
        env = self.env(cores)
        if env:
            return f"{env['OMP_NUM_THREADS']} ({'given' if self.threads is not None else 'the runner: cores // (P*R)'})"
        if environ.get("OMP_NUM_THREADS"):
            return f"{environ['OMP_NUM_THREADS']} (this shell's OMP_NUM_THREADS)"
        if self.nproc > 1:
            return "1 (torchrun's, for several ranks)"
        return f"{cores} (torch's default)"


def parse_layout(text: str) -> Layout:
    """`P:R` or `P:R:T`, each a positive integer (ValueError naming the form otherwise)."""
    parts = text.split(":")
    try:
        nums = [int(p) for p in parts]
    except ValueError:
        nums = []
    if len(parts) not in (2, 3) or len(nums) != len(parts) or min(nums) < 1:
        raise ValueError(f"--layout {text!r}: expected P:R or P:R:T, positive integers (arms in parallel, "
                         f"ranks per arm, threads per rank), e.g. 2:1 or 1:2:1")
    return Layout(parallel_arms=nums[0], nproc=nums[1], threads=nums[2] if len(nums) == 3 else None)


def config_spec(config: str, *, steps: int, overrides: list[str]):
    """A one-arm ablation spec of the run config `config` (its own algorithm and routing replay) for `steps`
    RL steps, no wandb, no progress bar, no HF export, then `overrides` (ValueError for a bad one)."""
    from moe_gspo.config_load import load_config, parse_override
    from moe_gspo.run.ablation_spec import parse_spec

    cfg = load_config(config, [f"train.steps={steps}", *overrides])
    extra = {}
    for text in overrides:
        sec, key, value = parse_override(text)
        if f"{sec}.{key}" not in ("algo.name", "algo.routing_replay"):  # the arm's --algo, --routing-replay
            extra[f"{sec}.{key}"] = value
    return parse_spec({"base_config": config, "algos": [cfg.algo.name], "routing_replay": [cfg.algo.routing_replay],
                       "seeds": [0], "overrides": {"train.steps": steps, "logging.wandb_mode": "disabled",
                                                   "logging.progress": False, "train.export_hf": False, **extra}})


def pick_arm(spec, arm: str | None) -> str:
    """The group (`<algo>-<replay>[-<variant>]`) of the spec's arm named `arm` (default: its first arm)."""
    from moe_gspo.ablate import expand_arms

    groups = list(dict.fromkeys(a.group for a in expand_arms(spec, warn=False)))
    if arm is None:
        return groups[0]
    if arm not in groups:
        raise ValueError(f"--arm {arm}: not an arm of the spec; its arms: {', '.join(groups)}")
    return arm


def round_spec(spec, group: str, layout: Layout, out_dir: Path):
    """The spec of one round of `layout`: the arm `group` at P seeds (the spec's first and the next P - 1),
    P at a time, R ranks each, run directories under `out_dir`."""
    first = spec.seeds[0]
    return dataclasses.replace(spec, seeds=[first + i for i in range(layout.parallel_arms)], exclude=[],
                               only=[group], nproc=layout.nproc, parallel_arms=layout.parallel_arms,
                               out_dir=Path(out_dir), executor="local")


def round_commands(spec) -> list[list[str]]:
    """The commands the runner starts for `spec` (fresh run directories)."""
    from moe_gspo.ablate import build_command, expand_arms

    return [build_command(spec, arm, resume=False) for arm in expand_arms(spec, warn=False)]


def runs_per_hour(parallel_arms: int, wall_s: float) -> float:
    """Finished runs per hour of rounds of `parallel_arms` runs that take `wall_s` each."""
    if wall_s <= 0:
        raise ValueError(f"a round's wall time must be positive, got {wall_s}")
    return parallel_arms * 3600.0 / wall_s


def run_round(spec, env: dict[str, str] | None) -> float:
    """Run the round's matrix through the runner (`run_ablation`, `env` added to every arm's environment, this
    checkout first on PYTHONPATH); its wall seconds (RuntimeError with the log tail of a run that failed)."""
    from benchmarks.race_common import subprocess_env
    from moe_gspo.ablate import SubprocessArmRunner, run_ablation

    runner = SubprocessArmRunner(spec.arm_timeout_s, env={"PYTHONPATH": subprocess_env()["PYTHONPATH"], **(env or {})})
    t0 = time.perf_counter()
    results = run_ablation(spec, runner, progress=False, compare=False)
    wall = time.perf_counter() - t0
    for res in results:
        if res.status != "finished":
            tail = res.log_path.read_text()[-3000:] if res.log_path.is_file() else ""
            raise RuntimeError(f"{res.arm.name} {res.status} ({res.message}); log {res.log_path}:\n{tail}")
    return wall


def summarize(walls: dict[str, list[float]], layouts: list[Layout]) -> dict:
    """Median runs per hour of each layout over its rounds, and the fastest layout."""
    out = {lay.name: {"runs_per_hour": statistics.median(runs_per_hour(lay.parallel_arms, w)
                                                         for w in walls[lay.name]),
                      "round_wall_s": walls[lay.name]} for lay in layouts}
    return {"layouts": out, "fastest": max(out, key=lambda k: out[k]["runs_per_hour"])}


def table(summary: dict, layouts: list[Layout], *, cores: int, environ: dict[str, str], default: str) -> list[str]:
    """The result as aligned lines: one row per layout, then the fastest and how the runner's default compares."""
    rows = [["layout", "arms x ranks", "threads/rank", "runs/hour (median)", "rounds (wall s)"]]
    for lay in layouts:
        x = summary["layouts"][lay.name]
        mark = " *" if lay.name == summary["fastest"] else ""
        rows.append([lay.name + (" (runner default)" if lay.name == default else ""),
                     f"{lay.parallel_arms} x {lay.nproc}", lay.threads_per_rank(cores, environ),
                     f"{x['runs_per_hour']:.1f}{mark}", ", ".join(f"{w:.1f}" for w in x["round_wall_s"])])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    best = summary["layouts"][summary["fastest"]]["runs_per_hour"]
    lines.append(f"fastest (*): {summary['fastest']}, {best:.1f} runs/hour")
    if default in summary["layouts"]:
        lines.append(f"the runner's default {default}: {summary['layouts'][default]['runs_per_hour']:.1f} runs/hour, "
                     f"the fastest runs {best / summary['layouts'][default]['runs_per_hour']:.2f}x as many"
                     if default != summary["fastest"] else f"the runner's default {default} is the fastest")
    return lines


def main(argv: list[str] | None = None) -> int:
    from moe_gspo.run.ablation_spec import DEFAULT_NPROC, default_parallel_arms, usable_cores

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--config", default=None, help=f"run config of the arm (default {DEFAULT_CONFIG})")
    src.add_argument("--spec", default=None, help="ablation spec whose arm runs (e.g. configs/ablation_phase.yaml)")
    p.add_argument("--arm", default=None, help="--spec: the arm, <algo>-<replay>[-<variant>] (default: its first)")
    p.add_argument("--steps", type=int, default=None,
                   help=f"RL steps per run (default {DEFAULT_STEPS} with --config, the spec's own with --spec)")
    p.add_argument("--layout", action="append", default=None, metavar="P:R[:T]",
                   help=f"arms in parallel : ranks per arm [: threads per rank] (repeatable; default "
                        f"{' '.join(DEFAULT_LAYOUTS)})")
    p.add_argument("--rounds", type=int, default=2, help="rounds of every layout, alternating (default 2)")
    p.add_argument("--dry-run", action="store_true", help="print the rounds' commands; run nothing")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides for every run")
    args = p.parse_args(argv)
    if (args.steps is not None and args.steps < 1) or args.rounds < 1:
        p.error(f"--steps ({args.steps}) and --rounds ({args.rounds}) must be at least 1")
    if args.arm is not None and args.spec is None:
        p.error("--arm names an arm of --spec SPEC; give the spec")
    try:
        layouts = [parse_layout(t) for t in (args.layout or DEFAULT_LAYOUTS)]
        if len({lay.name for lay in layouts}) != len(layouts):
            raise ValueError("--layout: a layout is given twice")
        if args.spec is not None:
            from moe_gspo.run.ablation_spec import load_spec

            steps = [] if args.steps is None else [f"train.steps={args.steps}"]
            spec = load_spec(args.spec, overrides=[*steps, *args.overrides], executor="local")
        else:
            spec = config_spec(args.config or DEFAULT_CONFIG, steps=args.steps or DEFAULT_STEPS,
                               overrides=args.overrides)
        group = pick_arm(spec, args.arm)
    except ValueError as e:
        p.error(str(e))
    from moe_gspo.ablate import validate_arms

    problems = validate_arms(round_spec(spec, group, layouts[0], Path(tempfile.gettempdir()) / "matrix_throughput"))
    if problems:  # a bad override or config: refused before anything runs
        p.error("; ".join(problems))

    cores = usable_cores()  # the runner's own count: this process's CPU affinity (a cgroup's or taskset's share)
    default = f"{default_parallel_arms(DEFAULT_NPROC)}:{DEFAULT_NPROC}"
    what = f"{args.spec} arm {group}" if args.spec else f"{spec.base_config} ({group})"
    steps = spec.overrides.get("train.steps", "the config's")
    print(f"matrix throughput: {what}, {steps} RL steps per run, {cores} cores, layouts "
          f"{' '.join(lay.name for lay in layouts)}, {args.rounds} round(s) each, alternating", flush=True)
    if os.environ.get("OMP_NUM_THREADS"):
        print(f"note: OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} in this shell: layouts with one arm at a "
              "time run with it, as the runner's would", flush=True)
    walls: dict[str, list[float]] = {lay.name: [] for lay in layouts}
    with tempfile.TemporaryDirectory(prefix="matrix_throughput_") as tmp:
        for r in range(args.rounds):
            for i, lay in enumerate(layouts):
                rspec = round_spec(spec, group, lay, Path(tmp) / f"round{r}_layout{i}")
                env = lay.env(cores)
                if args.dry_run:
                    print(f"round {r + 1}, layout {lay.name}, env {env or '{}'}, threads/rank "
                          f"{lay.threads_per_rank(cores, dict(os.environ))}:")
                    print("\n".join("  " + shlex.join(c) for c in round_commands(rspec)))
                    continue
                print(f"round {r + 1}/{args.rounds}, layout {lay.name} ({lay.parallel_arms} arms x {lay.nproc} "
                      f"ranks, threads/rank {lay.threads_per_rank(cores, dict(os.environ))}) ...", flush=True)
                walls[lay.name].append(run_round(rspec, env))
                print(f"  {walls[lay.name][-1]:.1f} s, {runs_per_hour(lay.parallel_arms, walls[lay.name][-1]):.1f} "
                      f"runs/hour", flush=True)
    if args.dry_run:
        return 0
    summary = summarize(walls, layouts)
    print(f"\nruns per hour, median of {args.rounds} round(s):")
    print("\n".join("  " + line for line in table(summary, layouts, cores=cores, environ=dict(os.environ),
                                                   default=default)))
    if args.json:
        for lay in layouts:
            summary["layouts"][lay.name].update(env=lay.env(cores),
                                                threads_per_rank=lay.threads_per_rank(cores, dict(os.environ)))
        out = Path(args.json)
        tmp_json = out.with_name(out.name + ".tmp")
        tmp_json.write_text(json.dumps({"arm": what, "steps": steps, "cores": cores, "rounds": args.rounds,
                                        "runner_default": default, **summary}, indent=1))
        tmp_json.replace(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
