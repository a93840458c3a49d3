"""Did routing replay work? The R3 part of a run report (issue 49: `r3/replay_mismatch_frac` and `r3/fallback_*`
were logged every step but shown nowhere).

- `r3_sentence`: one summary sentence: whether the replayed pass routed every replayed (token, MoE layer) row to
  the rollout engine's experts (`r3/replay_mismatch_frac` 0 at every step: the replay contract held), and what
  share of the rows fell back to the learner's own routing, by reason (`r3/fallback_*`); None for a run that
  logged no `r3/*` metric (not R3).
- `r3_rows`: the table rows: per metric the mean and the maximum over steps (fallback row counts: the total).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from analysis.load import series

MISMATCH = "r3/replay_mismatch_frac"
FALLBACK = ("r3/fallback_token_frac", "r3/fallback_seq_frac")
REASONS = ("missing", "shape", "length", "range", "duplicate")  # moe_gspo.routing.replay_checks.REASONS
COUNTS = ("r3/num_rows", *(f"r3/fallback_rows_{r}" for r in REASONS))


def _values(records: list[dict[str, Any]], key: str) -> np.ndarray:
    """The key's values over the steps that logged it (NaN kept: a step where no row replayed an engine route)."""
    return series(records, key)[1]


def _pct(v: float) -> str:
    return f"{100 * v:.3g}%"


def r3_logged(records: list[dict[str, Any]]) -> bool:
    return any(k.startswith("r3/") for r in records for k in r)


def r3_rows(records: list[dict[str, Any]]) -> list[list[str]]:
    """[metric, mean over steps, max over steps, steps logged] per R3 fraction; [count, total, max, steps] per
    row count. Empty when the run logged no r3/* metric."""
    rows = []
    for key in (MISMATCH, *FALLBACK, *COUNTS):
        vals = _values(records, key)
        if vals.size == 0:
            continue
        ok = vals[np.isfinite(vals)]
        first = (f"{ok.sum():.0f} (total)" if key in COUNTS else f"{ok.mean():.3g}") if ok.size else "n/a"
        worst = (f"{ok.max():.0f}" if key in COUNTS else f"{ok.max():.3g}") if ok.size else "n/a"
        rows.append([key, first, worst, f"{ok.size} of {vals.size}"])
    return rows


def r3_sentence(records: list[dict[str, Any]]) -> str | None:
    """The summary sentence on routing replay (module docstring); None without r3/* metrics."""
    if not r3_logged(records):
        return None
    parts = []
    mism = _values(records, MISMATCH)
    ok = mism[np.isfinite(mism)]
    if mism.size == 0:
        parts.append("Routing replay (R3): the replay contract was not checked (r3/replay_mismatch_frac never logged: "
                     "an older run)")
    elif ok.size == 0:
        parts.append(f"Routing replay (R3): no row replayed a rollout route on any of the {mism.size} steps "
                     "(r3/replay_mismatch_frac NaN: every row fell back to the learner's own routing)")
    elif ok.max() == 0:
        parts.append(f"Routing replay (R3) held: on all {ok.size} checked steps every replayed (token, MoE layer) "
                     "row used the rollout engine's experts (r3/replay_mismatch_frac 0)")
    else:
        bad = int((ok > 0).sum())
        parts.append(f"Routing replay (R3) did NOT hold on {bad} of {ok.size} steps: up to {_pct(ok.max())} of the "
                     f"replayed rows used other experts than the rollout engine's (r3/replay_mismatch_frac, max over "
                     f"steps; mean {_pct(ok.mean())})")
    tok = _values(records, FALLBACK[0])
    tok = tok[np.isfinite(tok)]
    if tok.size:
        reasons = [(r, np.nansum(_values(records, f"r3/fallback_rows_{r}"))) for r in REASONS]
        why = ", ".join(f"{r} {n:.0f}" for r, n in reasons if n > 0)
        parts.append(f"{_pct(tok.mean())} of the replayed rows fell back to the learner's own routing "
                     f"(r3/fallback_token_frac, mean over {tok.size} steps; max {_pct(tok.max())})"
                     + (f"; failed rows by reason: {why}" if why else ""))
    return "; ".join(parts) + "."
