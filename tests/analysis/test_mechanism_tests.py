"""analysis.mechanism_tests (experiment 5's pre-registered tests, issue 58): on rows with planted per-seed exponents it
recovers each seed's exponent exactly, tests them across seeds (t-test, t CI) with Holm over the primary family in
the right order, gives each verdict its wording, runs the zero-mismatch checks, and regenerates its page byte for byte
(the committed pilot's page too); the power script counts only Holm-decided tests of the claimed sign."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from analysis import mechanism_tests as mt

ROOT = Path(__file__).resolve().parents[2]
SEEDS = (11, 12, 13, 14)
# planted per-seed exponents (method -> axis -> one per seed)
GRPO = {"length": (0.4, 0.5, 0.6, 0.5), "depth": (-0.35, -0.3, -0.25, -0.3), "k": (-1.0, -1.1, -1.2, -1.1),
        "dose": (0.01, -0.01, 0.02, -0.02)}
T3 = (0.3, 0.25, 0.3, 0.35)  # grpo-noclip's length exponent minus gspo-noclip's
T4 = (0.3, -0.2, 0.1, -0.1)  # the same for depth: mean 0.025, not decided
R3_DOSE = (0.9, 1.0, 1.1, 1.0)
TIS_DOSE = (0.5, 0.6, 0.7, 0.6)


def _exps(method: str, i: int) -> dict:
    g = {a: v[i] for a, v in GRPO.items()}
    if method == "gspo-noclip" or method == "gspo":
        return {**g, "length": g["length"] - T3[i], "depth": g["depth"] - T4[i]}
    if method == "grpo+r3":
        return {"length": 0.0, "depth": 0.0, "k": 0.0, "dose": R3_DOSE[i]}
    return g


def synthetic_rows() -> list[dict]:
    rows = []
    methods = ("grpo", "gspo", "grpo+r2", "grpo+r3", "grpo+tis", "grpo-noclip", "gspo-noclip")
    for i, seed in enumerate(SEEDS):
        for depth in (2, 4):
            for length in (16, 32):
                for dose in (0.0, 0.1, 0.4):
                    for k in range(4):
                        for m in methods:
                            e = _exps(m, i)
                            err = 0.01 * length ** e["length"] * depth ** e["depth"] * max(k, 1) ** e["k"] * \
                                (dose ** e["dose"] if dose > 0 else 1.0) * (1 + 0.1 * i)
                            if m == "grpo+r2" or (k == 0 and m != "grpo+r3") or (m == "grpo+r3" and dose == 0):
                                err = 0.0
                            row = {"seed": seed, "depth": depth, "length": length, "dose": dose, "k": k, "method": m,
                                   "grad_err_routing": err, "experts_changed": 0.01 * max(k, 1) ** 0.8 if k else 0.0,
                                   "clipped_seq_frac": 0.97, "mismatch_k3": 1e-6 * dose, "mismatch_k3_r3": 1e-14}
                            if m == "grpo+tis":
                                row["grad_err_tis_vs_grpo"] = 1e-3 * dose ** TIS_DOSE[i] * length ** 0.2 if dose else 1e-9
                            rows.append(row)
    return rows


@pytest.fixture(scope="module")
def results():
    return {r["endpoint"].id: r for r in mt.tests(synthetic_rows())}


def test_each_seeds_planted_exponent_is_recovered_exactly(results):
    assert results["T1"]["values"] == pytest.approx(dict(zip(SEEDS, GRPO["length"])), abs=1e-9)
    assert results["T2"]["values"] == pytest.approx(dict(zip(SEEDS, GRPO["depth"])), abs=1e-9)
    assert results["T5"]["values"] == pytest.approx(dict(zip(SEEDS, GRPO["k"])), abs=1e-9)
    assert results["T3"]["values"] == pytest.approx(dict(zip(SEEDS, T3)), abs=1e-9)  # a difference, paired by seed
    assert results["T4"]["values"] == pytest.approx(dict(zip(SEEDS, T4)), abs=1e-9)
    assert results["PC"]["values"] == pytest.approx(dict(zip(SEEDS, R3_DOSE)), abs=1e-9)  # doses > 0 only
    assert results["T6"]["values"] == pytest.approx(dict(zip(SEEDS, TIS_DOSE)), abs=1e-9)
    assert results["S1"]["values"] == pytest.approx(dict(zip(SEEDS, GRPO["dose"])), abs=1e-9)


def test_per_method_exponents_are_the_planted_means_over_seeds_with_a_t_ci():
    table = dict(mt.per_method_exponents(synthetic_rows()))
    assert "grpo+r2" not in table  # 0 by construction: left out
    assert set(table) == {"grpo", "gspo", "grpo+r3", "grpo+tis", "grpo-noclip", "gspo-noclip"}
    assert table["grpo"]["length"]["mean"] == pytest.approx(0.5, abs=1e-9)
    assert table["grpo"]["depth"]["mean"] == pytest.approx(-0.3, abs=1e-9)
    assert table["grpo"]["k"]["mean"] == pytest.approx(-1.1, abs=1e-9)
    assert table["gspo-noclip"]["length"]["mean"] == pytest.approx(0.5 - np.mean(T3), abs=1e-9)
    assert table["grpo+r3"]["dose"]["mean"] == pytest.approx(1.0, abs=1e-9)
    assert table["grpo+r3"]["length"]["mean"] == pytest.approx(0.0, abs=1e-9)
    half = stats.t.ppf(0.975, 3) * np.std(GRPO["length"], ddof=1) / 2  # by hand: 4 seeds, 3 df
    assert (table["grpo"]["length"]["lo"], table["grpo"]["length"]["hi"]) == pytest.approx((0.5 - half, 0.5 + half))
    assert table["grpo"]["length"]["n"] == len(SEEDS)


def test_the_t_test_and_its_ci_are_over_seeds(results):
    v = np.asarray(GRPO["length"])  # mean 0.5, SD 0.0816, n 4
    se = v.std(ddof=1) / 2
    t = 0.5 / se
    r = results["T1"]
    assert r["n"] == 4 and r["mean"] == pytest.approx(0.5) and r["sd"] == pytest.approx(v.std(ddof=1))
    assert r["p"] == pytest.approx(2 * stats.t.sf(t, 3), rel=1e-6)
    half = stats.t.ppf(0.975, 3) * se
    assert (r["lo"], r["hi"]) == pytest.approx((0.5 - half, 0.5 + half), rel=1e-6)


def test_holm_over_the_primary_family_in_order(results):
    assert mt.holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    out = mt.holm([0.01, math.nan, 0.04])  # an untestable endpoint leaves the family
    assert out[0] == pytest.approx(0.02) and math.isnan(out[1]) and out[2] == pytest.approx(0.04)
    primary = [r for r in results.values() if r["endpoint"].primary]
    assert [r["endpoint"].id for r in primary] == ["PC", "T1", "T3", "T4", "T5", "T6"]
    order = sorted(primary, key=lambda r: r["p"])
    m, running = len(order), 0.0
    for j, r in enumerate(order):  # Holm by hand: step-down, running maximum
        running = max(running, min(1.0, (m - j) * r["p"]))
        assert r["p_holm"] == pytest.approx(running, rel=1e-9)
    assert "p_holm" not in results["S1"]  # secondary endpoints are not in the family


def test_verdicts_say_decided_with_the_sign_or_not_decided(results):
    assert results["T1"]["verdict"].startswith("supported")
    assert results["T5"]["verdict"].startswith("decided against")  # decided, the opposite sign
    assert "verdict" not in results["T2"]  # secondary
    assert results["T4"]["verdict"] == "not decided"


def test_the_zero_mismatch_checks_hold_and_fail_when_broken():
    rows = synthetic_rows()
    assert all(r.startswith("holds") for _, r in mt.checks(rows))
    broken = [dict(r, grad_err_routing=1e-3) if r["method"] == "grpo+r2" and r["k"] == 2 else r for r in rows]
    c1 = dict(mt.checks(broken))
    assert next(v for k, v in c1.items() if k.startswith("C1")).startswith("FAILS on 48 of 192")


def _with_flips(rows: list[dict], *, margin: float, err: float = 4.4e-4) -> list[dict]:
    """The rows with the route-flip counts (100 token-layers per mini-batch, none differ) and one flip at dose 0 in
    the first seed's depth-2, length-16 setting, mini-batch k = 2, with pi_old's router `margin` there; R3's error
    `err` on that row and the setting's k3 5e-9 (a flip reaches both)."""
    first = (SEEDS[0], 2, 16, 0.0)
    out = []
    for r in rows:
        r = dict(r, route_flips=0, route_token_layers=100, route_flip_margin_max=math.nan)
        if (r["seed"], r["depth"], r["length"], r["dose"]) == first:
            r["mismatch_k3"] = 5e-9
            if r["k"] == 2:
                r.update(route_flips=1, route_flip_margin_max=margin)
                if r["method"] == "grpo+r3":
                    r["grad_err_routing"] = err
        out.append(r)
    return out


def test_the_zero_mismatch_check_up_to_ties():
    """Rows that count route flips get C2t instead of C2: a tie flip (experiment 5's: margin 2.2e-7) is counted and
    left out of the error and k3 conditions; a flip that is no tie, or an error where nothing flipped, fails it."""
    c = dict(mt.checks([dict(r, route_flips=0, route_token_layers=100, route_flip_margin_max=math.nan)
                        for r in synthetic_rows()]))
    assert not any(k.startswith("C2.") for k in c)
    # R3 at dose 0: 4 seeds x 2 depths x 2 lengths x 4 mini-batches = 64 rows of 100 token-layers
    assert next(v for k, v in c.items() if k.startswith("C2t")) == \
        "holds on all 64 rows; no route differs (6400 token-layers compared)"
    tie = _with_flips(synthetic_rows(), margin=2.2e-7)
    c2t = next(v for k, v in mt.checks(tie) if k.startswith("C2t"))
    assert c2t.startswith("holds on all 64 rows; 1 tie flips of 6400 token-layers compared, on 1 rows")
    assert "largest margin 2.20e-07" in c2t
    # the same rows without the counts: experiment 5's C2, which the tie breaks (its error 4.4e-4 > 1e-5; the k3)
    plain = [{k: v for k, v in r.items() if not k.startswith("route_")} for r in tie]
    assert next(v for k, v in mt.checks(plain) if k.startswith("C2.")) == "FAILS on 4 of 64 rows"
    no_tie = next(v for k, v in mt.checks(_with_flips(synthetic_rows(), margin=1e-3)) if k.startswith("C2t"))
    assert no_tie.startswith("FAILS on 1 of 64 rows: a route differs between the rollout and pi_old with a router "
                             "margin above 1e-05")
    moved = [dict(r, grad_err_routing=1e-3) if r["method"] == "grpo+r3" and r["dose"] == 0 and r["k"] == 1
             and (r["seed"], r["depth"], r["length"]) == (SEEDS[0], 2, 16) else r for r in tie]
    assert next(v for k, v in mt.checks(moved) if k.startswith("C2t")).startswith("FAILS on 1 of 64 rows")


def _write(path: Path, rows: list[dict]) -> None:
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def test_the_page_regenerates_byte_for_byte_and_bad_input_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _write(tmp_path / "m.jsonl.gz", synthetic_rows())
    assert mt.main(["m.jsonl.gz", "--out", "a.md"]) == 0
    assert mt.main(["m.jsonl.gz", "--out", "b.md"]) == 0
    a = (tmp_path / "a.md").read_bytes()
    assert a == (tmp_path / "b.md").read_bytes()
    assert b"| T1 |" in a and b"supported" in a and b"not decided" in a
    assert mt.main(["missing.jsonl.gz"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not a file" in err[0]


MECHANISM_REPORTS = sorted(p.parent.relative_to(ROOT).as_posix() for p in (ROOT / "reports").glob("*/tests.md")
                           if (p.parent / "mechanism.jsonl.gz").is_file())
"""The committed pages of `analysis.mechanism_tests` (the pilot's; experiment 5's once its rows are committed)."""


def test_the_pilot_page_is_among_the_committed_mechanism_reports():
    assert "reports/mechanism_pilot" in MECHANISM_REPORTS


@pytest.mark.parametrize("folder", MECHANISM_REPORTS)
def test_a_committed_mechanism_page_is_what_its_rows_give(tmp_path, monkeypatch, folder):
    """python -m analysis.mechanism_tests FOLDER/mechanism.jsonl.gz --out FOLDER/tests.md"""
    monkeypatch.chdir(ROOT)
    src = f"{folder}/mechanism.jsonl.gz"
    assert mt.main([src, "--out", str(tmp_path / "tests.md")]) == 0
    assert (tmp_path / "tests.md").read_bytes() == (ROOT / folder / "tests.md").read_bytes()


@pytest.mark.parametrize("name", ["exp5", "exp5r"])
def test_the_claims_page_quotes_the_experiments_tables_as_generated(name):
    """docs/paper_claims.md quotes tables of reports/mechanism_<name>/tests.md between
    `<!-- analysis.mechanism_tests:begin <name> -->` and its end marker, byte for byte (none before its rows exist):
    experiment 5's and 5R's."""
    from test_claims_page import _quoted_tables

    quoted = _quoted_tables((ROOT / "docs" / "paper_claims.md").read_text(), name=name, tool="mechanism_tests")
    page = ROOT / "reports" / f"mechanism_{name}" / "tests.md"
    if not page.is_file():
        assert quoted == []
        return
    assert quoted, f"{name}'s results are committed: the claims page quotes its family table"
    for block in quoted:
        assert block in page.read_text(), f"a table on the page is not what analysis.mechanism_tests makes:\n{block[:300]}"


def test_power_counts_only_holm_decided_tests_of_the_claimed_sign():
    from statsmodels.stats.multitest import multipletests

    from benchmarks.phase_pilot.power_mechanism import decided, holm_rows

    rng = np.random.default_rng(0)
    d = rng.normal([1.0, -1.0, 0.0], 0.1, (50, 20, 3))  # [sims, seeds, tests]
    out = decided(d)
    assert out[:, 0].all() and not out[:, 1].any() and out[:, 2].mean() < 0.2
    p = rng.random((20, 7)) ** 3
    assert holm_rows(p) == pytest.approx(np.stack([multipletests(r, method="holm")[1] for r in p]))


def test_power_picks_the_smallest_n_with_the_tests_it_is_told_to_power_as_observed(capsys):
    """`power_mechanism --as-observed` on experiment 5's rows (experiment 5R's pilot): with every test at its SESOI
    the rule picks 10 seeds (T1 0.82); an unknown test id is one error."""
    from benchmarks.phase_pilot import power_mechanism as pm

    rows = str(ROOT / "reports" / "mechanism_exp5" / "mechanism.jsonl.gz")
    assert pm.main([rows, "--as-observed", ""]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == ("chosen: 10 seeds (the smallest n with power >= 0.8 on every primary test: at its SESOI on "
                       "experiment 5's grid); 2.5 CPU-hours")
    # as observed (either sign), T1's -0.11 is decided in 57% of simulations at 24 seeds: the default rule (T1 as
    # observed) picks no n up to 24
    observed = out[out.index(next(line for line in out if line.startswith("power, as observed"))):]
    assert next(line for line in observed if line.startswith("| 24 |")).split(" | ")[2] == "0.57"
    with pytest.raises(SystemExit):
        pm.main([rows, "--as-observed", "T9"])
    assert "--as-observed='T9': the primary tests are PC, T1, T3, T4, T5, T6" in capsys.readouterr().err
