"""Recompute the corrections to experiments 1-2 that docs/paper_claims.md states, from their committed metrics:
the failure counts without the pilot-reused seeds 0-1, the Holm-adjusted p over the 9 primary tests alone, the runs
the end-of-run fix of the detector adds, the final reward of stalled against non-stalled GRPO runs, and the counts at
other stall thresholds.

    python -m benchmarks.phase_pilot.recheck_experiments_1_2
"""

from __future__ import annotations

import dataclasses

import numpy as np

from analysis import stats as st
from analysis.claims_runs import load_arms, load_runs
from analysis.claims_stats import claim_family, failure_rate
from analysis.phase_runs import FAILURE_V2
from analysis.seed_report import reward_and_zero_std
from moe_gspo.algos.collapse import FailureCriteria, detect_failure

SOURCES = {"experiment 1": "reports/unstable/metrics.jsonl.gz", "experiment 2": "reports/unstable_lr2e3/metrics.jsonl.gz"}


def _seed(run) -> int:
    return int(run.source.name.rsplit("-s", 1)[1])


def main() -> None:
    for name, src in SOURCES.items():
        runs = load_runs(src)
        arms, later = load_arms(runs), load_arms([r for r in runs if _seed(r) >= 2])
        print(f"== {name} ({src})")
        for arm in arms:
            print(f"  {arm:22s} all seeds {st.fmt_rate(failure_rate(arms[arm])):30s} seeds 2-9 "
                  f"{st.fmt_rate(failure_rate(later[arm]))}")
        tests = claim_family(arms, 2000, 0)
        primary = [t for t in tests if t.label.endswith("time to failure")]
        print(f"  Holm family in the code: {len(tests)} tests; primary (log-rank) alone: {len(primary)}")
        for t, p in zip(primary, st.holm([t.p for t in primary])):
            print(f"    {t.label:58s} p {st.fmt_p(t.p):6s} Holm({len(primary)}) {st.fmt_p(p):6s} "
                  f"Holm({len(tests)}) {st.fmt_p(t.p_holm)}")
        final = {"stalled": [], "not": []}
        for r in runs:
            reward, zero = reward_and_zero_std(r)
            keep = np.isfinite(reward)
            v1, v2 = detect_failure(reward[keep], zero[keep]), detect_failure(reward[keep], zero[keep], FAILURE_V2)
            if (v1.kind is None) != (v2.kind is None):
                print(f"  end-of-run fix adds {r.source.name}: {v2.kind} at step {v2.step}, final "
                      f"{reward[keep][-max(1, keep.sum() // 10):].mean():.2f}")
            if r.source.name.startswith("grpo-"):
                final["stalled" if v1.kind == "stall" else "not"].append(reward[keep][-max(1, keep.sum() // 10):].mean())
        print(f"  GRPO final reward, stalled {np.mean(final['stalled']):.2f} (n={len(final['stalled'])}) vs not "
              f"{np.mean(final['not']):.2f} (n={len(final['not'])}), Mann-Whitney p "
              f"{st.fmt_p(st.mannwhitney_p(final['stalled'], final['not']))}")
        for enter in (0.85, 0.95):
            c = dataclasses.replace(FailureCriteria(), stall_enter=enter)
            counts = {}
            for r in runs:
                reward, zero = reward_and_zero_std(r)
                keep = np.isfinite(reward)
                arm = r.source.name.rsplit("-s", 1)[0]
                counts[arm] = counts.get(arm, 0) + (detect_failure(reward[keep], zero[keep], c).kind is not None)
            print(f"  stall threshold {enter}: " + ", ".join(f"{a} {k}" for a, k in sorted(counts.items())))


if __name__ == "__main__":
    main()
