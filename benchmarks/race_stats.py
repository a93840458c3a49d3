"""The race's figures over seeds (`benchmarks.trl_peer_bench`): each side's time to target per seed, the median
over seeds with its percentile-bootstrap CI, and the ratios of the medians of two sides with a CI that resamples
the seeds in pairs (both sides of a seed together).

Sides are named by the keys of a seed's result: `trl` (TRL's `GRPOTrainer`), `ours` (the main job from this
checkout) and `ours_rev` (the main job from another commit, `--ours-rev`). A miss (a side that did not reach
the target in `--max-steps` RL steps) counts as its run time, a lower bound of its time to target.
"""

from __future__ import annotations

import math
import statistics

from benchmarks.race_common import Curve, first_crossing

SIDES = ("trl", "ours_rev", "ours")
"""Every side a seed can run, in the order the race launches them and the summary lists them."""
RATIO_PAIRS = (("ours", "trl"), ("ours_rev", "trl"), ("ours", "ours_rev"))
"""The ratios of medians (numerator, denominator) reported when both sides ran: ours against TRL first (the
race's figure of merit), then the other commit against TRL, then this checkout against the other commit
(after / before)."""


def tail_mean(values: list[float], n: int) -> float:
    """Mean of the last `n` values (NaN when there are none)."""
    tail = values[-n:] if n > 0 else []
    return sum(tail) / len(tail) if tail else float("nan")


def summarize(curve: Curve, target: float, window: int, *, last: int = 40) -> dict:
    """One side's figures at one seed: whether and at which RL step (`step`, 0-based) it reached `target`,
    the time charged to it until then (`time_s`, None for a miss), what it ran, s/RL step up to the target
    (or the end), its set-up time, and the last `last` RL steps' mean reward, entropy and zero-std share."""
    hit = first_crossing(curve.rewards, target, window)
    n = len(curve.rewards) if hit is None else hit + 1
    t = curve.times_s[n - 1] if n else float("nan")
    return {"name": curve.name, "reached": hit is not None, "step": hit, "time_s": t if hit is not None else None,
            "steps_run": len(curve.rewards), "time_run_s": curve.times_s[-1] if curve.times_s else float("nan"),
            "s_per_step": t / n if n else float("nan"), "setup_s": curve.setup_s, "note": curve.note,
            f"reward_last{last}": tail_mean(curve.rewards, last), f"entropy_last{last}": tail_mean(curve.entropy, last),
            f"frac_zero_std_last{last}": tail_mean(curve.frac_zero_std, last)}


def time_or_bound(s: dict) -> float:
    """Time to target; a side that did not reach it counts with the time it ran (a lower bound)."""
    return s["time_s"] if s["reached"] else s["time_run_s"]


def pair_name(num: str, den: str) -> str:
    return f"{num}/{den}"


def compare_seeds(per_seed: list[dict], *, pairs=RATIO_PAIRS) -> dict:
    """Median over seeds of each side's time to target (`out[side]`) and, for each pair of `pairs` whose
    sides both ran, the ratio of their medians (`out["ratios"]["num/den"]`: `median_ratio`, `exact`,
    `ci`, `num_seeds`). A miss counts as its run time, a lower bound of its time; a median is then
    `median_exact` when it does not depend on the misses (the same with them at +inf), else a lower bound.
    The ours/TRL ratio is also at the top level (`ratio_median_time`, `ratio_exact`, `ratio_median_time_ci`,
    `ci_seeds`), as the two-sided race has always written it."""
    out: dict = {}
    for side in SIDES:
        rows = [r[side] for r in per_seed if side in r]
        if rows:
            median = statistics.median(time_or_bound(x) for x in rows)
            out[side] = {"median_time_s": median,
                         "median_exact": statistics.median(x["time_s"] if x["reached"] else math.inf
                                                           for x in rows) == median,
                         "all_reached": all(x["reached"] for x in rows),
                         "median_steps": statistics.median((x["step"] + 1) if x["reached"] else x["steps_run"]
                                                           for x in rows),
                         "median_s_per_step": statistics.median(x["s_per_step"] for x in rows)}
    ci = bootstrap_median_ci(per_seed, pairs=pairs)
    for side in SIDES:
        if side in out:
            out[side]["median_time_ci_s"] = ci[side]
    out["ratios"] = {}
    for num, den in pairs:
        if num in out and den in out:
            name = pair_name(num, den)
            out["ratios"][name] = {"median_ratio": out[num]["median_time_s"] / out[den]["median_time_s"],
                                   "exact": out[num]["median_exact"] and out[den]["median_exact"],
                                   "ci": ci["pairs"][name]["ci"], "num_seeds": ci["pairs"][name]["num_seeds"]}
    main = out["ratios"].get(pair_name("ours", "trl"))
    if main is not None:
        out["ratio_median_time"], out["ratio_exact"] = main["median_ratio"], main["exact"]
        out["ratio_median_time_ci"], out["ci_seeds"] = main["ci"], main["num_seeds"]
    return out


def bootstrap_median_ci(per_seed: list[dict], *, pairs=RATIO_PAIRS, reps: int = 10_000, seed: int = 0,
                        confidence: float = 0.95) -> dict:
    """Percentile-bootstrap CIs over seeds of each side's median time to target (`trl`, `ours`, `ours_rev`:
    [lo, hi] seconds) and of the ratio of the medians of each pair `num/den` of `pairs`
    (`pairs[name]`: `ci`, `num_seeds`), from `reps` resamples of the seeds with replacement drawn from
    `np.random.default_rng(seed)`. A ratio resamples the seeds that ran both of its sides, the same seeds
    for both (the pairing by seed is kept); a miss counts as its run time, as in `compare_seeds`. NaN ends
    with fewer than 2 seeds (a CI from one seed says nothing). `ratio` and `num_seeds` repeat ours/TRL's."""
    import numpy as np

    rng = np.random.default_rng(seed)
    q = [50 * (1 - confidence), 50 * (1 + confidence)]
    nan = [math.nan, math.nan]

    def ci(stat_R) -> list[float]:
        return [float(v) for v in np.percentile(stat_R, q)]

    out: dict = {"trl": list(nan), "ours": list(nan), "ratio": list(nan), "pairs": {}}
    for side in SIDES:
        t = np.array([time_or_bound(r[side]) for r in per_seed if side in r], np.float64)
        if t.size:
            out[side] = ci(np.median(t[rng.integers(0, t.size, (reps, t.size))], axis=1)) if t.size >= 2 else list(nan)
    for num, den in pairs:
        both = [r for r in per_seed if num in r and den in r]
        res = {"ci": list(nan), "num_seeds": len(both)}
        if len(both) >= 2:
            a = np.array([time_or_bound(r[num]) for r in both], np.float64)
            b = np.array([time_or_bound(r[den]) for r in both], np.float64)
            idx_RN = rng.integers(0, len(both), (reps, len(both)))
            res["ci"] = ci(np.median(a[idx_RN], axis=1) / np.median(b[idx_RN], axis=1))
        out["pairs"][pair_name(num, den)] = res
    main = out["pairs"].get(pair_name("ours", "trl"), {"ci": list(nan), "num_seeds": 0})
    out["ratio"], out["num_seeds"] = main["ci"], main["num_seeds"]
    return out


def seed_ratios(res: dict, *, pairs=RATIO_PAIRS) -> dict[str, float]:
    """Ratio of the times to target (a miss: its run time) of each pair whose sides both ran at one seed."""
    return {pair_name(a, b): time_or_bound(res[a]) / time_or_bound(res[b])
            for a, b in pairs if a in res and b in res}


def seed_table(per_seed: list[dict], summary: dict, labels: dict[str, str]) -> list[str]:
    """The race as a table, one row per seed then the medians with their CIs: each side's seconds to target
    (RL steps; `*` a miss, its run time) and the per-seed ratios; `labels` names the sides."""
    sides = [s for s in SIDES if any(s in r for r in per_seed)]
    ratios = [name for name in summary.get("ratios", {})]
    head = ["seed", *(labels[s] for s in sides), *ratios]
    rows = [head]
    for r in per_seed:
        cells = [str(r["seed"])]
        for s in sides:
            x = r.get(s)
            cells.append("-" if x is None else f"{time_or_bound(x):.1f}{'' if x['reached'] else '*'} "
                         f"({(x['step'] + 1) if x['reached'] else x['steps_run']})")
        ratio = seed_ratios(r)
        cells += [f"{ratio[n]:.2f}" if n in ratio else "-" for n in ratios]
        rows.append(cells)
    med = ["median"]
    for s in sides:
        x = summary[s]
        lo, hi = x["median_time_ci_s"]
        med.append(f"{x['median_time_s']:.1f} [{lo:.1f}, {hi:.1f}]")
    for n in ratios:
        x = summary["ratios"][n]
        lo, hi = x["ci"]
        med.append(f"{x['median_ratio']:.2f} [{lo:.2f}, {hi:.2f}]" + ("" if x["exact"] else " (bound)"))
    rows.append(med)
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in rows]
