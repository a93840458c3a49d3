"""Benchmark: the host-memory floor (`moe_gspo.plan.batch_bound`) against the measured peak RSS of real runs.

`python -m benchmarks.host_floor_bench [--shapes NAME,NAME] [--tolerance 0.25] [--json OUT]` runs, for each shape
(`SHAPES`: tiny models whose attention dominates memory, issue 59), one RL step of `python -m moe_gspo.train` on
the CPU in a fresh process (`train.steps=1`, no evaluation, one process) in a temporary run directory, takes the
process's peak resident set (`ru_maxrss` of `os.wait4`: memory, not time, so a busy machine does not change
it), and prints the floor `batch_floor_bytes` counts for the same config next to it with floor / peak. It
exits 1 when a ratio is outside 1 +- `--tolerance`. The floor leaves out Python and torch themselves (~0.6 GiB
for the default tiny model), so a shape must need a few GiB for the ratio to mean something; each shape below
peaks at 3-5 GiB and runs in a few minutes on two busy cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

GIB = 2**30
SHAPES = {
    "heads1500_kv1": ["model.tiny={num_attention_heads: 1500, num_key_value_heads: 1}"],
    "heads600_kv600": ["model.tiny={num_attention_heads: 600, num_key_value_heads: 600}"],
    "heads3000_kv1_p8": ["model.tiny={num_attention_heads: 3000, num_key_value_heads: 1}",
                         "rollout.prompts_per_step=8"],
}
"""Overrides of each shape on top of the training default (`COMMON`)."""
COMMON = ["train.steps=1", "eval.every=0", "logging.progress=false"]


def floor_bytes(overrides: list[str]) -> dict[str, float]:
    """The floor's parts for `overrides` (one process on this CPU machine)."""
    from moe_gspo.config_load import load_config
    from moe_gspo.plan.batch_bound import batch_floor_bytes

    from moe_gspo.run.cli import TRAIN_DEFAULT_CONFIG

    cfg = load_config(TRAIN_DEFAULT_CONFIG, COMMON + overrides)
    return batch_floor_bytes(cfg, world_size=1, local_ranks=1, on_cuda=False)


def measure_peak(overrides: list[str], run_dir: Path) -> int:
    """Peak RSS (bytes) of one `moe_gspo.train` process on `overrides`; raises RuntimeError if it fails."""
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    proc = subprocess.Popen([sys.executable, "-m", "moe_gspo.train", "--run-dir", str(run_dir), *COMMON, *overrides],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    err = proc.stderr.read().decode(errors="replace")
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise RuntimeError(f"the run exited {proc.returncode}: {err.strip().splitlines()[-1:] or ''}")
    return usage.ru_maxrss * 1024  # KiB on Linux


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of: {', '.join(SHAPES)}")
    ap.add_argument("--tolerance", type=float, default=0.25, help="allowed |floor / peak - 1|")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args(argv)
    names = [n for n in args.shapes.split(",") if n]
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        ap.error(f"unknown shape(s) {', '.join(unknown)}; known: {', '.join(SHAPES)}")
    rows, bad = [], 0
    print(f"{'shape':<20} {'floor GiB':>9} {'peak GiB':>9} {'floor/peak':>10}  parts", flush=True)
    for name in names:
        parts = floor_bytes(SHAPES[name])
        with tempfile.TemporaryDirectory(prefix="host_floor_") as tmp:
            peak = measure_peak(SHAPES[name], Path(tmp) / "run")
        floor = sum(parts.values())
        ratio = floor / peak
        ok = abs(ratio - 1) <= args.tolerance
        bad += not ok
        detail = ", ".join(f"{k} {v / GIB:.2f}" for k, v in parts.items() if v >= 0.01 * GIB)
        print(f"{name:<20} {floor / GIB:>9.2f} {peak / GIB:>9.2f} {ratio:>10.2f}  {detail}{'' if ok else '  OUT'}",
              flush=True)
        rows.append({"shape": name, "overrides": SHAPES[name], "floor_bytes": floor, "peak_rss_bytes": peak,
                     "ratio": ratio, "parts": parts, "within_tolerance": ok})
    if args.json:
        args.json.write_text(json.dumps({"tolerance": args.tolerance, "rows": rows}, indent=1))
    print(f"{len(rows) - bad} of {len(rows)} shapes within +-{args.tolerance:.0%}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
