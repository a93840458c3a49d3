"""Experiment 6 (docs/experiment6_training.md): the power and the CPU cost of the candidate training experiments that
link the mechanism (`analysis.mechanism`) to outcomes, simulated from committed pilot data before any run.

Pilot: 3S (reports/phase_staleness/metrics.jsonl.gz; seeds 1000-1004, GRPO, GRPO+R2 and GSPO at N = 1, 4, 16
mini-batches per rollout, zero drift, 300 steps) and experiment 3's stalled GRPO runs (reports/phase/). Those seeds
are pilot seeds: experiment 6 never reuses them.

Endpoint: a run's final reward, the mean `reward/mean` over its last 10% of steps (the last 30 of 300;
`analysis.phase_runs`), continuous. Outcomes are bistable (a run solves, ~0.998, or stalls, ~0.67-0.78), so a
simulated run is a whole observed run: from the stalled pool (3S's and experiment 3's GRPO runs with final reward
< 0.9) with probability q, else from the arm's own solved runs (final >= 0.9) at its N. Scenarios:
- "as observed": each arm's five 3S runs resampled with replacement (post hoc, likely optimistic: 2/5 GRPO stalls);
- q_GRPO at N = 16 of 0.4 / 0.3 / 0.2 (the pilot's 2/5 and smaller) against the fixes' q of 0 / 0.1 (the pilot's
  0/5 at N = 16; R2 stalled 1/5 at N = 4).
Arms of one seed are drawn independently (the runs of one seed diverge within the first steps: 3S's GRPO+R2 at
N = 1, a float-level perturbation of GRPO at N = 1, ends 0.69 vs 0.66 and 0.77 vs 0.84 on two seeds), and analysed
paired by seed: two-sided Wilcoxon signed-rank, zeros dropped (scipy's normal approximation, vectorised; the
analysis, `analysis.stats.wilcoxon_p`, uses the permutation null: within ~0.01 of it at 30 pairs), decided the
claimed way when the IQM of the differences is > 0. Power: the share of simulations in which Holm at family-wise
α = 0.05 over the family (H1 GRPO+R2 vs GRPO, H2 GSPO vs GRPO, both at N = 16) rejects each test, and both.

Cost: CPU-minutes per 300-step run from the committed 3S record (45 runs, nproc 1, two at a time on the 2-core
box, 16:47-18:32 UTC: 210 slot-minutes, 4.7 per run, mixed N) times a per-N factor (`N_COST`: CPU time per step
relative to N = 4, measured with OMP_NUM_THREADS=1 on the contended box: docs/experiment6_training.md, "Budget").

    python -m benchmarks.phase_pilot.power_training                 # ~1 min; seeded
    python -m benchmarks.phase_pilot.power_training --sims 4000 --seeds 10,20,30,40
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
from scipy.stats import trim_mean, wilcoxon

from analysis.phase_runs import load_phase
from analysis.phase_stats import GRPO, DIAL_DOSE, arms
from analysis.staleness import load_runs as load_staleness, staleness_arms

STALL = 0.9
ALPHA = 0.05
FIXES = ("grpo-r2", "gspo-none")
"""The family's comparisons against GRPO at N = 16 (H1, H2), in order."""
N_LARGE = 16
SCENARIOS = ((0.4, 0.0), (0.3, 0.0), (0.2, 0.0), (0.4, 0.1), (0.3, 0.1))
"""(q_GRPO, q_fix) at N = 16."""
SEEDS = (10, 15, 20, 25, 30, 40, 50, 60)
MIN_PER_RUN = 210 / 45
"""3S's CPU-minutes per 300-step run (mixed N), the committed record's 105 min x 2 slots / 45 runs."""
N_COST = {1: 0.70, 4: 1.0, 16: 1.21}
"""CPU time per step relative to N = 4 (docs/experiment6_training.md, "Budget": 10- and 40-step runs per N)."""
CPU_S_PER_STEP = {1: 0.284, 4: 0.405, 16: 0.489}
"""Measured CPU seconds per step (user + sys, 40-step minus 10-step runs / 30, OMP_NUM_THREADS=1, 3S's overrides,
contended box), and per run a start-up of ~12 CPU-seconds."""
START_S = 12.0
CONTROL_SEEDS = 10
CHOSEN_SEEDS = 40
"""Experiment 6's seeds per primary arm (docs/experiment6_training.md: power >= 0.8 for both tests at 3/4 of the
pilot's stall rate, within the 15-hour budget)."""
"""Seeds of the control arms (zero mismatch: R2 vs GRPO at N = 1; positive: GRPO at N = 4 vs N = 1)."""


def pilot(phase_source: str, staleness_source: str):
    """(3S's arms: method -> N -> seed -> run, the stalled pool's final rewards)."""
    st = staleness_arms(load_phase(load_staleness(staleness_source)))
    by = arms(load_phase(phase_source))
    stalled = [r.scores["final_reward"] for d, arm in by[GRPO].items() if DIAL_DOSE.match(d) for r in arm.values()
               if r.scores["final_reward"] < STALL]
    stalled += [r.scores["final_reward"] for m in st.values() for arm in m.values() for r in arm.values()
                if r.scores["final_reward"] < STALL]
    return st, np.asarray(stalled)


def final(arm) -> np.ndarray:
    return np.asarray([r.scores["final_reward"] for _, r in sorted(arm.items())])


def draw(rng, solved: np.ndarray, stalled: np.ndarray, q: float, shape) -> np.ndarray:
    s = solved[rng.integers(0, len(solved), shape)]
    f = stalled[rng.integers(0, len(stalled), shape)]
    return np.where(rng.random(shape) < q, f, s)


def pvalues(d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(two-sided Wilcoxon p, claimed direction: IQM > 0) per row of d [sims, n]; p = 1 when all differences are 0."""
    zero = (d == 0).all(axis=1)
    p = wilcoxon(np.where(zero[:, None], 1.0, d), axis=1, method="approx", zero_method="wilcox").pvalue
    return np.where(zero, 1.0, np.nan_to_num(p, nan=1.0)), trim_mean(d, 0.25, axis=1) > 0


def holm_power(d1: np.ndarray, d2: np.ndarray) -> tuple[float, float, float]:
    """(P(H1 rejected), P(H2 rejected), P(both)) by Holm over the two, each also in its claimed direction."""
    (p1, up1), (p2, up2) = pvalues(d1), pvalues(d2)
    lo, hi = np.minimum(p1, p2), np.maximum(p1, p2)
    first = lo <= ALPHA / 2
    r1 = ((p1 <= ALPHA / 2) | (first & (p1 <= ALPHA))) & up1
    r2 = ((p2 <= ALPHA / 2) | (first & (p2 <= ALPHA))) & up2
    return float(r1.mean()), float(r2.mean()), float((r1 & r2).mean())


def power_rows(st, stalled, seeds, sims) -> list[str]:
    g = final(st[GRPO][N_LARGE])
    fixes = [final(st[f][N_LARGE]) for f in FIXES]
    solved = lambda x: x[x >= STALL]  # noqa: E731
    head = ["| scenario (at N = 16) | " + " | ".join(f"{n} seeds" for n in seeds) + " |", "|---" * (len(seeds) + 1) + "|"]
    lines = ["Power: H1 (GRPO+R2 > GRPO) / H2 (GSPO > GRPO) / both, Holm at family-wise α 0.05, "
             f"{sims} simulations per cell; endpoint final reward (mean of the last 30 of 300 steps)", ""] + head
    cells = []
    for n in seeds:
        rng = np.random.default_rng([6, n, 0])
        a = g[rng.integers(0, len(g), (sims, n))]
        d = [f[rng.integers(0, len(f), (sims, n))] - a for f in fixes]
        cells.append(holm_power(*d))
    lines.append("| as observed (3S's runs resampled: GRPO 2/5 stalled, fixes 0/5) | "
                 + " | ".join(f"{c[0]:.2f} / {c[1]:.2f} / {c[2]:.2f}" for c in cells) + " |")
    for qg, qf in SCENARIOS:
        cells = []
        for n in seeds:
            rng = np.random.default_rng([6, n, int(100 * qg), int(100 * qf)])
            a = draw(rng, solved(g), stalled, qg, (sims, n))
            d = [draw(rng, solved(f), stalled, qf, (sims, n)) - a for f in fixes]
            cells.append(holm_power(*d))
        lines.append(f"| q GRPO {qg:.1f}, q fixes {qf:.1f} | "
                     + " | ".join(f"{c[0]:.2f} / {c[1]:.2f} / {c[2]:.2f}" for c in cells) + " |")
    # no effect: every arm GRPO's own mixture (the share decided is the false-positive rate)
    rng = np.random.default_rng([6, 0, 0])
    n = seeds[len(seeds) // 2]
    a = draw(rng, solved(g), stalled, 0.3, (sims, n))
    null = holm_power(*(draw(rng, solved(g), stalled, 0.3, (sims, n)) - a for _ in FIXES))
    lines += ["", f"No effect (all arms GRPO's mixture, q 0.3, {n} seeds): decided H1 {null[0]:.3f}, H2 {null[1]:.3f} "
              "(claimed direction only)."]
    return lines


def control_rows(st, sims) -> list[str]:
    """The controls at CONTROL_SEEDS seeds, 3S's runs resampled: zero mismatch (R2 vs GRPO at N = 1: any
    difference decided at α 0.05 is a false positive) and positive (GRPO at N = 4 vs N = 1)."""
    rng = np.random.default_rng([6, 99])
    shape = (sims, CONTROL_SEEDS)
    g1, r1, g4 = (final(st[m][n]) for m, n in ((GRPO, 1), ("grpo-r2", 1), (GRPO, 4)))
    p0, _ = pvalues(r1[rng.integers(0, 5, shape)] - g1[rng.integers(0, 5, shape)])
    pp, up = pvalues(g4[rng.integers(0, 5, shape)] - g1[rng.integers(0, 5, shape)])
    return [f"Controls at {CONTROL_SEEDS} seeds (3S's runs resampled, {sims} simulations): zero mismatch (R2 vs GRPO at "
            f"N = 1) decided at α 0.05 in {np.mean(p0 <= ALPHA):.3f}; positive control (GRPO N = 4 > N = 1) decided "
            f"in {np.mean((pp <= ALPHA) & up):.3f}."]


def cost_rows(seeds) -> list[str]:
    """Per design size: the slot-hours 3S's record implies (contention included: an upper bound) and the measured
    CPU time (a lower bound)."""
    scale = MIN_PER_RUN / np.mean([N_COST[n] for n in (1, 4, 16)])  # 3S ran 15 runs at each N
    slot = {n: scale * f for n, f in N_COST.items()}
    cpu = {n: (300 * s + START_S) / 60 for n, s in CPU_S_PER_STEP.items()}
    lines = [f"Cost per 300-step run, minutes: 3S's record (slot-minutes on the shared box) N = 1 {slot[1]:.1f}, N = 4 "
             f"{slot[4]:.1f}, N = 16 {slot[16]:.1f}; measured CPU time N = 1 {cpu[1]:.1f}, N = 4 {cpu[4]:.1f}, "
             f"N = 16 {cpu[16]:.1f}", "",
             f"| seeds per primary arm | runs (3 primary arms at N = 16 + controls: 3 arms at {CONTROL_SEEDS} seeds) "
             "| hours by 3S's record | CPU-hours measured | wall, two at a time, by 3S's record |", "|---|---|---|---|---|"]
    for n in seeds:
        runs = 3 * n + 3 * CONTROL_SEEDS
        hours = lambda per: (3 * n * per[16] + CONTROL_SEEDS * (2 * per[1] + per[4])) / 60  # noqa: E731
        lines.append(f"| {n} | {runs} | {hours(slot):.1f} | {hours(cpu):.1f} | {hours(slot) / 2:.1f} |")
    return lines


def other_design_rows() -> list[str]:
    """The other candidates of issue 58, costed: neither has pilot data from which to simulate its power, so each
    needs a pilot first; their confirmatory sizes are the staleness design's seed count scaled as stated."""
    per4 = MIN_PER_RUN
    n = CHOSEN_SEEDS
    # (a) staleness x drift crossover: R2 vs R3 at N = 2 and 8, dial p = 0 and 0.2: 8 arms; the claim is an interaction
    # (R2 - R3 changes sign between N = 2 and 8): at the same effect size, ~4x the seeds of a main effect.
    cross_pilot = 8 * 5 * per4 * 1.1 / 60
    cross = 8 * 4 * n * per4 * 1.1 / 60
    # (b) length ladder: GRPO vs GSPO at responses of 16, 32, 64 tokens (2 MoE layers); CPU per run ~ proportional to
    # the response tokens (3S's 9-13 tokens: ~11 on average); the estimate at 64 tokens on 8 MoE layers is
    # ~95 min per run.
    per_len = {L: per4 * L / 11 for L in (16, 32, 64)}
    ladder_pilot = 2 * 5 * sum(per_len.values()) / 60
    ladder = 2 * n * sum(per_len.values()) / 60
    return ["Other candidates (no pilot data: power cannot be simulated before a pilot; costs scaled from 3S's "
            f"{per4:.2f} CPU-minutes per run):", "",
            "| design | arms | pilot (5 seeds per arm), CPU-hours | confirmatory at the staleness design's effect size, "
            "CPU-hours |", "|---|---|---|---|",
            f"| staleness x drift crossover: R2 vs R3 at N = 2 / 8, p = 0 / 0.2 (an interaction: ~4 x {n} seeds) | 8 | "
            f"{cross_pilot:.1f} | {cross:.0f} |",
            f"| length ladder: GRPO vs GSPO at L = 16 / 32 / 64 ({n} seeds; CPU per run x L/11) | 6 | {ladder_pilot:.1f} | "
            f"{ladder:.0f} |"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.phase_pilot.power_training", description=__doc__.split("\n")[0])
    ap.add_argument("--phase", default="reports/phase/metrics.jsonl.gz", help="experiment 3's saved metrics")
    ap.add_argument("--staleness", default="reports/phase_staleness/metrics.jsonl.gz", help="3S's saved metrics")
    ap.add_argument("--sims", type=int, default=2000, help="simulations per cell")
    ap.add_argument("--seeds", default=",".join(map(str, SEEDS)), help="seeds per primary arm to simulate")
    args = ap.parse_args(argv)
    if args.sims < 1:
        ap.error("--sims must be >= 1")
    try:
        seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--seeds {args.seeds!r}: give comma-separated integers, e.g. 10,20,30")
    if not seeds or min(seeds) < 6:
        ap.error("--seeds: give seed counts >= 6 (fewer pairs cannot reach p < 0.05)")
    st, stalled = pilot(args.phase, args.staleness)
    pil = {f"{m} N={n}": final(st[m][n]) for m in (GRPO, *FIXES) for n in (1, 4, 16)}
    lines = ["Pilot (3S, seeds 1000-1004), final reward per seed: " + "; ".join(
        f"{k} {np.round(v, 3).tolist()}" for k, v in pil.items()),
        f"Stalled pool: {len(stalled)} runs, final reward mean {stalled.mean():.3f} (range {stalled.min():.3f}-"
        f"{stalled.max():.3f})", ""]
    lines += power_rows(st, stalled, seeds, args.sims) + [""] + control_rows(st, args.sims) + [""] + cost_rows(seeds)
    lines += [""] + other_design_rows()
    for line in lines:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
