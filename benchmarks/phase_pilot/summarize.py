"""One line per finished pilot run of issue 47's phase pilots: final reward, reward AUC, failure (experiment 3's
detector), entropy collapse, realised per-layer flips and k3 (mean over the run; first and last 50 steps).

    python -m benchmarks.phase_pilot.summarize runs/phase_pilot_default runs/phase_pilot_regime [...]
"""

from __future__ import annotations

import sys

import numpy as np

from analysis.load import series
from analysis.phase_runs import load_runs, phase_run


def _k3_ends(run) -> tuple[float, float]:
    k3 = series(run.records, "mismatch/k3_kl")[1]
    return (float(np.nanmean(k3[:50])), float(np.nanmean(k3[-50:]))) if k3.size else (float("nan"),) * 2


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    print("| run | steps | final reward | reward AUC | failed | entropy collapse | per-layer flips | k3 mean "
          "(first 50 / last 50 steps) |")
    print("|---|---|---|---|---|---|---|---|")
    for source in argv:
        for run in load_runs(source):
            p = phase_run(run)
            if p is None:
                continue
            s = p.scores
            k3a, k3b = _k3_ends(run)
            print(f"| {p.name} | {int(s['num_steps'])} | {s['final_reward']:.3f} | {s['reward_auc']:.3f} | "
                  f"{'yes (step %d)' % p.failure_step if p.failed else 'no'} | "
                  f"{'step %d' % p.collapse_step if p.collapsed else 'no'} | {s['layer_disagree']:.4f} | "
                  f"{s['k3']:.1e} ({k3a:.1e} / {k3b:.1e}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
