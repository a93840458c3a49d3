"""`python -m analysis.mechanism_tests MECHANISM.jsonl[.gz] --out tests.md`: experiment 5's pre-registered tests
(docs/paper_claims.md, "Experiment 5, the mechanism matrix"), recomputed from the committed rows of
`analysis.mechanism`.

The unit of replication is the seed (the tiny model's init and the rollouts' seed): every method, dose, length,
depth and staleness index k measured on one seed is one paired observation of that seed, and rows within a seed are
correlated (they share a model and a rollout), so no test pools them. Per seed and endpoint (`ENDPOINTS`), one number:
the exponent of a metric against one grid axis. The metric is first averaged into cells (per setting over the
mini-batch index k, or per k over the settings for an exponent on k: the step's mean relative error), then the
exponent is the slope of an ordinary least-squares fit (statsmodels) of log(cell mean) on log(axis) with fixed
effects for the other setting axes that vary (`C(length)`, `C(depth)`, `C(dose)`); a difference endpoint is the
difference of two methods' exponents on the same seed. Across seeds: a
one-sample t-test of the per-seed values against 0 (two-sided, scipy), its 95% t CI, and Holm's adjustment over the
primary family (statsmodels `multipletests`). A test is decided when its Holm-adjusted p is below 0.05; its verdict
then says whether the exponent has the claimed sign. A sensitivity fit pools the seeds (seed fixed effects,
cluster-robust standard errors by seed, t with G - 1 degrees of freedom). The checks (`checks`) are properties the
instrument has by construction (the zero-mismatch controls): they must hold, and are not tests.

Writes `--out` (default: tests.md beside the rows) through a temporary file and a rename; the same rows give the same
bytes. `--figure PNG` also draws the per-method error against k, length and depth (`analysis.mechanism_figures`).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from analysis.stats import one_sample

ALPHA = 0.05
AXES = ("length", "depth", "dose", "k")


@dataclass(frozen=True, kw_only=True)
class Endpoint:
    """One per-seed endpoint: the exponent of `metric` of `method` against `against` (minus `minus`'s, if given)."""

    id: str
    """The test's name in the family (PC, T1, ...)."""
    claim: str
    """The hypothesis, in words, with its direction."""
    method: str
    """The method whose rows give the metric (`analysis.mechanism_step.METHODS`)."""
    metric: str
    """A column of the rows (e.g. `grad_err_routing`)."""
    against: str
    """The grid axis of the exponent: length, depth, dose (doses > 0 only) or k."""
    minus: str | None = None
    """A second method: the endpoint is method's exponent minus this one's, paired by seed."""
    min_k: int = 1
    """The rows used have k >= this (1: after the first update, where the routes have moved)."""
    primary: bool = True
    """In the Holm family (else reported with its CI, not tested)."""
    sesoi: float = 0.25
    """The smallest effect of interest (an exponent): the power target, and a CI inside +-sesoi reads "no exponent
    as large as this, either way"."""


ENDPOINTS = (
    Endpoint(id="PC", method="grpo+r3", metric="grad_err_routing", against="dose", min_k=0,
             claim="positive control: a dose that flips more routes moves R3's gradient (which replays them) further "
                   "from R2's: exponent on the dose > 0"),
    Endpoint(id="T1", method="grpo", metric="grad_err_routing", against="length",
             claim="GRPO's routing-induced gradient error grows with the response length: exponent > 0"),
    Endpoint(id="T2", method="grpo", metric="grad_err_routing", against="depth", primary=False,
             claim="GRPO's routing-induced gradient error grows with the MoE depth: exponent > 0 (secondary: the "
                   "pilot's seeds spread too much for a decision within the budget)"),
    Endpoint(id="T3", method="grpo-noclip", minus="gspo-noclip", metric="grad_err_routing", against="length", sesoi=0.1,
             claim="GSPO's error grows less with length than GRPO's (both unclipped): GRPO's exponent minus GSPO's > 0"),
    Endpoint(id="T4", method="grpo-noclip", minus="gspo-noclip", metric="grad_err_routing", against="depth", sesoi=0.1,
             claim="GSPO's error grows less with depth than GRPO's (both unclipped): GRPO's exponent minus GSPO's > 0"),
    Endpoint(id="T5", method="grpo", metric="grad_err_routing", against="k",
             claim="staleness: GRPO's error (the part R2 removes) grows with the mini-batch index k: exponent > 0"),
    Endpoint(id="T6", method="grpo+tis", metric="grad_err_tis_vs_grpo", against="dose", min_k=0,
             claim="the dial reaches the gradient through TIS: TIS moves GRPO's gradient more at a higher dose: "
                   "exponent on the dose > 0"),
    Endpoint(id="S1", method="grpo", metric="grad_err_routing", against="dose", primary=False, sesoi=0.1,
             claim="the dial reaches GRPO's gradient only through sampling: GRPO's routing error barely depends on "
                   "the dose (exponent within +-0.1)"),
    Endpoint(id="S2", method="grpo", minus="gspo", metric="grad_err_routing", against="length", primary=False,
             claim="as trained (clipped; GSPO's clip takes most sequences at this lr): GRPO's length exponent minus "
                   "GSPO's"),
    Endpoint(id="S3", method="grpo", metric="experts_changed", against="k", primary=False,
             claim="experts changed since pi_old grow with k (the shared update path's routing change)"),
)
"""Experiment 5's endpoints, in listing order (the primary family, Holm: PC, T1, T3-T6; T2 and S1-S3 secondary,
descriptive)."""


def load_rows(path: str | Path) -> list[dict]:
    """The rows of `analysis.mechanism` (mechanism.jsonl, gzip'd or not)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{p} is not a file; give the mechanism.jsonl(.gz) that python -m analysis.mechanism wrote")
    opener = gzip.open if p.suffix == ".gz" else open
    with opener(p, "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if not rows or "method" not in rows[0] or "seed" not in rows[0]:
        raise ValueError(f"{p} holds no rows of analysis.mechanism (each needs 'method', 'seed', 'k', ...)")
    return rows


def _frame(rows: list[dict]):
    import pandas as pd

    return pd.DataFrame(rows)


def _fit_rows(df, e: Endpoint, method: str):
    d = df[(df["method"] == method) & (df["k"] >= e.min_k)]
    if e.metric not in d:
        return d.iloc[0:0]
    if e.against == "dose":
        d = d[d["dose"] > 0]
    if e.against == "k":
        d = d[d["k"] > 0]
    vals = d[e.metric].astype(float)
    return d[np.isfinite(vals) & (vals > 0)]


def _cells(d, e: Endpoint, keep=()):
    """The metric averaged into cells: per setting (length, depth, dose) over k for an exponent on a setting axis, per
    k over the settings for one on k (and per `keep` column too); the step's mean relative error, robust to the rows
    where no route of the mini-batch changed (an error at float level, whose log would dominate a row-level fit)."""
    by = (["k"] if e.against == "k" else ["length", "depth", "dose"]) + list(keep)
    return d.groupby(by, as_index=False)[e.metric].mean()


def _formula(d, e: Endpoint, extra: str = "") -> str | None:
    if d[e.against].nunique() < 2:
        return None
    fixed = [c for c in AXES if c != e.against and c in d and d[c].nunique() > 1]
    return f"np.log({e.metric}) ~ np.log({e.against})" + "".join(f" + C({c})" for c in fixed) + extra


def seed_exponent(df, e: Endpoint, method: str) -> float:
    """The exponent of one seed's rows (`df`) of `method`: the OLS slope of the log cell means (`_cells`) on
    log(axis), fixed effects for the other setting axes; nan when the axis does not vary."""
    import statsmodels.formula.api as smf

    d = _fit_rows(df, e, method)
    d = _cells(d, e) if len(d) else d
    formula = _formula(d, e) if len(d) else None
    if formula is None:
        return math.nan
    res = smf.ols(formula, data=d).fit()
    return float(res.params[f"np.log({e.against})"])


def per_seed(rows: list[dict], endpoints=ENDPOINTS) -> dict[str, dict[int, float]]:
    """{endpoint id: {seed: its value}} (nan where a seed's rows cannot give it)."""
    df = _frame(rows)
    out: dict[str, dict[int, float]] = {}
    for e in endpoints:
        vals = {}
        for seed, g in df.groupby("seed", sort=True):
            v = seed_exponent(g, e, e.method)
            if e.minus is not None:
                v -= seed_exponent(g, e, e.minus)
            vals[int(seed)] = v
        out[e.id] = vals
    return out


def holm(pvalues: list[float]) -> list[float]:
    """Holm-adjusted p-values (statsmodels); a nan p (not testable) stays nan and is left out of the family."""
    from statsmodels.stats.multitest import multipletests

    idx = [i for i, p in enumerate(pvalues) if math.isfinite(p)]
    out = [math.nan] * len(pvalues)
    if idx:
        adj = multipletests([pvalues[i] for i in idx], alpha=ALPHA, method="holm")[1]
        for i, a in zip(idx, adj):
            out[i] = float(a)
    return out


def verdict(stat: dict, p_holm: float) -> str:
    if not math.isfinite(p_holm):
        return "not testable (fewer than 2 seeds with the rows it needs)"
    if p_holm >= ALPHA:
        e = stat["endpoint"]
        inside = -e.sesoi < stat["lo"] and stat["hi"] < e.sesoi
        return "not decided" + (f"; no exponent as large as {e.sesoi:g} either way (CI inside +-{e.sesoi:g})"
                                if inside else "")
    small = "" if abs(stat["lo"]) >= stat["endpoint"].sesoi or abs(stat["hi"]) >= stat["endpoint"].sesoi else \
        f"; the whole CI smaller than the SESOI {stat['endpoint'].sesoi:g}"
    return ("supported (decided, the claimed sign)" if stat["mean"] > 0 else
            "decided against the claim (the opposite sign)") + small


def tests(rows: list[dict], endpoints=ENDPOINTS) -> list[dict]:
    """Per endpoint: its per-seed values, the t-test and CI, and (primary ones) the Holm-adjusted p and verdict."""
    seeds = per_seed(rows, endpoints)
    out = [{"endpoint": e, "values": seeds[e.id], **one_sample(seeds[e.id].values())} for e in endpoints]
    primary = [r for r in out if r["endpoint"].primary]
    for r, a in zip(primary, holm([r["p"] for r in primary])):
        r["p_holm"] = a
        r["verdict"] = verdict(r, a)
    return out


def pooled(rows: list[dict], e: Endpoint) -> dict | None:
    """Sensitivity: one OLS over all seeds (seed fixed effects) with standard errors clustered by seed (statsmodels,
    cov_type='cluster', t with G - 1 df); single-method endpoints only, None otherwise or with < 2 seeds."""
    import statsmodels.formula.api as smf

    df = _frame(rows)
    if e.minus is not None or df["seed"].nunique() < 2:
        return None
    d = _fit_rows(df, e, e.method)
    d = _cells(d, e, keep=("seed",)) if len(d) else d
    formula = _formula(d, e, " + C(seed)") if len(d) else None
    if formula is None or d["seed"].nunique() < 2:
        return None
    res = smf.ols(formula, data=d).fit(cov_type="cluster", cov_kwds={"groups": d["seed"].astype(int).to_numpy()},
                                       use_t=True)
    name = f"np.log({e.against})"
    ci = res.conf_int(alpha=ALPHA)
    return {"exponent": float(res.params[name]), "lo": float(ci.loc[name, 0]), "hi": float(ci.loc[name, 1]),
            "n": int(res.nobs), "clusters": int(d["seed"].nunique())}


TIE_MARGIN = 1e-5
"""A route flip at dose 0 whose router margin (K-th minus (K+1)-th logit in π_old's pass) is at most this is a float
tie that KV-cached decoding and the full forward round apart (experiment 5 met one at 2.2e-7)."""
SETTING = ("seed", "depth", "length", "dose", "warm_steps", "state")
"""The columns that identify one setting (one rollout): those present in the rows."""


def _ties_result(r3, result) -> str:
    """C2t on R3's rows at dose 0 (one per setting and k): fails if a flip is not a tie; else C2's error and k3
    conditions on the rows they can hold on (mini-batches, settings without a tie flip), the tie flips counted."""
    if not len(r3):
        return "not run (no such rows)"
    flips = r3["route_flips"].astype(int)
    margin = r3["route_flip_margin_max"].astype(float)
    not_ties = int(((flips > 0) & ~(margin <= TIE_MARGIN)).sum())
    if not_ties:
        return (f"FAILS on {not_ties} of {len(r3)} rows: a route differs between the rollout and pi_old with a router "
                f"margin above {TIE_MARGIN:g} (largest {margin.max():.2e})")
    keys = [c for c in SETTING if c in r3]
    setting_flips = r3.groupby(keys, dropna=False)["route_flips"].transform("sum").astype(int)
    ok = ((flips > 0) | (r3["grad_err_routing"].astype(float) <= 1e-5)) & (
        (setting_flips > 0) | (r3["mismatch_k3"].astype(float) <= 1e-9))
    base = result(r3, ok, "grad_err_routing")
    compared = int(r3["route_token_layers"].astype(int).sum())
    num_ties = int(flips.sum())
    return base + (f"; {num_ties} tie flips of {compared} token-layers compared, on {int((flips > 0).sum())} rows "
                   f"(largest margin {margin.max():.2e}), checked as ties only" if num_ties else
                   f"; no route differs ({compared} token-layers compared)")


def checks(rows: list[dict]) -> list[tuple[str, str]]:
    """The zero-mismatch controls, true by construction (the instrument is broken if one fails): (name, result)."""
    df = _frame(rows)

    def result(d, ok, value: str):
        if not len(d):
            return "not run (no such rows)"
        finite = np.isfinite(d[value].astype(float))
        bad = int((~ok & finite).sum())
        gone = f" ({int((~finite).sum())} rows without a gradient: a mini-batch whose advantages are all 0)" \
            if (~finite).any() else ""
        return f"holds on all {int(finite.sum())} rows{gone}" if bad == 0 else \
            f"FAILS on {bad} of {int(finite.sum())} rows{gone}"

    out = []
    r2 = df[df["method"] == "grpo+r2"]
    out.append(("C1. R2 is its own reference: GRPO+R2's routing error is 0",
                result(r2, r2["grad_err_routing"].astype(float) == 0.0, "grad_err_routing")))
    r3 = df[(df["method"] == "grpo+r3") & (df["dose"] == 0)]
    if "route_flips" in r3:  # rows that count the rollout's route flips: the check up to router ties
        out.append(("C2t. zero mismatch up to router ties: at dose 0, every route where the rollout and pi_old differ "
                    f"is a tie (pi_old's router margin <= {TIE_MARGIN:g}); R3's error <= 1e-5 on every mini-batch "
                    "without such a route, k3 <= 1e-9 on every setting without one", _ties_result(r3, result)))
    else:
        out.append(("C2. zero mismatch: at dose 0, R3's routes are pi_old's (its error <= 1e-5) and the rollout is "
                    "the learner (k3 <= 1e-9)",
                    result(r3, (r3["grad_err_routing"].astype(float) <= 1e-5)
                           & (r3["mismatch_k3"].astype(float) <= 1e-9), "grad_err_routing")))
    if "mismatch_k3_r3" in df:
        out.append(("C3. R3 removes the drift part: k3 of R3's pi_old against the rollout <= 1e-9 at every dose",
                    result(df, df["mismatch_k3_r3"].astype(float) <= 1e-9, "mismatch_k3_r3")))
    k0 = df[(df["k"] == 0) & (df["method"] != "grpo+r3")]
    out.append(("C4. before the first update nothing has moved: routing error <= 1e-5 at k = 0 (R3 aside)",
                result(k0, k0["grad_err_routing"].astype(float) <= 1e-5, "grad_err_routing")))
    return out


PER_METHOD_AXES = ("length", "depth", "k", "dose")


def per_method_exponents(rows: list[dict], metric: str = "grad_err_routing") -> list[tuple[str, dict[str, dict]]]:
    """Each method's exponent of `metric` against each grid axis, over seeds (descriptive; not in the family): per
    seed the same fit as the endpoints (`seed_exponent`: cell means, OLS on log(axis), fixed effects for the other
    axes, rows k >= 1), then mean and 95% t CI across seeds (`one_sample`). Methods without the metric, or where it
    is 0 by construction (GRPO+R2 is its own reference), are left out."""
    df = _frame(rows)
    if metric not in df:
        return []
    out = []
    for method in sorted(df["method"].unique()):
        vals = df[df["method"] == method][metric].astype(float)
        if not (np.isfinite(vals) & (vals > 0)).any():  # no finite positive value: nothing to fit on a log scale
            continue
        by_axis = {}
        for axis in PER_METHOD_AXES:
            e = Endpoint(id=f"{method}/{axis}", claim="", method=method, metric=metric, against=axis)
            by_axis[axis] = one_sample([seed_exponent(g, e, method) for _, g in df.groupby("seed", sort=True)])
        out.append((method, by_axis))
    return out


def _f(x: float, fmt: str = "+.3f") -> str:
    return "n/a" if x is None or not math.isfinite(x) else format(x, fmt)


def page(rows: list[dict], source: str) -> str:
    df = _frame(rows)
    res = tests(rows)
    seeds = sorted(int(s) for s in df["seed"].unique())
    grid = ", ".join(f"{a} {sorted(df[a].unique().tolist())}" for a in ("depth", "length", "dose"))
    lines = ["# Experiment 5, the mechanism matrix: the pre-registered tests", "",
             f"Rows: `{source}` ({len(df)} rows; seeds {seeds}; {grid}; k 0-{int(df['k'].max())}; methods "
             f"{sorted(df['method'].unique().tolist())}). Regenerate: `python -m analysis.mechanism_tests {source}`.",
             "", "Per seed, each endpoint is an exponent: the metric averaged per setting over k (per k over the "
             "settings, for k), then the OLS slope of log(mean) on log(axis), fixed effects for the other axes "
             "(statsmodels); across seeds a two-sided one-sample t-test against 0 with its 95% t CI; "
             f"Holm over the primary family at alpha {ALPHA}.", "",
             "## The primary family (Holm)", "",
             "| test | claim | seeds | mean [95% CI] | SD | p | Holm p | verdict |", "|---|---|---|---|---|---|---|---|"]
    for r in res:
        if r["endpoint"].primary:
            e = r["endpoint"]
            lines.append(f"| {e.id} | {e.claim} | {r['n']} | {_f(r['mean'])} [{_f(r['lo'])}, {_f(r['hi'])}] | "
                         f"{_f(r['sd'], '.3f')} | {_f(r['p'], '.2g')} | {_f(r['p_holm'], '.2g')} | {r['verdict']} |")
    lines += ["", "## Secondary endpoints (descriptive: CI, no test)", "",
              "| endpoint | claim | seeds | mean [95% CI] | SD |", "|---|---|---|---|---|"]
    for r in res:
        if not r["endpoint"].primary:
            e = r["endpoint"]
            lines.append(f"| {e.id} | {e.claim} | {r['n']} | {_f(r['mean'])} [{_f(r['lo'])}, {_f(r['hi'])}] | "
                         f"{_f(r['sd'], '.3f')} |")
    lines += ["", "## Per method: the exponents of the routing-induced gradient error (descriptive: CI, no test)", "",
              "`grad_err_routing` of each method against each axis, fitted per seed as the endpoints are (rows k >= 1, "
              "so R3's dose exponent differs from PC's, which uses k >= 0), then the mean [95% t CI] over seeds; "
              "GRPO+R2 is 0 by construction (its own reference) and left out. Added after the pre-registration, "
              "before any of experiment 5's results.", "",
              "| method | seeds | length | depth | k (staleness) | dose (0.1 vs 0.4) |", "|---|---|---|---|---|---|"]
    for method, by_axis in per_method_exponents(rows):
        n = max(v["n"] for v in by_axis.values())
        lines.append(f"| {method} | {n} | " + " | ".join(
            f"{_f(v['mean'])} [{_f(v['lo'])}, {_f(v['hi'])}]" for v in (by_axis[a] for a in PER_METHOD_AXES)) + " |")
    lines += ["", "## Per-seed values", "", "| seed | " + " | ".join(r["endpoint"].id for r in res) + " |",
              "|---" * (len(res) + 1) + "|"]
    for s in seeds:
        lines.append(f"| {s} | " + " | ".join(_f(r["values"].get(s, math.nan)) for r in res) + " |")
    lines += ["", "## Sensitivity: pooled fit, seed fixed effects, cluster-robust SE by seed (t, G - 1 df)", "",
              "| endpoint | exponent [95% CI] | rows | seeds |", "|---|---|---|---|"]
    for r in res:
        p = pooled(rows, r["endpoint"])
        if p is not None:
            lines.append(f"| {r['endpoint'].id} | {_f(p['exponent'])} [{_f(p['lo'])}, {_f(p['hi'])}] | {p['n']} | "
                         f"{p['clusters']} |")
    lines += ["", "## Checks (zero-mismatch controls, true by construction; not tests)", ""]
    lines += [f"- {name}: {result}" for name, result in checks(rows)]
    lines += ["", "## Descriptive: GSPO's clip and the rollout-learner mismatch", "",
              "| dose | GSPO clipped_seq_frac (k >= 1) | mismatch k3, natural pi_old | mismatch k3, R3's pi_old |",
              "|---|---|---|---|"]
    for dose, g in df.groupby("dose", sort=True):
        gspo = g[(g["method"] == "gspo") & (g["k"] >= 1)]["clipped_seq_frac"] if "gspo" in set(g["method"]) else []
        k3 = g["mismatch_k3"].astype(float) if "mismatch_k3" in g else []
        k3r = g["mismatch_k3_r3"].astype(float) if "mismatch_k3_r3" in g else []
        lines.append(f"| {dose:g} | {_f(float(np.mean(gspo)) if len(gspo) else math.nan, '.3f')} | "
                     f"{_f(float(np.mean(k3)) if len(k3) else math.nan, '.2e')} | "
                     f"{_f(float(np.mean(k3r)) if len(k3r) else math.nan, '.2e')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m analysis.mechanism_tests", description=__doc__.split("\n")[0])
    ap.add_argument("rows", help="mechanism.jsonl(.gz) of python -m analysis.mechanism")
    ap.add_argument("--out", default=None, help="the page to write (default: tests.md beside the rows)")
    ap.add_argument("--figure", default=None, metavar="PNG",
                    help="also draw each method's routing-induced gradient error against k, length and depth "
                         "(analysis.mechanism_figures) into this PNG")
    args = ap.parse_args(argv)
    try:
        rows = load_rows(args.rows)
    except (ValueError, json.JSONDecodeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else Path(args.rows).with_name("tests.md")
    text = page(rows, args.rows)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, out)
    print(out)
    if args.figure:
        from analysis.figure_kit import report_style, save_png
        from analysis.mechanism_figures import mechanism_figure

        with report_style():
            print(save_png(mechanism_figure(rows), Path(args.figure).parent, Path(args.figure).name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
