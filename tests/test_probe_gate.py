"""The probe as a CI gate (analysis/phase_gate.py, issue 47 item 9): thresholds exit 1 with one line each, the
phase diagram's critical mismatch scales the measured flip rate, bad gate flags are one line before any compute."""

from __future__ import annotations

import json

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
    assert "of its critical mismatch" in out and "tolerated every dose tested" in out
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
