"""Safe R3: the rollout engine's routes are checked row by row before the learner replays them; rows
that are missing or malformed replay the learner's own natural routing instead, and are counted.

Why: Rollout Routing Replay (R3, Ma et al. 2025, arXiv 2510.11370) replays the engine's top-k expert
ids inside the learner, and an engine does not always return a route for every token: vLLM's opt-in
prefix omission (vLLM PR #57966) returns no routes for prefix-cached prompt tokens; slime users report
routes dropped by data-parallel merges and prefix-only requests (slime #1145, #1909) and vLLM's
never-written rows are zeros. `moe_gspo.routing.align.build_replay_topk` fills rows past the end of a
sequence's routes with a filler set, which must never stand in for a token that matters. NeMo-RL
replays its own router for missing routes and counts them (`r3/routed_experts_fallback_token_route_fraction`,
missing token routes / expected token routes); this module does the same, with per-reason counts.

Which rows are replayed (`num_rows`): rows t = 0 .. n - 2 of a sequence of n = P + R tokens, i.e.
every row whose output predicts a token (row t gives the log-prob of token t + 1) or feeds one through
attention. Row n - 1 (the last sampled token, which an engine never runs) affects no log-prob: it is
not counted, and replays the natural route when there is one (else the filler).

Checks, in this order (the first that fails names the reason):
- `missing`: no routes for the sequence (None or zero rows): every row;
- `shape`: not an integer array [T, L, K] with the model's L MoE layers and top-k K: every row;
- `length`: T is neither n - 1 nor n (the row count every engine here returns), so rows cannot be
  matched to positions (a prefix or a suffix may be missing): every row;
- `range`: a row with an expert id outside [0, E) (e.g. NeMo-RL's all -1 "missing" rows): that row;
- `duplicate`: a row whose top-k names one expert twice in some layer (e.g. vLLM's never-written
  all-zero rows when K >= 2): that row.
An engine that omits some rows must therefore return full-length arrays with those rows marked (an
id >= E, or all ids equal); a shorter array is rejected as a whole.

Fallback (`merge_fallback_routes`): upstream `RouterReplay` (Megatron-core 0.16.1,
`transformer/moe/router_replay.py`) takes one full [S*B, K] index tensor per MoE layer
(`set_target_indices`) and has no per-token mask (`get_replay_topk` does `scores.gather(1, target)` for
every row, so an id >= E would fail and a repeated id would run one expert twice); the fallback is
therefore merged into the routes before the tensor is built, and no upstream code is patched. A failed
row replays the learner's natural routing of that row,
the top-k its router chose in the old-policy pass with natural routing (no replay), which the training
loop runs anyway. The same merged routes are replayed in the old-policy pass (the loss's pi_old), in
the update and in the reference pass, so a fallback row is replayed consistently, as R2 replays it.
Simplifications: (1) a fallback row's natural route was computed with every earlier row routed
naturally too; where earlier rows replay the engine's routes its hidden state, hence its router's own
choice, may differ slightly (not for a dropped prompt prefix, the common case, whose earlier rows all
fall back). (2) Unlike NeMo-RL, whose router recomputes the fallback rows in every forward (in the
update under the current weights), fallback rows keep the old-policy choice through the update.

Comparisons (`usable_prefix`): the rollout-vs-learner metrics and traces (`routing/*`, the saved
"rollout" trace, `routing_flips`) take each sequence's routes cut at its first failed row, so a failed
row is left out rather than counted as an agreement or a disagreement.

Metrics (`check_routes`; floats, NaN when there is no replayed row): `r3/fallback_token_frac` (failed
rows / `r3/num_rows`), `r3/fallback_seq_frac` (sequences with >= 1 failed row among those with a
replayed row), `r3/fallback_rows_<reason>` (failed rows per reason, counts), `r3/num_rows`.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from moe_gspo.routing.trace import ids_dtype

REASONS = ("missing", "shape", "length", "range", "duplicate")
"""Why a row falls back; `row_reasons` codes row reasons as 1 + the index here (0 = replay as given)."""
MISSING, SHAPE, LENGTH, RANGE, DUPLICATE = range(1, len(REASONS) + 1)


def row_reasons(routes_TLK, seq_len: int, *, num_layers: int, top_k: int, num_experts: int) -> np.ndarray:
    """int8 [seq_len]: 0 where row t of `routes_TLK` can be replayed as the engine gave it, else the
    code of the first check it fails (1 + index in `REASONS`); a row the array does not have (row
    seq_len - 1 when T = seq_len - 1) is `missing`."""
    n = int(seq_len)
    codes = np.zeros(n, dtype=np.int8)
    if routes_TLK is None or np.shape(routes_TLK)[:1] == (0,):
        codes[:] = MISSING
        return codes
    r = np.asarray(routes_TLK)
    if r.ndim != 3 or r.shape[1:] != (int(num_layers), int(top_k)) or r.dtype.kind not in "iu":
        codes[:] = SHAPE
        return codes
    T = r.shape[0]
    if not n - 1 <= T <= n:
        codes[:] = LENGTH
        return codes
    r = r[:n]
    bad_range = ((r < 0) | (r >= int(num_experts))).reshape(len(r), -1).any(-1)
    srt = np.sort(r, axis=-1)
    dup = (srt[..., 1:] == srt[..., :-1]).reshape(len(r), -1).any(-1)
    codes[:len(r)] = np.where(bad_range, RANGE, np.where(dup, DUPLICATE, 0))
    codes[len(r):] = MISSING
    return codes


def _row_reasons_all(routes: list, lens: list[int], *, num_layers: int, top_k: int, num_experts: int
                     ) -> list[np.ndarray]:
    """`row_reasons` of every sequence, the per-row checks (range, duplicate) of all sequences in one pass over
    their rows concatenated."""
    reasons: list = [None] * len(lens)
    rows: list[tuple[int, np.ndarray]] = []
    for b, (r, n) in enumerate(zip(routes, lens)):
        if r is None or np.shape(r)[:1] == (0,):
            reasons[b] = row_reasons(r, n, num_layers=num_layers, top_k=top_k, num_experts=num_experts)
            continue
        r = np.asarray(r)
        if (r.ndim != 3 or r.shape[1:] != (int(num_layers), int(top_k)) or r.dtype.kind not in "iu"
                or not n - 1 <= r.shape[0] <= n):  # a whole-sequence failure: `row_reasons` names it
            reasons[b] = row_reasons(r, n, num_layers=num_layers, top_k=top_k, num_experts=num_experts)
            continue
        rows.append((b, r[:n]))
    if rows:
        r = np.concatenate([x for _, x in rows])
        bad_range = ((r < 0) | (r >= int(num_experts))).reshape(len(r), -1).any(-1)
        srt = np.sort(r, axis=-1)
        dup = (srt[..., 1:] == srt[..., :-1]).reshape(len(r), -1).any(-1)
        code = np.where(bad_range, RANGE, np.where(dup, DUPLICATE, 0)).astype(np.int8)
        start = 0
        for b, x in rows:
            codes = np.full(lens[b], MISSING, dtype=np.int8)  # a row the array does not have: missing
            codes[:len(x)] = code[start:start + len(x)]
            start += len(x)
            reasons[b] = codes
    return reasons


def check_routes(rollout_routes: Sequence | None, seq_lens, *, num_layers: int, top_k: int,
                 num_experts: int) -> tuple[list[np.ndarray], dict[str, float]]:
    """Every sequence's `row_reasons` and the `r3/*` metrics (module docstring).

    Args:
        rollout_routes: B arrays [T_b, L, K] (None entries allowed), or None = no routes at all.
        seq_lens: B real sequence lengths n_b = P_b + R_b.
        num_layers, top_k, num_experts: the model's MoE layer count L, K and E.
    """
    lens = [int(n) for n in np.asarray(seq_lens).reshape(-1)]
    routes = [None] * len(lens) if rollout_routes is None else list(rollout_routes)
    if len(routes) != len(lens):
        raise ValueError(f"check_routes: {len(routes)} route arrays for {len(lens)} sequences")
    reasons = _row_reasons_all(routes, lens, num_layers=num_layers, top_k=top_k, num_experts=num_experts)
    counted = [c[:max(n - 1, 0)] for c, n in zip(reasons, lens)]
    num_rows = sum(len(c) for c in counted)
    failed = np.concatenate(counted) if counted else np.zeros(0, np.int8)
    seqs = [c for c in counted if len(c)]
    metrics = {
        "r3/fallback_token_frac": float((failed > 0).sum()) / num_rows if num_rows else math.nan,
        "r3/fallback_seq_frac": sum(bool(c.any()) for c in seqs) / len(seqs) if seqs else math.nan,
        **{f"r3/fallback_rows_{name}": float((failed == code).sum()) for code, name in enumerate(REASONS, 1)},
        "r3/num_rows": float(num_rows),
    }
    return reasons, metrics


def needs_fallback(reasons: Sequence[np.ndarray]) -> bool:
    """Whether any replayed row (all rows but each sequence's last) failed its checks."""
    return any(bool(c[:max(len(c) - 1, 0)].any()) for c in reasons)


def merge_fallback_routes(rollout_routes: Sequence | None, reasons: Sequence[np.ndarray],
                          natural_routes: Sequence | None, *, num_experts: int) -> list[np.ndarray]:
    """The routes to replay: B arrays (uint8 / uint16) holding the engine's row where its reason is 0
    and the learner's natural row (`natural_routes[b]`, [n_b, L, K], from a natural-routing pass over
    the same tokens and weights) elsewhere. `natural_routes` may be None only when no replayed row
    failed (`needs_fallback` is False): each sequence then replays the engine's rows it has (the last
    row, when absent, gets the filler, which affects nothing)."""
    routes = [None] * len(reasons) if rollout_routes is None else list(rollout_routes)
    dtype = ids_dtype(num_experts)
    if natural_routes is None:
        if needs_fallback(reasons):
            raise ValueError("merge_fallback_routes: some replayed rows failed their checks and no natural routes "
                             "were given; pass the routes of a natural-routing pass over the same batch")
        return [np.asarray(r)[:_first_failed(c)].astype(dtype, copy=False) for r, c in zip(routes, reasons)]
    if len(natural_routes) != len(reasons):
        raise ValueError(f"merge_fallback_routes: {len(natural_routes)} natural route arrays for "
                         f"{len(reasons)} sequences")
    out = []
    for b, (r, nat, c) in enumerate(zip(routes, natural_routes, reasons)):
        nat = np.asarray(nat)
        n = len(c)
        if nat.shape[0] < n:
            raise ValueError(f"merge_fallback_routes: sequence {b} has {nat.shape[0]} natural route rows for "
                             f"seq_len={n}")
        if not c.any():
            out.append(np.asarray(r)[:n].astype(dtype, copy=False))
            continue
        merged = nat[:n].astype(dtype, copy=True)
        ok = np.flatnonzero(c == 0)
        if ok.size:
            merged[ok] = np.asarray(r)[ok]
        out.append(merged)
    return out


def usable_prefix(rollout_routes: Sequence | None, reasons: Sequence[np.ndarray], *, num_layers: int,
                  top_k: int, num_experts: int) -> list[np.ndarray] | None:
    """Each sequence's engine routes cut at its first failed row (an empty [0, L, K] array when the
    whole sequence failed): what the rollout-vs-learner comparisons and traces may use. None when
    `rollout_routes` is None."""
    if rollout_routes is None:
        return None
    dtype = ids_dtype(num_experts)
    out = []
    for r, cut in zip(rollout_routes, _first_failed_all(reasons)):
        # whole-sequence failures (missing, shape, length) fail at row 0
        out.append(np.asarray(r)[:cut].astype(dtype, copy=False) if cut else
                   np.zeros((0, int(num_layers), int(top_k)), dtype=dtype))
    return out


def _first_failed_all(reasons: Sequence[np.ndarray]) -> list[int]:
    """`_first_failed` of every sequence, from one search over their reasons concatenated."""
    if not len(reasons):
        return []
    lens = np.fromiter(map(len, reasons), np.int64, len(reasons))
    bad = np.flatnonzero(np.concatenate(reasons))
    if not bad.size:
        return lens.tolist()
    start = np.cumsum(lens) - lens
    pos = np.searchsorted(bad, start)  # the first failed row at or after each sequence's start
    first = bad[np.minimum(pos, bad.size - 1)] - start
    return np.where((pos < bad.size) & (first < lens), first, lens).tolist()


def _first_failed(reasons_T: np.ndarray) -> int:
    """The index of the first failed row (len when none failed)."""
    bad = np.flatnonzero(reasons_T)
    return int(bad[0]) if bad.size else len(reasons_T)


REPLAY_MISMATCH_KEY = "r3/replay_mismatch_frac"
"""Share of the replayed (token, layer) rows whose experts in the learner's forward differ from the
replayed ones (`replay_mismatch`)."""


def replay_mismatch(replayed_routes: Sequence, used_routes: Sequence, reasons: Sequence[np.ndarray]) -> dict[str, float]:
    """The R3 replay contract: did the learner's forward use the experts it was told to replay?

    Args:
        replayed_routes: B arrays [>= n_b - 1, L, K], the routes handed to the replayed pass (the engine's
            rows, natural rows where they fell back: `merge_fallback_routes`).
        used_routes: B arrays [>= n_b - 1, L, K], the top-k experts the same pass's routers actually sent each
            token to (recorded by `moe_gspo.learner.router_hooks` from the router's routing map, the map the
            token dispatcher uses).
        reasons: B arrays [n_b] of `row_reasons` (`check_routes`).

    Counted: every (row, MoE layer) pair of rows t = 0 .. n_b - 2 (`r3/num_rows`) whose reason is 0, i.e.
    that replayed the engine's route. Rows that fell back to the learner's natural routing are left out
    (`r3/fallback_*` counts them), and so is each sequence's last row (it produces no log-prob). A pair
    counts as a mismatch when its used top-k *set* differs from the replayed one (order within the top-k
    is not part of the contract). Returns {`r3/replay_mismatch_frac`: mismatched / counted pairs, NaN when
    nothing is counted}.
    """
    if not len(replayed_routes) == len(used_routes) == len(reasons):
        raise ValueError(f"replay_mismatch: {len(replayed_routes)} replayed, {len(used_routes)} used route arrays "
                         f"and {len(reasons)} reason arrays; pass one of each per sequence")
    mismatched = counted = 0
    for b, (want, got, codes) in enumerate(zip(replayed_routes, used_routes, reasons)):
        rows = np.flatnonzero(np.asarray(codes)[:max(len(codes) - 1, 0)] == 0)
        if not rows.size:
            continue
        want, got = np.asarray(want), np.asarray(got)
        if want.shape[0] <= rows[-1] or got.shape[0] <= rows[-1] or want.shape[1:] != got.shape[1:]:
            raise ValueError(f"replay_mismatch: sequence {b} has replayed routes {want.shape} and used routes "
                             f"{got.shape} for {len(codes)} tokens")
        a = np.sort(want[rows].astype(np.int64), -1)
        u = np.sort(got[rows].astype(np.int64), -1)
        mismatched += int((a != u).any(-1).sum())
        counted += a.shape[0] * a.shape[1]
    return {REPLAY_MISMATCH_KEY: mismatched / counted if counted else math.nan}
