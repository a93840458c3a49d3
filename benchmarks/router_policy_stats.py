"""The router-policy ablation's effect on routing drift, paired by seed with Holm's correction (issue 41).

    python -m moe_gspo.ablate configs/ablation_router_policy.yaml
    python -m benchmarks.router_policy_stats runs/ablation_router_policy [--reps 10000]

Per run (`<algo>-<replay>-<variant>-s<seed>`): run means of `update/expert_change_frac` (old vs new policy
after one optimizer step; step 0, Adam's first step, left out), `routing/layer_disagree` (rollout vs learner,
mean over MoE layers), `routing/any_layer_flip` and `mismatch/k3_kl`. Each variant against `base`, paired by
`train.seed` (a variant named `X_<level>` against the variant `<level>` when there is one, e.g. `frozen_fp8`
against `fp8`; every other variant against `base`): the mean of the per-seed differences with a 95% bootstrap CI (its own stream per quantity and
variant, `analysis.stats`) and a paired t-test (scipy's `ttest_rel`; with 5 seeds the exact Wilcoxon test
cannot reach p < 0.05, its smallest two-sided p is 1/16), Holm-adjusted over every test of the table.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections import defaultdict
from pathlib import Path

import numpy as np
from scipy import stats as sps

from analysis import stats as st

QUANTITIES = {
    "update/expert_change_frac": "experts changed per optimizer step (old vs new)",
    "routing/layer_disagree": "rollout vs learner flips per MoE layer",
    "routing/any_layer_flip": "rollout vs learner flips in >= 1 layer",
    "mismatch/k3_kl": "rollout vs learner k3 KL",
}
_RUN_RE = re.compile(r"^(?P<arm>.+)-(?P<variant>[A-Za-z0-9_.]+)-s(?P<seed>\d+)$")


def run_means(metrics_path: Path) -> dict[str, float]:
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    out = {}
    for key in QUANTITIES:
        vals = []
        for r in rows:
            v = r.get(key)
            if key == "update/expert_change_frac" and r.get("step", 0) == 0:
                continue
            if isinstance(v, list):
                v = float(np.mean(v)) if v else None
            if v is not None and math.isfinite(v):
                vals.append(float(v))
        out[key] = float(np.mean(vals)) if vals else math.nan
    return out


def load(runs_dir: Path) -> dict[str, dict[int, dict[str, float]]]:
    """{variant: {seed: run means}} of the finished runs (done.json) under `runs_dir`."""
    variants: dict[str, dict[int, dict[str, float]]] = defaultdict(dict)
    for d in sorted(runs_dir.iterdir()):
        m = _RUN_RE.match(d.name)
        if m and (d / "done.json").exists() and (d / "metrics.jsonl").exists():
            variants[m["variant"]][int(m["seed"])] = run_means(d / "metrics.jsonl")
    return dict(variants)


def reference(variant: str, variants, base: str = "base") -> str:
    """What `variant` is compared with: the variant `<level>` for a variant `X_<level>` when `<level>` ran
    (`frozen_fp8` against `fp8`), else `base` (`fp8` itself against `base`: the drift level's own effect)."""
    level = variant.rsplit("_", 1)[-1]
    if "_" in variant and level in variants and level != base:
        return level
    return base


def table(variants: dict[str, dict[int, dict[str, float]]], reps: int = st.DEFAULT_REPS, base: str = "base") -> str:
    if base not in variants:
        raise ValueError(f"no finished '{base}' runs to compare against; found variants {sorted(variants)}")
    rows, pvals = [], []
    for variant in [v for v in variants if v != base]:
        ref = reference(variant, variants, base)
        seeds = sorted(set(variants[variant]) & set(variants[ref]))
        for key in QUANTITIES:
            a = np.array([variants[variant][s][key] for s in seeds])
            b = np.array([variants[ref][s][key] for s in seeds])
            ok = np.isfinite(a) & np.isfinite(b)
            d = a[ok] - b[ok]
            est = st.bootstrap_ci(d, how="mean", reps=reps, seed=st.stream_seed(0, key, variant, ref))
            p = float(sps.ttest_rel(a[ok], b[ok]).pvalue) if d.size >= 2 and np.ptp(d) > 0 else math.nan
            rows.append([f"{variant} vs {ref}", QUANTITIES[key], f"{np.mean(b[ok]):.3g}", f"{np.mean(a[ok]):.3g}",
                         st.fmt_ci(est), str(int(ok.sum()))])
            pvals.append(p)
    adjusted = st.holm(pvals)
    lines = ["| variant vs reference | quantity | reference (mean) | variant (mean) | variant − reference, paired [95% CI] | seeds | p (paired t) "
             "| Holm-adjusted p | verdict |", "|---|---|---|---|---|---|---|---|---|"]
    for row, p, hp in zip(rows, pvals, adjusted):
        verdict = ("differs" if hp < st.ALPHA else "not decided") if math.isfinite(hp) else "not tested"
        lines.append("| " + " | ".join(row + [st.fmt_p(p), st.fmt_p(hp), verdict]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.router_policy_stats", description=__doc__.split("\n\n")[0])
    ap.add_argument("runs_dir", type=Path, help="the ablation's out_dir (runs/ablation_router_policy)")
    ap.add_argument("--reps", type=int, default=st.DEFAULT_REPS, help="bootstrap resamples")
    args = ap.parse_args(argv)
    if not args.runs_dir.is_dir():
        ap.error(f"{args.runs_dir} is not a directory; run python -m moe_gspo.ablate configs/ablation_router_policy.yaml")
    try:
        print(table(load(args.runs_dir), args.reps))
    except ValueError as e:
        ap.error(str(e))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
