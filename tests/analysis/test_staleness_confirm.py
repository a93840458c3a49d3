"""analysis.staleness_confirm (experiment 6R's pre-registered analysis): H1's sign-flip test and the controls by
hand on synthetic matrices, each branch of the pre-registered verdict, the page regenerated from the saved metrics,
and a missing arm as one clear error."""

from __future__ import annotations

import pytest

from analysis.phase_runs import load_phase
from analysis.phase_stats import arms
from analysis.staleness_confirm import confirm_page, main, paired_mean, verdicts
from test_staleness import _write

SEEDS = range(6100, 6108)


def _matrix(root, *, gspo: float = 1.0, pos: float = 0.4, r2_jitter: float = 0.01):
    """GRPO at N = 16 stalls (0.77) on seeds 6100-6101 and solves (0.99) on the rest; GSPO at `gspo` everywhere;
    controls: R2 at N = 1 0.8 +- `r2_jitter` alternating against GRPO's 0.8, `pos` against GRPO at N = 4's 0.95."""
    for s in SEEDS:
        n = s - SEEDS[0]
        _write(root / f"grpo-none-mb16-s{s}", 0.77 if n < 2 else 0.99, 16)
        _write(root / f"gspo-none-mb16-s{s}", gspo, 16)
        _write(root / f"grpo-none-mb1-s{s}", 0.8, 1)
        _write(root / f"grpo-r2-mb1-s{s}", 0.8 + (r2_jitter if n % 2 else -r2_jitter), 1)
        _write(root / f"grpo-none-mb4-s{s}", 0.95, 4)
        _write(root / f"grpo-none-pos-s{s}", pos, 4)
    return root


def test_h1_by_hand(tmp_path):
    by = arms(load_phase(_matrix(tmp_path)))
    r = paired_mean(by["gspo-none"]["mb16"], by["grpo-none"]["mb16"])
    # differences +0.23, +0.23, +0.01 x 6, all positive: mean 0.52 / 8; exact sign-flip p 2 / 2^8
    assert r["n"] == 8 and r["mean"] == pytest.approx(0.52 / 8)
    assert r["p"] == pytest.approx(2 / 256) and r["only_a"] == 0 and r["only_b"] == 2
    h1, (zero, positive), line = verdicts(by)
    assert h1["decided"] and positive["decided"] and not zero["decided"]
    assert zero["p"] == pytest.approx(1.0)  # +-0.01 alternating: mean 0
    assert line.startswith("**H1 decided")


def test_a_missed_positive_control_fails_the_experiment(tmp_path):
    h1, (_, positive), line = verdicts(arms(load_phase(_matrix(tmp_path, pos=0.95))))
    assert h1["decided"] and not positive["decided"] and line.startswith("**The experiment failed")


def test_a_positive_control_in_the_wrong_direction_is_not_decided(tmp_path):
    _, (_, positive), line = verdicts(arms(load_phase(_matrix(tmp_path, pos=0.99))))
    assert positive["p"] == pytest.approx(2 / 256) and not positive["decided"] and "failed" in line


def test_a_decided_zero_control_makes_h1_not_attributable(tmp_path):
    root = _matrix(tmp_path)
    for s in SEEDS:  # R2 above GRPO on every seed at N = 1
        (root / f"grpo-r2-mb1-s{s}").rename(root / f"old-{s}")
        _write(root / f"grpo-r2-mb1-s{s}", 0.9, 1)
    _, (zero, _), line = verdicts(arms(load_phase(root)))
    assert zero["decided"] and "not attributable" in line


def test_no_effect_of_the_pilots_size(tmp_path):
    # GSPO equals GRPO where GRPO solved (0.99) and is 0.772 / 0.768 where it stalled: differences 0 x 6, +-0.002,
    # mean 0 with a t CI far inside +-0.035
    root = tmp_path / "m"
    _matrix(root, gspo=0.99)
    for s in (6100, 6101):
        (root / f"gspo-none-mb16-s{s}").rename(root / f"old-{s}")
        _write(root / f"gspo-none-mb16-s{s}", 0.77 + (0.002 if s % 2 else -0.002), 16)
    h1, _, line = verdicts(arms(load_phase(root)))
    assert not h1["decided"] and h1["hi"] < 0.035 and "no effect of the pilot's size" in line


def test_the_page_regenerates_from_the_saved_metrics(tmp_path):
    root = _matrix(tmp_path / "m")
    saved = tmp_path / "m.jsonl.gz"
    assert main([str(root), "--out", str(tmp_path / "a.md"), "--save-metrics", str(saved), "--bootstrap-reps",
                 "200"]) == 0
    assert main([str(saved), "--out", str(tmp_path / "b.md"), "--bootstrap-reps", "200"]) == 0
    page = (tmp_path / "a.md").read_text()
    assert page == (tmp_path / "b.md").read_text()
    assert page.rstrip("\n") == confirm_page(load_phase(root), reps=200)
    assert "| H1: gspo-none vs grpo-none at N = 16 | 8 | +0.065 [" in page and "| grpo-none | pos | 8 |" in page


def test_a_missing_arm_is_one_clear_error(tmp_path, capsys):
    root = _matrix(tmp_path / "m")
    for s in SEEDS:
        (root / f"grpo-none-pos-s{s}" / "done.json").unlink()
    assert main([str(root)]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "grpo-none-pos" in err and "ablation_training_exp6r.yaml" in err
