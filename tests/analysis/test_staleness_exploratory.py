"""analysis.staleness_exploratory (experiment 6's post-hoc look): the sign-flip p and McNemar's exact p by hand, a
bistable case where the mean test sees what the signed-rank test cannot, the table's counts on a synthetic matrix,
and the page's section only on request."""

from __future__ import annotations

import math

import pytest

from analysis.phase_runs import load_phase
from analysis.staleness import CONTROLS, FIXES, main, staleness_arms, staleness_page
from analysis.staleness_exploratory import exploratory_table, mcnemar_p, sign_flip_p
from analysis.stats import wilcoxon_p
from test_staleness import _write


def test_sign_flip_p_by_hand():
    # 3 differences of +1: 2^3 sign patterns, |mean| = 1 in 2 of them
    assert sign_flip_p([1.0, 1.0, 1.0]) == pytest.approx(2 / 8)
    assert sign_flip_p([0.0, 0.0]) == 1.0 and math.isnan(sign_flip_p([0.3]))


def test_a_few_stalls_move_the_mean_test_but_not_the_ranks():
    # bistable pairs: 4 seeds where B stalled (+0.22) and 6 where both solved, A 0.01 lower. Of the 2^10 sign
    # patterns, |sum| >= 0.82 needs the four large ones to share a sign (2 * 2^6): p = 128 / 1024 exactly.
    d = [0.22] * 4 + [-0.01] * 6
    assert sign_flip_p(d) == pytest.approx(0.125)
    assert wilcoxon_p(d) > 0.5  # six small negative ranks (21) against four large positive ones (34)


def test_mcnemar_exact_p_by_hand():
    assert mcnemar_p(9, 0) == pytest.approx(2 * 0.5 ** 9)
    assert mcnemar_p(0, 0) == 1.0 and mcnemar_p(3, 3) == pytest.approx(1.0)
    assert mcnemar_p(2, 1) == pytest.approx(1.0)  # 2 of 3: P(X <= 1) + P(X >= 2) of Binomial(3, 1/2)


def _matrix(root):
    """GRPO at N = 16 stalls (0.77) on seeds 1 and 2 of 6; GSPO solves (0.99) on all; GRPO solves at 1.0."""
    for seed in range(1, 7):
        _write(root / f"grpo-none-mb16-s{seed}", 0.77 if seed <= 2 else 1.0, 16)
        _write(root / f"gspo-none-mb16-s{seed}", 0.99, 16)
    return root


def test_the_table_counts_stalls_and_discordant_seeds(tmp_path):
    table = exploratory_table(staleness_arms(load_phase(_matrix(tmp_path))), FIXES, CONTROLS)
    row = next(line for line in table if line.startswith("| gspo-none vs grpo-none at N = 16 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "6"
    # differences +0.22, +0.22, -0.01 x 4: mean 0.40 / 6
    assert cells[2].startswith(f"{0.40 / 6:+.3f} [")
    assert cells[4] == "0 / 2" and cells[5] == "0 / 2" and cells[6] == "0.5"  # McNemar: 2 of 2 discordant
    assert not any("grpo-r2" in line for line in table)  # an arm the matrix lacks: no row
    assert "No pair" in exploratory_table({}, FIXES, CONTROLS)[0]


def test_the_section_only_on_request_and_after_the_rest(tmp_path):
    runs = load_phase(_matrix(tmp_path / "m"))
    plain = staleness_page(runs, reps=200, controls=True)
    more = staleness_page(runs, reps=200, controls=True, exploratory=True)
    assert "Exploratory" not in plain and more.startswith(plain)
    assert main([str(tmp_path / "m"), "--controls", "--exploratory", "--bootstrap-reps", "200",
                 "--out", str(tmp_path / "x.md")]) == 0
    assert (tmp_path / "x.md").read_text().rstrip("\n") == more.rstrip("\n")
