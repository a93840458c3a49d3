"""Tests for moe_gspo.routing.replay_checks: every malformation is caught with its reason, the r3/*
metrics by hand, the fallback merge (engine rows where valid, natural rows elsewhere) and the
comparison prefixes."""

from __future__ import annotations

import math

import numpy as np
import pytest

from moe_gspo.routing.replay_checks import (
    DUPLICATE, LENGTH, MISSING, RANGE, REASONS, SHAPE, check_routes, merge_fallback_routes, needs_fallback,
    row_reasons, usable_prefix,
)

E, L, K = 8, 2, 2
DIMS = dict(num_layers=L, top_k=K, num_experts=E)


def _valid(T: int, offset: int = 0) -> np.ndarray:
    """[T, L, K] distinct valid ids: row t, layer l holds (t + l + offset) % E and (t + l + offset + 1) % E."""
    base = (np.arange(T)[:, None] + np.arange(L)[None, :] + offset) % E
    return np.stack([base, (base + 1) % E], axis=-1).astype(np.uint8)


def _batch():
    """Five sequences of n = 4, 4, 3, 3, 4 tokens:
    A: T = 3 valid rows (an engine's usual P + R - 1): only the uncounted last row lacks a route;
    B: T = 4, row 1 has id 8 = E (range), rows 2 and 3 repeat expert 3 in layer 1 (duplicate);
    C: no routes; D: one layer instead of two (shape); E: 1 row for 4 tokens (length)."""
    a = _valid(3)
    b = _valid(4, offset=2)
    b[1, 0, 0] = E
    b[2, 1] = [3, 3]
    b[3, 1] = [3, 3]
    d = _valid(3)[:, :1]
    e = _valid(1)
    return [a, b, None, d, e], [4, 4, 3, 3, 4]


def test_row_reasons_name_each_malformation():
    routes, lens = _batch()
    got = [row_reasons(r, n, **DIMS).tolist() for r, n in zip(routes, lens)]
    assert got == [[0, 0, 0, MISSING], [0, RANGE, DUPLICATE, DUPLICATE], [MISSING] * 3, [SHAPE] * 3, [LENGTH] * 4]
    assert REASONS[RANGE - 1] == "range" and REASONS[DUPLICATE - 1] == "duplicate"
    # further shapes: float ids, a 2-d array, too many rows, an empty array, wrong K, a negative id
    # (NeMo-RL's all -1 "missing" sentinel), a row out of range AND duplicated (range is named first)
    assert row_reasons(_valid(3).astype(np.float32), 4, **DIMS).tolist() == [SHAPE] * 4
    assert row_reasons(_valid(3)[:, 0], 4, **DIMS).tolist() == [SHAPE] * 4
    assert row_reasons(_valid(5), 4, **DIMS).tolist() == [LENGTH] * 4
    assert row_reasons(np.zeros((0, L, K), np.uint8), 2, **DIMS).tolist() == [MISSING] * 2
    three = np.concatenate([_valid(3), (_valid(3)[..., :1] + 4) % E], -1)  # K = 3
    assert row_reasons(three, 4, **DIMS).tolist() == [SHAPE] * 4
    neg = _valid(3).astype(np.int16)
    neg[0] = -1
    both = _valid(3)
    both[2, 0] = [9, 9]
    assert row_reasons(neg, 4, **DIMS).tolist() == [RANGE, 0, 0, MISSING]
    assert row_reasons(both, 3, **DIMS).tolist() == [0, 0, RANGE]
    assert row_reasons(_valid(4), 4, **DIMS).tolist() == [0, 0, 0, 0]  # T = n (vLLM may return P + R rows)


def test_check_routes_metrics_by_hand():
    routes, lens = _batch()
    reasons, m = check_routes(routes, lens, **DIMS)
    # replayed rows = n - 1 per sequence: 3 + 3 + 2 + 2 + 3 = 13; failed: B rows 1, 2 (row 3 is B's
    # uncounted last row), C 2, D 2, E 3 = 9; sequences with a failed row: B, C, D, E of 5
    assert m == {"r3/fallback_token_frac": 9 / 13, "r3/fallback_seq_frac": 4 / 5, "r3/fallback_rows_missing": 2.0,
                 "r3/fallback_rows_shape": 2.0, "r3/fallback_rows_length": 3.0, "r3/fallback_rows_range": 1.0,
                 "r3/fallback_rows_duplicate": 1.0, "r3/num_rows": 13.0}
    assert needs_fallback(reasons) and not needs_fallback(reasons[:1])
    _, clean = check_routes([_valid(3), _valid(5)], [4, 6], **DIMS)
    assert clean["r3/fallback_token_frac"] == 0.0 and clean["r3/num_rows"] == 8.0
    _, none = check_routes(None, [3, 2], **DIMS)  # no routes at all: every row falls back
    assert none["r3/fallback_token_frac"] == 1.0 and none["r3/fallback_rows_missing"] == 3.0
    _, empty = check_routes([], [], **DIMS)
    assert math.isnan(empty["r3/fallback_token_frac"]) and math.isnan(empty["r3/fallback_seq_frac"])
    with pytest.raises(ValueError, match="2 route arrays for 3 sequences"):
        check_routes([_valid(3)] * 2, [4, 4, 4], **DIMS)


def test_merge_takes_engine_rows_where_valid_and_natural_rows_elsewhere():
    routes, lens = _batch()
    reasons, _ = check_routes(routes, lens, **DIMS)
    natural = [np.full((n, L, K), 0, np.uint8) + np.array([6, 7], np.uint8) for n in lens]
    merged = merge_fallback_routes(routes, reasons, natural, num_experts=E)
    assert [m.shape for m in merged] == [(n, L, K) for n in lens] and all(m.dtype == np.uint8 for m in merged)
    np.testing.assert_array_equal(merged[0][:3], routes[0])        # A: the engine's rows ...
    np.testing.assert_array_equal(merged[0][3], natural[0][3])     # ... and the natural last row
    np.testing.assert_array_equal(merged[1][0], routes[1][0])      # B: row 0 valid
    np.testing.assert_array_equal(merged[1][1:], natural[1][1:])   # rows 1-3 fall back
    for b in (2, 3, 4):                                            # C, D, E: every row
        np.testing.assert_array_equal(merged[b], natural[b])
    # natural routes are needed only when a replayed row failed
    with pytest.raises(ValueError, match="no natural routes"):
        merge_fallback_routes(routes, reasons, None, num_experts=E)
    only_a = merge_fallback_routes(routes[:1], reasons[:1], None, num_experts=E)
    np.testing.assert_array_equal(only_a[0], routes[0])
    with pytest.raises(ValueError, match="3 natural route rows for seq_len=4"):
        merge_fallback_routes(routes, reasons, [n[:3] for n in natural], num_experts=E)


def test_usable_prefix_cuts_at_the_first_failed_row():
    routes, lens = _batch()
    reasons, _ = check_routes(routes, lens, **DIMS)
    cut = usable_prefix(routes, reasons, **DIMS)
    np.testing.assert_array_equal(cut[0], routes[0])
    np.testing.assert_array_equal(cut[1], routes[1][:1])
    assert [c.shape for c in cut[2:]] == [(0, L, K)] * 3 and all(c.dtype == np.uint8 for c in cut)
    assert usable_prefix(None, reasons, **DIMS) is None


def test_check_routes_gives_every_sequence_its_row_reasons():
    """`check_routes` checks the rows of all sequences at once; each sequence gets what `row_reasons` says
    for it alone (random defects of every kind, mixed id dtypes)."""
    from moe_gspo.routing.replay_checks import check_routes, row_reasons

    rng = np.random.default_rng(1)
    L, K, E = 2, 3, 8
    routes, lens = [], []
    for b in range(60):
        n = int(rng.integers(1, 12))
        r = np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(L)]) for _ in range(n)])
        kind = b % 8
        if kind == 1:
            r = r[:n - 1]
        elif kind == 2:
            r[rng.integers(0, n)] = E  # out of range
        elif kind == 3:
            r[rng.integers(0, n), 0] = 5  # a duplicate within a layer
        elif kind == 4:
            r = None
        elif kind == 5:
            r = r[:, :, :2]  # wrong K
        elif kind == 6:
            r = r[:max(n - 3, 0)]  # wrong length
        elif kind == 7:
            r = r.astype(np.float32)
        if r is not None and r.dtype.kind in "iu":
            r = r.astype(np.int16 if b % 2 else np.uint8)
        routes.append(r)
        lens.append(n)
    reasons, _ = check_routes(routes, lens, num_layers=L, top_k=K, num_experts=E)
    for r, n, got in zip(routes, lens, reasons):
        want = row_reasons(r, n, num_layers=L, top_k=K, num_experts=E)
        assert got.dtype == want.dtype and got.tolist() == want.tolist()


def test_usable_prefix_cuts_every_sequence_at_its_first_failed_row():
    from moe_gspo.routing.replay_checks import _first_failed, _first_failed_all

    rng = np.random.default_rng(2)
    reasons = [np.where(rng.random(int(n)) < 0.1, rng.integers(1, 6, int(n)), 0).astype(np.int8)
               for n in rng.integers(0, 15, 200)]
    assert _first_failed_all(reasons) == [_first_failed(c) for c in reasons]
    assert _first_failed_all([np.zeros(3, np.int8), np.zeros(0, np.int8)]) == [3, 0] and _first_failed_all([]) == []
