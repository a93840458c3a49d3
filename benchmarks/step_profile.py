"""Per-step cost profile of the main job: where an RL step's wall time goes.

`python -m benchmarks.step_profile [--config CONFIG ...] [--steps 40] [--skip 5] [--nproc 2] [--trl] [overrides]`

Runs `torchrun --standalone --nproc-per-node N -m moe_gspo.train` on each config (default: the
default `configs/tiny_cpu.yaml` and the 2-token `configs/tiny_cpu_copy_first.yaml` of the TRL peer
comparison) for `--steps` RL steps in a temporary run directory, then prints the mean seconds per step
of each phase the train loop times (`perf/<phase>_s`, see `moe_gspo/run/timing.py`) and its share,
averaged over the steps after the first `--skip` (warm-up). Phases that run every k steps (drift
probe, traces, checkpoints) are averaged over all steps, so the split is the amortised cost. "loop,
untimed" is the step time not inside any phase (bookkeeping, the progress bar, the metrics file).
Timings on a shared machine are contended: compare figures taken back to back on a quiet box.

`--trl` also runs TRL's `GRPOTrainer` on each config as the TRL peer benchmark sets it up
(`benchmarks.trl_worker`, one process) for the same steps and prints its split the same way: its
phases (`race_common.TRL_PHASES`: generate, old_logp, score, update) are wall times of its own methods,
not a profiler's (cProfile inflates Python-heavy code), and "trainer loop, untimed" is the rest of its
RL step (gradient clipping, optimizer steps, scheduler, callbacks).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.race_common import (ROOT, TRL_PHASES, Curve, phase_split, subprocess_env, train_cmd,
                                    trl_worker_cmd)
from moe_gspo.run.timing import PHASES

DEFAULT_CONFIGS = ("configs/tiny_cpu.yaml", "configs/tiny_cpu_copy_first.yaml")


def run_job(config: str, *, steps: int, nproc: int, run_dir: Path, overrides: list[str]) -> list[dict]:
    """The metrics rows of a fresh `moe_gspo.train` run (RuntimeError with the log tail if it fails)."""
    cmd = train_cmd(config, nproc=nproc, run_dir=run_dir, steps=steps, overrides=overrides)
    return _run_for_json_lines(cmd, run_dir / "metrics.jsonl")


def _run_for_json_lines(cmd: list[str], path: Path) -> list[dict]:
    """Run `cmd` from the repository root; the JSON lines it wrote to `path` (RuntimeError with the log tail
    if it fails)."""
    proc = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_trl_job(config: str, *, steps: int, out_dir: Path, overrides: list[str]) -> list[dict]:
    """The per-RL-step records of TRL's worker on `config` (RuntimeError with the log tail if it fails)."""
    from moe_gspo.config_load import load_config

    seed = load_config(config, overrides).train.seed
    records = out_dir / "rl_steps.jsonl"
    cmd = trl_worker_cmd(config, seed=seed, max_steps=steps, out_dir=out_dir, records=records, overrides=overrides)
    return _run_for_json_lines(cmd, records)


def trl_profile(records: list[dict], *, skip: int) -> dict:
    """Mean seconds per RL step of each of TRL's phases over `records[skip:]`; an RL step's wall time is
    the difference of consecutive `t_s` (so at least one step is skipped)."""
    skip = max(skip, 1)
    if len(records) <= skip:
        raise ValueError(f"no TRL steps left after --skip {skip}; raise --steps")
    curve = Curve(name="TRL", times_s=[r["t_s"] for r in records], phases=[r["phases"] for r in records])
    out = phase_split(curve, steps_per_turn=None, skip=skip)
    out["trainer loop, untimed"] = out.pop("rest")
    out["total"] = sum(out.values())
    out["num_steps"] = len(records) - skip
    return out


def format_trl_profile(name: str, prof: dict) -> str:
    return _table(f"{name}, TRL GRPOTrainer", prof, (*TRL_PHASES, "trainer loop, untimed"))


def _table(title: str, prof: dict, phases) -> str:
    total, width = prof["total"], max(16, *map(len, phases))
    lines = [f"{title}: {total:.3f} s per RL step (mean of {prof['num_steps']} steps)",
             f"  {'phase':<{width}} {'s/step':>8} {'share':>7}"]
    lines += [f"  {p:<{width}} {prof[p]:8.4f} {100 * prof[p] / total:6.1f}%" for p in phases]
    return "\n".join(lines)


def profile(rows: list[dict], *, skip: int) -> dict:
    """Mean seconds per step of each phase over `rows[skip:]` (a phase absent from a row counts 0)."""
    rows = rows[skip:]
    if not rows:
        raise ValueError(f"no steps left after --skip {skip}; raise --steps")
    n = len(rows)
    out = {p: sum(r.get(f"perf/{p}_s", 0.0) for r in rows) / n for p in PHASES}
    step = sum(r["perf/step_time_s"] for r in rows) / n
    after_row = ("log", "checkpoint")  # timed after the row was assembled: not in perf/step_time_s
    out["loop, untimed"] = step - sum(v for p, v in out.items() if p not in after_row)
    out["total"] = step + sum(out[p] for p in after_row)
    out["num_steps"] = n
    return out


DIAGNOSTIC_PHASES = ("compare", "eval", "traces")
"""The phases that only measure (rollout-vs-learner and router metrics, route checks; the held-out evaluation;
traces and samples): their share is what the step pays for its diagnostics, apart from the router
statistics recorded inside the rollout and the learner's passes."""


def format_profile(name: str, prof: dict) -> str:
    table = _table(name, prof, [p for p in (*PHASES, "loop, untimed")
                                if prof[p] > 0 or p in ("rollout", "old_logp", "update", "sync")])
    diag = sum(prof.get(p, 0.0) for p in DIAGNOSTIC_PHASES)
    return (table + f"\n  measuring phases ({' + '.join(DIAGNOSTIC_PHASES)}): {diag:.4f} s/step, "
            f"{100 * diag / prof['total']:.1f}% of the step")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--config", action="append", default=None,
                   help=f"run config (repeatable; default: {', '.join(DEFAULT_CONFIGS)})")
    p.add_argument("--steps", type=int, default=40, help="RL steps per run (default 40)")
    p.add_argument("--skip", type=int, default=5, help="warm-up steps left out of the means (default 5)")
    p.add_argument("--nproc", type=int, default=2, help="torchrun processes (default 2)")
    p.add_argument("--trl", action="store_true",
                   help="also profile TRL's GRPOTrainer on each config (see below; needs the dev extra's trl)")
    p.add_argument("--json", default=None, help="also write the profiles to this JSON file")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides for every run")
    args = p.parse_args(argv)
    if args.steps <= args.skip:
        p.error(f"--steps {args.steps} must exceed --skip {args.skip}")
    if args.trl and importlib.util.find_spec("trl") is None:
        p.error("--trl needs TRL: pip install -e '.[dev]' (README, Install)")
    results = {}
    with tempfile.TemporaryDirectory(prefix="step_profile_") as tmp:
        for i, config in enumerate(args.config or DEFAULT_CONFIGS):
            print(f"running {config} for {args.steps} steps on {args.nproc} processes ...", flush=True)
            rows = run_job(config, steps=args.steps, nproc=args.nproc, run_dir=Path(tmp) / f"run{i}",
                           overrides=args.overrides)
            results[config] = profile(rows, skip=args.skip)
            print(format_profile(config, results[config]), flush=True)
            if args.trl:
                print(f"running TRL's GRPOTrainer on {config} for {args.steps} RL steps ...", flush=True)
                out = Path(tmp) / f"trl{i}"
                out.mkdir()
                trl = trl_profile(run_trl_job(config, steps=args.steps, out_dir=out, overrides=args.overrides),
                                  skip=args.skip)
                results[f"{config} (TRL)"] = trl
                print(format_trl_profile(config, trl), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
