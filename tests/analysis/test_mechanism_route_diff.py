"""analysis.mechanism_route_diff: the rollout's routes against pi_old's natural routes in one mechanism setting."""

from __future__ import annotations

from analysis import mechanism_route_diff as rd

SMALL = dict(seed=3, depth=2, length=8, warm_steps=0, minibatches=4)


def test_the_dial_flips_routes_that_the_diff_finds_and_places():
    diffs, total = rd.route_diffs(dose=0.4, **SMALL)
    assert total == 32 * (8 + 8 - 1) * 2  # rows x (prompt + response - 1) positions x MoE layers
    assert len(diffs) > 0.05 * total, "a 40% dial flips many routes"
    for d in diffs:
        assert d.rollout != d.old and d.rollout == sorted(d.rollout) and d.old == sorted(d.old)
        assert 0 <= d.k < 4 and 0 <= d.layer < 2 and 0 <= d.row < 32
        assert d.top_logits == sorted(d.top_logits, reverse=True) and len(d.top_logits) == len(d.old) + 1


def test_without_the_dial_only_router_ties_can_differ(capsys):
    """fp32, dose 0: the rollout's KV-cached decoding and pi_old's full forward are the same mathematics, so any
    route they disagree on is a tie at float resolution (experiment 5's check C2)."""
    diffs, total = rd.route_diffs(dose=0.0, **SMALL)
    assert len(diffs) <= 0.001 * total
    for d in diffs:
        assert d.top_logits[-2] - d.top_logits[-1] < 1e-5, d
    assert rd.main(["--seed", "3", "--depth", "2", "--length", "8", "--warm-steps", "0", "--minibatches", "4"]) == 0
    assert f"{len(diffs)} of {total} token-layers" in capsys.readouterr().out
