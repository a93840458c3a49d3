"""Time the main job of several commits side by side, in rounds, on this machine.

`python -m benchmarks.side_by_side REV [REV ...] [--rounds 3] [--nproc 2] [--skip 5] [--overrides section.key=value ...]`

Each REV is checked out read-only in a temporary `git worktree`; every round runs the default command
(`python -m moe_gspo.launch --standalone --nproc-per-node N -m moe_gspo.train --algo gspo` plus the
overrides) once per REV, one after the other, so that the box's drift (±30% within minutes on a shared CPU)
falls on every REV alike. It prints, per REV, each round's mean `perf/step_time_s` over the steps after
`--skip`, their mean, the same with `perf/eval_s` added (evaluation runs outside the step time), the ratio
to the first REV, and the per-phase means (`perf/<phase>_s`) of every phase that differs by more than
0.1 ms. The worktrees and run directories are removed at the end; nothing in this checkout changes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_once(tree: Path, run_dir: Path, nproc: int, overrides: list[str]) -> list[dict]:
    """The metrics rows of one run of the main job from the checkout `tree`."""
    cmd = [sys.executable, "-m", "moe_gspo.launch", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "moe_gspo.train", "--algo", "gspo", "--run-dir", str(run_dir), "logging.progress=false", *overrides]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{tree.name}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def phase_means(rows: list[dict], skip: int) -> dict[str, float]:
    """Mean seconds per step of every `perf/*_s` key over the rows after the first `skip` (0 where absent)."""
    kept = rows[skip:]
    keys = {k for r in kept for k in r if k.startswith("perf/") and k.endswith("_s")}
    return {k: sum(r.get(k, 0.0) for r in kept) / len(kept) for k in sorted(keys)}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("revs", nargs="+", help="commits to compare (the first is the reference)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--skip", type=int, default=5, help="warm-up steps left out of the means")
    p.add_argument("--overrides", nargs="*", default=[], help="train overrides, e.g. train.steps=100")
    args = p.parse_args(argv)
    out: dict[str, list[dict[str, float]]] = {rev: [] for rev in args.revs}
    with tempfile.TemporaryDirectory(prefix="side_by_side_") as tmp:
        trees = {}
        try:
            for i, rev in enumerate(args.revs):
                trees[rev] = Path(tmp) / f"tree{i}"
                subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(trees[rev]), rev],
                               check=True)
            for r in range(args.rounds):
                for rev in args.revs:
                    rows = run_once(trees[rev], Path(tmp) / f"run_{r}_{rev}", args.nproc, args.overrides)
                    out[rev].append(phase_means(rows, args.skip))
                    print(f"round {r + 1}: {rev} {out[rev][-1]['perf/step_time_s'] * 1e3:.1f} ms/step", flush=True)
        finally:
            for tree in trees.values():
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
    ref = args.revs[0]

    def mean(rev: str, key: str) -> float:
        return statistics.mean(m.get(key, 0.0) for m in out[rev])

    step_ref = mean(ref, "perf/step_time_s")
    print(f"\nmean perf/step_time_s over steps {args.skip}.. of {args.rounds} rounds (ms); ratio to {ref}")
    for rev in args.revs:
        step, with_eval = mean(rev, "perf/step_time_s"), mean(rev, "perf/step_time_s") + mean(rev, "perf/eval_s")
        rounds = ", ".join(f"{m['perf/step_time_s'] * 1e3:.1f}" for m in out[rev])
        print(f"  {rev:12s} {rounds}  mean {step * 1e3:.1f}  + eval {with_eval * 1e3:.1f}  "
              f"ratio {step / step_ref:.3f} (+ eval {with_eval / (step_ref + mean(ref, 'perf/eval_s')):.3f})")
    keys = sorted({k for rev in args.revs for m in out[rev] for k in m} - {"perf/step_time_s", "perf/tokens_per_s"})
    print("phases (ms per step):")
    for k in keys:
        vals = [mean(rev, k) * 1e3 for rev in args.revs]
        if max(vals) - min(vals) > 0.1:
            print(f"  {k:22s} " + "  ".join(f"{v:7.2f}" for v in vals))
    return {rev: out[rev] for rev in args.revs}


if __name__ == "__main__":
    main()
