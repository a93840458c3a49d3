"""analysis.mechanism_figures: the per-seed-then-over-seeds points (hand-computed), what is left out, and the figure
that `python -m analysis.mechanism_tests ROWS --figure PNG` draws from experiment 5's committed rows."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from analysis import mechanism_figures as mf
from analysis import mechanism_tests as mt

ROOT = Path(__file__).resolve().parents[2]
EXP5 = ROOT / "reports" / "mechanism_exp5"


def _row(method, seed, length, k, err, depth=2, dose=0.0):
    return {"method": method, "seed": seed, "length": length, "depth": depth, "dose": dose, "k": k,
            "grad_err_routing": err}


def test_a_point_is_the_mean_over_seeds_of_each_seeds_mean_with_a_t_interval():
    rows = [
        # seed 1 at L=16: rows 0.01 and 0.03 (k 1, 2) -> 0.02; seed 2 at L=16: 0.04; k = 0 rows never count
        _row("grpo", 1, 16, 1, 0.01), _row("grpo", 1, 16, 2, 0.03), _row("grpo", 1, 16, 0, 9.0),
        _row("grpo", 2, 16, 1, 0.04), _row("grpo", 2, 16, 0, 9.0),
        # L=32: seed 1 0.05, seed 2 a non-finite row left out -> 0.07 alone
        _row("grpo", 1, 32, 1, 0.05), _row("grpo", 2, 32, 1, 0.07), _row("grpo", 2, 32, 2, math.nan),
        # R2 is 0 by construction: left out
        _row("grpo+r2", 1, 16, 1, 0.0), _row("grpo+r2", 2, 16, 1, 0.0),
    ]
    c = mf.curves(rows, "length")
    assert list(c) == ["grpo"]
    g = c["grpo"]
    np.testing.assert_array_equal(g["x"], [16, 32])
    np.testing.assert_allclose(g["mean"], [0.03, 0.06])
    half = stats.t.ppf(0.975, 1) * np.std([0.02, 0.04], ddof=1) / math.sqrt(2)  # 12.706 * 0.01414 / 1.414
    np.testing.assert_allclose(g["lo"], [0.03 - half, 0.06 - half])
    np.testing.assert_allclose(g["hi"], [0.03 + half, 0.06 + half])
    np.testing.assert_array_equal(g["n"], [2, 2])


def test_an_axis_that_is_not_a_panel_is_refused():
    with pytest.raises(ValueError, match="axis 'dose'"):
        mf.curves([_row("grpo", 1, 16, 1, 0.01)], "dose")


def test_the_figure_draws_exactly_the_curves_of_the_rows():
    rows = [_row(m, s, L, k, (1 + s) * 1e-3 * L * (k + 1) * (2 if m == "gspo" else 1), depth=d)
            for m in ("grpo", "gspo") for s in (1, 2, 3) for L in (16, 64) for k in (1, 3) for d in (2, 4)]
    fig = mf.mechanism_figure(rows)
    drawn = mf.drawn_lines(fig)
    assert set(drawn) == set(mf.FIGURE_AXES)
    for axis in mf.FIGURE_AXES:
        want = mf.curves(rows, axis)
        assert set(drawn[axis]) == set(want) == {"grpo", "gspo"}
        for method, c in want.items():
            np.testing.assert_allclose(drawn[axis][method], np.vstack([c["x"], c["mean"]]))


@pytest.mark.skipif(not (EXP5 / "mechanism.jsonl.gz").is_file(), reason="experiment 5's rows are not committed")
def test_experiment_5s_committed_figure_regenerates_from_its_rows(tmp_path, monkeypatch):
    """python -m analysis.mechanism_tests reports/mechanism_exp5/mechanism.jsonl.gz --out ... --figure ...: the
    committed PNG exists, and the command draws every non-R2 method's curves on all three panels from the rows."""
    committed = EXP5 / "grad_err_routing.png"
    assert committed.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    monkeypatch.chdir(ROOT)
    out = tmp_path / "fig" / "grad_err_routing.png"
    assert mt.main(["reports/mechanism_exp5/mechanism.jsonl.gz", "--out", str(tmp_path / "tests.md"),
                    "--figure", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "tests.md").read_bytes() == (EXP5 / "tests.md").read_bytes()
    assert not list(out.parent.glob(".*tmp*")), "the figure is written through a temp file that is renamed"
    rows = mt.load_rows(EXP5 / "mechanism.jsonl.gz")
    methods = {r["method"] for r in rows} - {"grpo+r2"}
    for axis in mf.FIGURE_AXES:
        assert set(mf.curves(rows, axis)) == methods
