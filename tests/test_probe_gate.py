"""The probe as a CI gate (analysis/phase_gate.py, issue 47 item 9): thresholds exit 1 with one line each, the
phase diagram's critical mismatch scales the measured flip rate, bad gate flags are one line before any compute."""

from __future__ import annotations

import json
import math

import pytest

from analysis.phase_gate import Thresholds, check_thresholds, phase_keys, violations
from moe_gspo import probe
from moe_gspo.tiny import make_tiny_checkpoint

X = {"p0": 0.0, "p5": 0.05, "p20": 0.2, "p80": 0.8}
DROP = {"grpo-none": {"p0": 0.0, "p5": -0.02, "p20": -0.15, "p80": -0.4},
        "grpo-r3": {"p0": 0.0, "p20": 0.0, "p80": -0.05}}  # as tests/analysis/test_phase.py (x* = 0.1173)


def _write(d, final: float, x: float, steps: int = 40):
    d.mkdir(parents=True)
    rows = [{"step": t, "reward/mean": final if t >= steps - 4 else 0.5, "reward/frac_zero_std": 0.2,
             "actor/entropy": 1.0, "routing/layer_disagree": [x, x], "mismatch/k3_kl": 1e-4} for t in range(steps)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "done.json").write_text(json.dumps({"step": steps}))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("gate")
    make_tiny_checkpoint(d / "model", seed=1)
    (d / "prompts.txt").write_text("0123:\nabcd<\n57+21=\nhello world\n")
    for method, drops in DROP.items():
        algo, replay = method.split("-")
        for dose, drop in drops.items():
            for seed in range(4):
                _write(d / "phase" / f"{algo}-{replay}-{dose}-s{seed}", 0.9 + drop + 0.001 * seed, X[dose])
    return d


def _probe(ckpt, tmp_path, *extra):
    out = tmp_path / "drift.json"
    rc = probe.main(["--model", str(ckpt / "model"), "--prompts", str(ckpt / "prompts.txt"), "--out", str(out),
                     "--samples-per-prompt", "4", "--max-new-tokens", "8", "--dtype", "bfloat16", *extra])
    return rc, (json.loads(out.read_text()) if out.exists() else None)


def test_thresholds_pass_and_fail_with_one_line_each(ckpt, tmp_path, capsys):
    rc, res = _probe(ckpt, tmp_path, "--max-flip", "1.0", "--max-k3", "1.0")
    assert rc == 0 and res["gate/violations"] == []
    capsys.readouterr()
    rc, res = _probe(ckpt, tmp_path, "--max-flip", "0", "--max-k3", "0")  # bf16 flips routes: above 0
    err = capsys.readouterr().err
    assert rc == 1 and len(res["gate/violations"]) == 2
    assert err.count("gate: ") == 2 and "> --max-flip 0" in err and "> --max-k3 0" in err


def test_phase_places_the_checkpoint_on_the_diagram(ckpt, tmp_path, capsys):
    rc, res = _probe(ckpt, tmp_path, "--phase", str(ckpt / "phase"), "--max-critical-frac", "1e-9")
    out, err = capsys.readouterr()
    crit = res["phase/grpo-none/critical_flip"]
    assert crit == pytest.approx(0.1173, abs=1e-3)  # the synthetic matrix's x* (tests/analysis/test_phase.py)
    flips = sum(res["routing/layer_disagree"]) / len(res["routing/layer_disagree"])
    assert res["phase/grpo-none/fraction_of_critical"] == pytest.approx(flips / crit)
    assert res["phase/grpo-r3/critical_flip"] is None and res["phase/grpo-r3/largest_tolerated"] == pytest.approx(0.8)
    assert res["phase/grpo-none/largest_tolerated"] == pytest.approx(0.05)  # the page's rule (test_phase.py)
    assert "of its critical mismatch" in out and "largest dose tolerated 5%" in out
    assert "  grpo-r3: critical mismatch not reached at any dose tested (up to 80%); largest dose tolerated 80% (" in out
    assert rc == 1 and "critical mismatch" in err  # any flip is above 1e-9 of it


@pytest.mark.parametrize("flags,msg", [
    (["--max-flip", "2"], "a share in [0, 1]"),
    (["--max-k3", "-1"], "finite number >= 0"),
    (["--max-critical-frac", "0.5"], "needs --phase"),
    (["--phase", "/nonexistent/phase"], "does not exist"),
])
def test_bad_gate_flags_are_one_line_before_any_compute(ckpt, tmp_path, capsys, flags, msg):
    rc, res = _probe(ckpt, tmp_path, *flags)
    err = capsys.readouterr().err
    assert rc == 2 and res is None and msg in err and err.count("error:") == 1


def test_violations_by_hand():
    res = {"mismatch/k3_kl": 2e-3, "routing/layer_disagree": [0.02, 0.04]}
    assert violations(res, Thresholds(max_k3=1.5e-3, max_flip=0.05), None) == ["gate: mismatch/k3_kl 2.000e-03 > --max-k3 0.0015"]
    assert violations(res, Thresholds(max_flip=0.025), None) == ["gate: per-layer flip rate 0.0300 > --max-flip 0.025"]
    with pytest.raises(ValueError, match="needs --phase"):
        check_thresholds(Thresholds(max_critical_frac=1.0), have_phase=False)
    assert phase_keys(res, {}) == {}


def _matrix(d, drops: dict[str, list[float]]):
    """grpo-none arms with per-seed final-reward drops against p0 (final 0.7 at p0)."""
    for dose, per_seed in drops.items():
        for seed, drop in enumerate(per_seed):
            _write(d / f"grpo-none-{dose}-s{seed}", 0.7 + drop, X[dose])
    return d


def test_max_critical_frac_names_its_rule_when_x_star_is_not_reached(tmp_path):
    """Issue 60: with x* not reached the gate used to pass without a word. Its rule (CRITICAL_FRAC_RULE, --help, README):
    it scales the largest dose tolerated instead, saying so in one line; with no dose tolerated either it fails."""
    from analysis.phase_gate import CRITICAL_FRAC_RULE, gate_notes, load_fits

    # the drop stays near 0 up to 20%: x* not reached, 20% tolerated by the CI rule
    safe = _matrix(tmp_path / "safe", {"p0": [0.0] * 6, "p5": [0.0, 0.01] * 3, "p20": [-0.01, 0.0] * 3})
    gate = Thresholds(max_critical_frac=0.5)
    fits = load_fits(str(safe), gate, reps=200)
    assert math.isnan(fits["grpo-none"].critical.value) and fits["grpo-none"].largest_tolerated == pytest.approx(0.2)
    assert gate_notes(gate, fits) == ["gate: grpo-none's critical mismatch not reached at any dose tested (up to 20%): "
                                      "--max-critical-frac scales its largest dose tolerated, 20%, instead"]
    assert violations({"routing/layer_disagree": [0.09, 0.09]}, gate, fits) == []  # 0.09 <= 0.5 x 0.2
    assert violations({"routing/layer_disagree": [0.11, 0.11]}, gate, fits) == [
        "gate: per-layer flip rate 0.1100 > --max-critical-frac 0.5 x grpo-none's largest dose tolerated 0.2000 (its "
        "critical mismatch not reached at any dose tested (up to 20%))"]
    # the seeds spread: the point fit never reaches x*, but the CI reaches -0.1 at the first dose (the page's "none
    # shown"): nothing to scale, so the gate fails with one line, whatever the flip rate
    noisy = _matrix(tmp_path / "noisy", {"p0": [0.0] * 6, "p5": [0.15, -0.25] * 3, "p20": [0.0] * 6})
    fits = load_fits(str(noisy), gate, reps=200)
    assert math.isnan(fits["grpo-none"].critical.value) and math.isnan(fits["grpo-none"].largest_tolerated)
    assert gate_notes(gate, fits) == []
    lines = violations({"routing/layer_disagree": [0.0, 0.0]}, gate, fits)
    assert len(lines) == 1 and lines[0].startswith("gate: --max-critical-frac cannot place this checkpoint: grpo-none's "
                                                   "critical mismatch not reached at any dose tested (up to 20%), and no "
                                                   "dose is tolerated by the pre-registered rule")
    assert phase_keys({"routing/layer_disagree": [0.0, 0.0]}, fits)["phase/grpo-none/largest_tolerated"] is None
    assert "largest dose tolerated" in CRITICAL_FRAC_RULE and "not reached" in CRITICAL_FRAC_RULE


def test_the_rule_is_in_help_and_readme(capsys):
    from pathlib import Path

    from analysis.phase_gate import CRITICAL_FRAC_RULE

    with pytest.raises(SystemExit):
        probe.parse_args(["--help"])
    assert "".join(CRITICAL_FRAC_RULE.split()) in "".join(capsys.readouterr().out.split())  # argparse wraps at hyphens
    readme = " ".join((Path(__file__).resolve().parent.parent / "README.md").read_text().split())
    assert CRITICAL_FRAC_RULE in readme


def test_a_phase_matrix_named_against_the_dose_rule_is_one_line_naming_it(tmp_path):
    """`--phase` on a matrix whose variants break the dose-naming rule (`zero`, `n05`): the gate's one line names the
    rule and the doses it found, as analysis.phase does (it used to say only 'no method has a zero-drift arm')."""
    from analysis.phase_gate import load_fits

    for dose, x in (("zero", 0.0), ("n05", 0.05)):
        for seed in range(3):
            _write(tmp_path / f"grpo-none-{dose}-s{seed}", 0.7, x)
    with pytest.raises(ValueError) as e:
        load_fits(str(tmp_path), Thresholds(), reps=10)
    msg = str(e.value)
    assert msg.startswith("--phase: ") and "\n" not in msg
    assert "doses found: grpo-none: n05, zero" in msg and "p0" in msg and "s<X>" in msg
