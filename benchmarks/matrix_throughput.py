"""Runs per hour of a phase matrix on this machine under the ablation runner's layouts.

`python -m benchmarks.matrix_throughput [--config C] [--steps 300] [--layout P:R[:T] ...] [--rounds 2]
[--dry-run] [--json FILE] [overrides]`

A layout is how `python -m moe_gspo.ablate` (`executor: local`) would use the cores: P arms in parallel
(`parallel_arms`), R ranks per arm (`nproc`, torchrun processes), T threads per rank (OMP_NUM_THREADS;
omitted: the runner's own rule, `moe_gspo.ablate.local_threads_env`: cores // (P * R) when P > 1, torch's
default for one arm at a time). Default layouts on any machine: 1:1, 1:2, 2:1 and 2:1:1 written out for
comparison with 2:1 as the runner sets it, and 4:1.

One round of a layout starts P runs of `--config` for `--steps` steps at once (seeds 0..P-1, each with the
arm command the runner builds: `moe_gspo.launch --standalone --nproc-per-node R -m moe_gspo.train`, no wandb,
no progress bar, no HF export) and waits for all of them; its throughput is P * 3600 / the round's wall
seconds (start-up, evaluations and checkpoints included, as in a matrix). Rounds of the layouts alternate
(A, B, C, A, B, C, ...) so that a drift of the machine's speed meets every layout alike; the median over
`--rounds` rounds is reported. A matrix whose arms differ in length is not modelled: every run here is the
same config.

It needs an otherwise idle machine: every layout uses all cores, and other processes change the answer.
`--dry-run` prints each round's commands and thread settings without running anything.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

DEFAULT_LAYOUTS = ("1:1", "1:2", "2:1", "2:1:1", "4:1")


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


def arm_command(config: str, *, nproc: int, run_dir: Path, seed: int, steps: int, overrides: list[str]) -> list[str]:
    """The arm command of `moe_gspo.run.ablation_arms.build_command` for one run of `config`."""
    return [sys.executable, "-m", "moe_gspo.launch", "--standalone", "--nproc-per-node", str(nproc),
            "-m", "moe_gspo.train", "--config", config, "--run-dir", str(run_dir), f"train.seed={seed}",
            f"train.steps={steps}", "logging.wandb_mode=disabled", "logging.progress=false",
            "train.export_hf=false", *overrides]


def round_commands(layout: Layout, config: str, *, steps: int, out_dir: Path, overrides: list[str]) -> list[list[str]]:
    """The P commands of one round of `layout` (seeds 0..P-1, run directories under `out_dir`)."""
    return [arm_command(config, nproc=layout.nproc, run_dir=out_dir / f"s{seed}", seed=seed, steps=steps,
                        overrides=overrides) for seed in range(layout.parallel_arms)]


def runs_per_hour(parallel_arms: int, wall_s: float) -> float:
    """Finished runs per hour of rounds of `parallel_arms` runs that take `wall_s` each."""
    if wall_s <= 0:
        raise ValueError(f"a round's wall time must be positive, got {wall_s}")
    return parallel_arms * 3600.0 / wall_s


def run_round(cmds: list[list[str]], env: dict[str, str] | None) -> float:
    """Start every command at once, wait for all; the wall seconds (RuntimeError with the log tail of a failed
    one, after stopping the rest)."""
    from benchmarks.race_common import ROOT, subprocess_env

    full_env = {**subprocess_env(), **(env or {})}
    t0 = time.perf_counter()
    procs = [subprocess.Popen(c, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for c in cmds]
    try:
        outs = [p.communicate()[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    wall = time.perf_counter() - t0
    for c, p, out in zip(cmds, procs, outs):
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(c)} exited with {p.returncode}:\n{out[-3000:]}")
    return wall


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--config", default="configs/tiny_cpu.yaml", help="run config (default configs/tiny_cpu.yaml)")
    p.add_argument("--steps", type=int, default=300, help="RL steps per run (default 300, a phase-matrix arm)")
    p.add_argument("--layout", action="append", default=None, metavar="P:R[:T]",
                   help=f"arms in parallel : ranks per arm [: threads per rank] (repeatable; default "
                        f"{' '.join(DEFAULT_LAYOUTS)})")
    p.add_argument("--rounds", type=int, default=2, help="rounds of every layout, alternating (default 2)")
    p.add_argument("--dry-run", action="store_true", help="print the rounds' commands; run nothing")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides for every run")
    args = p.parse_args(argv)
    if args.steps < 1 or args.rounds < 1:
        p.error(f"--steps ({args.steps}) and --rounds ({args.rounds}) must be at least 1")
    try:
        layouts = [parse_layout(t) for t in (args.layout or DEFAULT_LAYOUTS)]
    except ValueError as e:
        p.error(str(e))
    if len({lay.name for lay in layouts}) != len(layouts):
        p.error("--layout: a layout is given twice")
    cores = os.cpu_count() or 1
    walls: dict[str, list[float]] = {lay.name: [] for lay in layouts}
    with tempfile.TemporaryDirectory(prefix="matrix_throughput_") as tmp:
        for r in range(args.rounds):
            for i, lay in enumerate(layouts):
                out = Path(tmp) / f"round{r}_layout{i}"
                cmds = round_commands(lay, args.config, steps=args.steps, out_dir=out, overrides=args.overrides)
                env = lay.env(cores)
                if args.dry_run:
                    print(f"round {r + 1}, layout {lay.name}, env {env or '{}'}:")
                    print("\n".join("  " + " ".join(c) for c in cmds))
                    continue
                print(f"round {r + 1}/{args.rounds}, layout {lay.name} ({lay.parallel_arms} arms x {lay.nproc} "
                      f"ranks, env {env or 'torch default threads'}) ...", flush=True)
                walls[lay.name].append(run_round(cmds, env))
                print(f"  {walls[lay.name][-1]:.1f} s, {runs_per_hour(lay.parallel_arms, walls[lay.name][-1]):.1f} "
                      f"runs/hour", flush=True)
    if args.dry_run:
        return 0
    results = {}
    print(f"\n{args.config}, {args.steps} steps per run, {cores} cores, median of {args.rounds} round(s):")
    for lay in layouts:
        rph = statistics.median(runs_per_hour(lay.parallel_arms, w) for w in walls[lay.name])
        results[lay.name] = {"runs_per_hour": rph, "round_wall_s": walls[lay.name], "env": lay.env(cores)}
        print(f"  {lay.name:<8} {rph:7.1f} runs/hour  (rounds: {', '.join(f'{w:.1f} s' for w in walls[lay.name])})")
    best = max(results, key=lambda k: results[k]["runs_per_hour"])
    print(f"fastest: {best}")
    if args.json:
        Path(args.json).write_text(json.dumps({"config": args.config, "steps": args.steps, "cores": cores,
                                               "layouts": results, "fastest": best}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
