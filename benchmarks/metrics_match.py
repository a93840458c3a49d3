"""Whether two runs logged the same metrics, to float tolerance, apart from the timings.

`python -m benchmarks.metrics_match REF_RUN_DIR RUN_DIR [--rtol 1e-5] [--atol 1e-7]`
`python -m benchmarks.metrics_match --against REV [--steps 20] [--nproc 1] [--override section.key=value ...]`

Compares `metrics.jsonl` and, where the reference has one, `eval.jsonl` of the two run directories row by
row: the same rows (by `step`), the same keys, and every value equal within `|a - b| <= atol + rtol * |b|`
(`math.isclose`; NaN equals NaN; a list, such as a per-layer metric, element by element), except the timing keys (`perf/*`), which measure the machine, not the run.
Exit 0 and one line when they match; otherwise exit 1 and the first mismatches, one per line. Use it for a
speed change that must not change the mathematics: run the same command (same seed, same steps, same
process count) from the base commit and from the change and compare. `--against REV` does that: it checks
REV out read-only in a temporary `git worktree`, runs the default command (`benchmarks.side_by_side.run_once`:
`moe_gspo.launch --nproc-per-node N -m moe_gspo.train --algo gspo`, `train.steps=S`, no wandb, no HF export)
from REV and from this checkout, one after the other, and compares them. Runs on CPUs with and without AMX
round differently, so compare runs made on one machine.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

TIMING_PREFIXES = ("perf/",)


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def mismatches(ref_rows: list[dict], rows: list[dict], *, rtol: float, atol: float, name: str = "metrics") -> list[str]:
    """One line per difference between `rows` and `ref_rows` outside the timing keys (empty: they match)."""
    out = []
    if len(ref_rows) != len(rows):
        out.append(f"{name}: {len(rows)} rows, the reference has {len(ref_rows)}")
    for i, (ref, row) in enumerate(zip(ref_rows, rows)):
        where = f"{name} row {i} (step {ref.get('step', '?')})"
        ref_keys = {k for k in ref if not k.startswith(TIMING_PREFIXES)}
        keys = {k for k in row if not k.startswith(TIMING_PREFIXES)}
        for k in sorted(ref_keys ^ keys):
            out.append(f"{where}: key {k!r} only in {'the reference' if k in ref_keys else 'the run'}")
        for k in sorted(ref_keys & keys):
            a, b = row[k], ref[k]
            if not _same(a, b, rtol=rtol, atol=atol):
                out.append(f"{where}: {k} = {a!r}, the reference has {b!r}")
    return out


def _same(a, b, *, rtol: float, atol: float) -> bool:
    """Numbers within the tolerance (NaN equals NaN), lists element by element and mappings key by key (a
    per-layer metric is a list), anything else equal."""
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) \
            and not isinstance(b, bool):
        return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=rtol, abs_tol=atol)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y, rtol=rtol, atol=atol) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k], rtol=rtol, atol=atol) for k in a)
    return a == b


def compare_run_dirs(ref_dir: Path, run_dir: Path, *, rtol: float, atol: float) -> list[str]:
    """`mismatches` of metrics.jsonl, and of eval.jsonl when the reference wrote one."""
    out = []
    for name in ("metrics.jsonl", "eval.jsonl"):
        ref_path, path = ref_dir / name, run_dir / name
        if not ref_path.exists():
            if name == "metrics.jsonl":
                raise FileNotFoundError(f"{ref_path}: no such file (not a run directory?)")
            continue
        if not path.exists():
            out.append(f"{path}: missing (the reference has {name})")
            continue
        out += mismatches(read_rows(ref_path), read_rows(path), rtol=rtol, atol=atol, name=name)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("run_dirs", nargs="*", type=Path, metavar="RUN_DIR", help="REF_RUN_DIR RUN_DIR")
    p.add_argument("--against", metavar="REV", default=None, help="run REV and this checkout, then compare")
    p.add_argument("--steps", type=int, default=20, help="--against: RL steps of each run (default 20)")
    p.add_argument("--nproc", type=int, default=1, help="--against: processes of each run (default 1)")
    p.add_argument("--override", action="append", default=[], metavar="section.key=value",
                   help="--against: a config override of both runs (repeatable)")
    p.add_argument("--rtol", type=float, default=1e-5, help="relative tolerance (default 1e-5)")
    p.add_argument("--atol", type=float, default=1e-7, help="absolute tolerance (default 1e-7)")
    p.add_argument("--show", type=int, default=20, help="mismatches printed at most (default 20)")
    args = p.parse_args(argv)
    if (args.against is None) != (len(args.run_dirs) == 2) or (args.against is not None and args.run_dirs):
        p.error("give either REF_RUN_DIR RUN_DIR or --against REV (not both)")
    if args.steps < 1 or args.nproc < 1:
        p.error(f"--steps ({args.steps}) and --nproc ({args.nproc}) must be at least 1")
    if args.against is not None:
        return run_against(args.against, steps=args.steps, nproc=args.nproc, overrides=args.override,
                           rtol=args.rtol, atol=args.atol, show=args.show)
    try:
        bad = compare_run_dirs(*args.run_dirs, rtol=args.rtol, atol=args.atol)
    except FileNotFoundError as e:
        p.error(str(e))
    return report(bad, args.run_dirs[0], args.run_dirs[1], rtol=args.rtol, atol=args.atol, show=args.show)


def run_against(rev: str, *, steps: int, nproc: int, overrides: list[str], rtol: float, atol: float, show: int) -> int:
    """Run the default command from `rev` and from this checkout (module docstring) and report."""
    import subprocess
    import tempfile

    from benchmarks.side_by_side import ROOT, run_once

    common = [f"train.steps={steps}", "logging.wandb_mode=disabled", "train.export_hf=false", *overrides]
    with tempfile.TemporaryDirectory(prefix="metrics_match_") as tmp:
        tree = Path(tmp) / "ref_tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(tree), rev], check=True)
        try:
            for name, src in (("ref", tree), ("new", ROOT)):
                print(f"running {steps} steps on {nproc} process(es) from {rev if name == 'ref' else 'this checkout'} ...",
                      flush=True)
                run_once(src, Path(tmp) / name, nproc, common)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
        bad = compare_run_dirs(Path(tmp) / "ref", Path(tmp) / "new", rtol=rtol, atol=atol)
        return report(bad, rev, "this checkout", rtol=rtol, atol=atol, show=show, run_dir=Path(tmp) / "new")


def report(bad: list[str], ref, new, *, rtol: float, atol: float, show: int, run_dir: Path | None = None) -> int:
    """Print the verdict; 0 when `bad` is empty, else 1."""
    run_dir = run_dir if run_dir is not None else Path(new)
    if not bad:
        n = len(read_rows(run_dir / "metrics.jsonl"))
        print(f"match: {n} metrics rows (and eval rows) of {new} equal to {ref}'s within rtol {rtol}, "
              f"atol {atol}, timing keys (perf/*) apart")
        return 0
    print(f"{len(bad)} mismatch(es) of {new} against {ref}:")
    print("\n".join(bad[:show]))
    return 1


if __name__ == "__main__":
    sys.exit(main())
