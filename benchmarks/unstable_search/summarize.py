"""One line per arm of a pilot matrix: failures (collapse or stall) by the pre-registered detector, the
step each fired, and what the runs ended at.

    python -m benchmarks.unstable_search.summarize runs/unstable_pilot1 [more dirs]

Reads each run's metrics.jsonl (`<algo>-<replay>-<variant>-s<seed>`); unfinished runs are read as far
as they got (marked `*`). Columns: failures / runs with kind and step (c = collapse, s = stall), final
reward (mean of the last 10% of steps, per seed), zero-signal groups and entropy over the last 10%,
rollout/learner routing flips per MoE layer and in >= 1 layer and k3 KL (run means), seconds per step.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

import numpy as np

from moe_gspo.algos.collapse import detect_failure

_RUN_RE = re.compile(r"^(?P<arm>.+)-s(?P<seed>\d+)$")


def _rows(path: Path) -> list[dict]:
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return rows


def _mean(rows, key) -> float:
    vals = []
    for r in rows:
        v = r.get(key)
        if isinstance(v, list):
            v = float(np.nanmean(v)) if v else None
        if v is not None and np.isfinite(v):
            vals.append(float(v))
    return float(np.mean(vals)) if vals else float("nan")


def summarize_run(run_dir: Path) -> dict | None:
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        return None
    rows = _rows(metrics)
    if not rows:
        return None
    reward = np.array([r["reward/mean"] for r in rows], float)
    zero = np.array([r.get("reward/frac_zero_std", np.nan) for r in rows], float)
    event = detect_failure(reward, zero)
    tail = rows[-max(1, len(rows) // 10):]
    return {"event": event, "final": _mean(tail, "reward/mean"), "zero": _mean(tail, "reward/frac_zero_std"),
            "entropy": _mean(tail, "actor/entropy"), "flips": _mean(rows, "routing/layer_disagree"),
            "any": _mean(rows, "routing/any_layer_flip"), "k3": _mean(rows, "mismatch/k3_kl"),
            "s_per_step": _mean(rows, "perf/step_time_s"), "steps": len(rows),
            "done": (run_dir / "done.json").exists()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dirs", nargs="+", type=Path, help="pilot output directories (moe_gspo.ablate --out)")
    args = ap.parse_args(argv)
    arms: dict[str, list[tuple[int, dict]]] = defaultdict(list)
    for d in args.dirs:
        for run_dir in sorted(p for p in d.iterdir() if p.is_dir()):
            m = _RUN_RE.match(run_dir.name)
            s = summarize_run(run_dir) if m else None
            if s is not None:
                arms[f"{d.name}/{m['arm']}"].append((int(m["seed"]), s))
    print(f"{'arm':44s} {'fail':>5s} events{'':14s} final reward{'':10s} zero  entr  flip/L  any    k3       s/step")
    for arm, runs in arms.items():
        runs.sort()
        ev = [s["event"] for _, s in runs]
        n_fail = sum(e.kind is not None for e in ev)
        evs = " ".join(f"{e.kind[0]}{e.step}" if e.kind else "-" for e in ev)
        fin = " ".join(f"{s['final']:.2f}" + ("" if s["done"] else "*") for _, s in runs)
        m = {k: np.mean([s[k] for _, s in runs]) for k in ("zero", "entropy", "flips", "any", "k3", "s_per_step")}
        print(f"{arm:44s} {n_fail}/{len(runs):<3d} {evs:20s} {fin:22s} {m['zero']:.2f}  {m['entropy']:.2f}  "
              f"{m['flips']:.4f}  {m['any']:.3f}  {m['k3']:.1e}  {m['s_per_step']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
