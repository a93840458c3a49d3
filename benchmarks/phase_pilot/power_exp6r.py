"""Experiment 6R (docs/experiment6r_training.md): the power of a confirmatory test of experiment 6's post-hoc
hypothesis, "GSPO's final reward exceeds GRPO's at N = 16 mini-batches per rollout" (GSPO stalled in 0 of 40 runs,
GRPO in 9), simulated from experiment 6's runs before any run of 6R.

Pilot: experiment 6 (reports/training_exp6/metrics.jsonl.gz; seeds 6000-6039, never reused by 6R). Endpoint: a
run's final reward (mean `reward/mean` over the last 30 of 300 steps), continuous, paired by seed. Test: the
two-sided sign-flip permutation test of the mean paired difference (`analysis.staleness_exploratory.sign_flip_p`;
simulated here with `--flips` fixed sign patterns per seed count, the analysis uses 9999), decided when p <= 0.05
and the mean is > 0. Outcomes are bistable, so a simulated run is a whole observed run: with probability q from the
stalled pool (experiment 6's runs at N = 16 with final reward < 0.9, any method), else from the arm's own solved runs
(final >= 0.9). Arms of one seed are drawn independently (runs of a seed diverge within the first steps). Scenarios:
- "as observed": each arm's 40 runs resampled with replacement (GRPO 9/40 stalled, GSPO 0/40);
- q_GRPO 0.225 (observed) / 0.17 (3/4 of it: the planning scenario) / 0.11 (half) against q_GSPO 0 / 0.05;
- no effect: both arms GRPO's mixture at q 0.17 (the share decided either way is the false-positive rate).
Controls at 10 seeds: zero mismatch (GRPO+R2 vs GRPO at N = 1, experiment 6's runs resampled: a decision is a false
positive) and positive (GRPO with experiment 4's `pos` overrides vs GRPO at N = 4: experiment 4's pos runs against
experiment 6's N = 4 runs, decided when the mean is < 0).

    python -m benchmarks.phase_pilot.power_exp6r                  # ~1 min of CPU; seeded
    python -m benchmarks.phase_pilot.power_exp6r --sims 4000 --seeds 30,40,50
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from analysis.phase_runs import load_phase
from analysis.phase_stats import GRPO, arms
from analysis.staleness import staleness_arms
from benchmarks.phase_pilot.power_training import draw, final

STALL = 0.9
ALPHA = 0.05
GSPO = "gspo-none"
SEEDS = (20, 30, 40, 50, 60)
SCENARIOS = ((0.225, 0.0), (0.17, 0.0), (0.11, 0.0), (0.225, 0.05), (0.17, 0.05))
"""(q_GRPO, q_GSPO) at N = 16."""
CONTROL_SEEDS = 10


def sign_flip_pvalues(d_SN: np.ndarray, num_flips: int, rng) -> np.ndarray:
    """Two-sided sign-flip p of each row's mean (one set of `num_flips` random sign patterns shared by the rows;
    p = (1 + #{|permuted mean| >= |mean|}) / (1 + num_flips), as scipy's randomized `permutation_test`)."""
    signs_FN = rng.choice(np.array([-1.0, 1.0]), size=(num_flips, d_SN.shape[1]))
    obs_S = np.abs(d_SN.mean(axis=1))
    perm_SF = np.abs(d_SN @ signs_FN.T) / d_SN.shape[1]
    hits = (perm_SF >= obs_S[:, None] * (1 - 1e-12)).sum(axis=1)
    return np.where(obs_S == 0, 1.0, (1 + hits) / (1 + num_flips))


def decided(d_SN: np.ndarray, num_flips: int, rng, sign: float = 1.0) -> np.ndarray:
    """Per simulation: the test decides in the claimed direction (`sign` of the mean)."""
    return (sign_flip_pvalues(d_SN, num_flips, rng) <= ALPHA) & (np.sign(d_SN.mean(axis=1)) == sign)


def power_rows(g: np.ndarray, s: np.ndarray, stalled: np.ndarray, seeds, sims: int, flips: int) -> list[str]:
    solved = lambda x: x[x >= STALL]  # noqa: E731
    lines = [f"Power of H1 (GSPO > GRPO at N = 16; sign-flip test of the mean, α 0.05), {sims} simulations per cell",
             "", "| scenario (at N = 16) | " + " | ".join(f"{n} seeds" for n in seeds) + " |",
             "|---" * (len(seeds) + 1) + "|"]
    cells = []
    for n in seeds:
        rng = np.random.default_rng([61, n, 0])
        d = s[rng.integers(0, len(s), (sims, n))] - g[rng.integers(0, len(g), (sims, n))]
        cells.append(decided(d, flips, rng).mean())
    lines.append(f"| as observed (experiment 6's runs resampled: GRPO {int((g < STALL).sum())}/{len(g)} stalled, "
                 f"GSPO {int((s < STALL).sum())}/{len(s)}) | " + " | ".join(f"{c:.2f}" for c in cells) + " |")
    for qg, qs in SCENARIOS:
        cells = []
        for n in seeds:
            rng = np.random.default_rng([61, n, int(1000 * qg), int(1000 * qs)])
            d = draw(rng, solved(s), stalled, qs, (sims, n)) - draw(rng, solved(g), stalled, qg, (sims, n))
            cells.append(decided(d, flips, rng).mean())
        lines.append(f"| q GRPO {qg:.3g}, q GSPO {qs:.2g} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")
    rng = np.random.default_rng([61, 0])
    null = []
    for n in seeds:
        d = draw(rng, solved(g), stalled, 0.17, (sims, n)) - draw(rng, solved(g), stalled, 0.17, (sims, n))
        null.append((sign_flip_pvalues(d, flips, rng) <= ALPHA).mean())
    lines.append("| no effect (both arms GRPO's mixture at q 0.17): decided either way | "
                 + " | ".join(f"{c:.3f}" for c in null) + " |")
    return lines


def control_rows(by6: dict, pos4: np.ndarray, sims: int, flips: int) -> list[str]:
    rng = np.random.default_rng([61, 99])
    shape = (sims, CONTROL_SEEDS)
    g1, r1, g4 = final(by6[GRPO][1]), final(by6["grpo-r2"][1]), final(by6[GRPO][4])
    zero = sign_flip_pvalues(r1[rng.integers(0, len(r1), shape)] - g1[rng.integers(0, len(g1), shape)], flips, rng)
    pos = decided(pos4[rng.integers(0, len(pos4), shape)] - g4[rng.integers(0, len(g4), shape)], flips, rng, -1.0)
    return [f"Controls at {CONTROL_SEEDS} seeds ({sims} simulations): zero mismatch (GRPO+R2 vs GRPO at N = 1, "
            f"experiment 6's runs resampled) decided at α 0.05 in {np.mean(zero <= ALPHA):.3f}; positive (GRPO `pos` "
            f"< GRPO at N = 4; experiment 4's {len(pos4)} pos runs, final {np.round(np.sort(pos4), 2).tolist()}, "
            f"against experiment 6's N = 4 runs) decided in {pos.mean():.3f}."]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.phase_pilot.power_exp6r", description=__doc__.split("\n")[0])
    ap.add_argument("--exp6", default="reports/training_exp6/metrics.jsonl.gz", help="experiment 6's saved metrics")
    ap.add_argument("--exp4", default="reports/phase_middle/metrics.jsonl.gz", help="experiment 4's saved metrics "
                    "(its `pos` arm: the positive control's pilot)")
    ap.add_argument("--sims", type=int, default=2000, help="simulations per cell")
    ap.add_argument("--flips", type=int, default=2000, help="sign patterns per simulated test")
    ap.add_argument("--seeds", default=",".join(map(str, SEEDS)), help="seeds per arm to simulate")
    args = ap.parse_args(argv)
    if args.sims < 1 or args.flips < 99:
        ap.error("--sims must be >= 1 and --flips >= 99")
    try:
        seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--seeds {args.seeds!r}: give comma-separated integers, e.g. 30,40,50")
    if not seeds or min(seeds) < 6:
        ap.error("--seeds: give seed counts >= 6 (fewer pairs cannot reach p < 0.05)")
    by6 = staleness_arms(load_phase(args.exp6))
    pos4 = final(arms(load_phase(args.exp4))[GRPO]["pos"])
    g, s = final(by6[GRPO][16]), final(by6[GSPO][16])
    stalled = np.asarray([r.scores["final_reward"] for m in by6.values() for r in m.get(16, {}).values()
                          if r.scores["final_reward"] < STALL])
    lines = [f"Pilot (experiment 6, seeds 6000-6039) at N = 16: GRPO stalled {int((g < STALL).sum())}/{len(g)}, GSPO "
             f"{int((s < STALL).sum())}/{len(s)}; stalled pool {len(stalled)} runs (any method at N = 16), final reward "
             f"mean {stalled.mean():.3f} (range {stalled.min():.3f}-{stalled.max():.3f}); solved GRPO mean "
             f"{g[g >= STALL].mean():.4f}, solved GSPO mean {s[s >= STALL].mean():.4f}", ""]
    lines += power_rows(g, s, stalled, seeds, args.sims, args.flips) + [""] + control_rows(by6, pos4, args.sims,
                                                                                             args.flips)
    for line in lines:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
