"""Issue 60, item 1: the routing-drift dial never passes for natural drift in the reports. A dialled run's report
names the dial (settings, realised `routing/dial_flip_frac`) in its header, its first summary sentence and a
drift table that splits the drift into injected and the rest; the comparison has a per-arm table; a run without
the dial reads exactly as before (no line, row or table added; the config's explicit 0 changes nothing)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from analysis.compare import ArmRun, build_comparison
from analysis.dial_report import DialDrift, probe_dial, run_dial
from analysis.report import build_report
from synth_run import synthetic_probe
from test_compare import _table_rows
from test_report import md_table

# per step: the dial changed 20% of the routes; rollout vs learner differ on 21% and 23% of them per layer
INJECTED, LAYERS, ANY = [0.19, 0.21], [[0.21, 0.23], [0.2, 0.22]], [0.36, 0.38]


def _run(d: Path, *, flip: float | None, dial_logged: bool, config_dial: bool = True) -> Path:
    d.mkdir(parents=True)
    rows = []
    for t in range(2):
        r = {"step": t, "reward/mean": 0.5, "routing/any_layer_flip": ANY[t], "routing/layer_disagree": LAYERS[t]}
        if dial_logged:
            r |= {"routing/dial_flip_prob": flip, "routing/dial_noise_std": 0.0, "routing/dial_flip_frac": INJECTED[t]}
        rows.append(r)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rollout = f"rollout:\n  engine: hf\n  dtype: bfloat16\n  router_flip_prob: {flip}\n" if config_dial and flip is not None \
        else "rollout:\n  engine: hf\n  dtype: bfloat16\n"
    (d / "config.yaml").write_text("algo:\n  name: grpo\n  routing_replay: none\n" + rollout)
    return d


def test_a_dialled_runs_report_names_the_dial_its_rate_and_the_split(tmp_path):
    md = build_report(_run(tmp_path / "grpo-none-s0", flip=0.2, dial_logged=True), tmp_path / "r").markdown.read_text()
    header = md.split("## Summary")[0]
    assert "Rollout: hf engine in bfloat16" in header  # as before, and now the dial beside it
    assert ("Routing-drift dial: ON, rollout.router\\_flip\\_prob=0.2, rollout.router\\_noise\\_std=0 (config.yaml)"
            not in header)  # snake_case stays readable (md_plain escapes only a boundary underscore)
    assert ("Routing-drift dial: ON, rollout.router_flip_prob=0.2, rollout.router_noise_std=0 (config.yaml): the "
            "rollout engine's routes are perturbed on purpose (injected drift); realised: 20% of its (token, MoE "
            "layer) routes changed by the dial (routing/dial_flip_frac, mean over 2 steps)") in header
    summary = md.split("## Summary")[1].split("\n## ")[0].strip().splitlines()
    # the first sentence splits it: injected 20%, total mean(0.22, 0.21) = 21.5%, natural >= 1.5%
    assert summary[0].startswith("- Injected drift: the routing-drift dial (rollout.router_flip_prob=0.2, "
                                 "rollout.router_noise_std=0) changed 20% of the rollout engine's (token, MoE layer) "
                                 "routes (routing/dial_flip_frac, mean over 2 steps), of the 21.5% that differ")
    assert "it is at least 1.5% (total − injected)" in summary[0]
    routing = [s for s in summary if s.startswith("- Routing")]
    assert routing == [s for s in summary if "of response tokens were routed differently" in s]
    assert routing[0].startswith("- Routing (injected by the dial and natural together): 37% of response tokens")
    table = md_table(md, "Routing drift: injected by the dial, and the rest")
    assert table["dial setting rollout.router_flip_prob"] == "0.2"
    assert table["injected: (token, MoE layer) routes the dial changed (routing/dial_flip_frac, mean over 2 steps)"] \
        == "0.2"
    assert table["total − injected: a lower bound on the natural drift"] == "0.015"
    assert table["natural: the learner against the undialled routes"].startswith("not recorded")
    head = md_table(md, "Headline numbers")
    assert any(k.endswith("(injected by the dial and natural together)") and v == "0.37" for k, v in head.items())


def test_an_undialled_report_is_unchanged(tmp_path):
    """No dial in config.yaml and none logged: no line, sentence, row or table of the dial; and a config that
    spells the dial out at 0 (what a resolved config.yaml holds) gives the same report byte for byte."""
    plain = _run(tmp_path / "a" / "grpo-none-s0", flip=None, dial_logged=False)
    zero = _run(tmp_path / "b" / "grpo-none-s0", flip=0.0, dial_logged=False)
    md_plain = build_report(plain, tmp_path / "ra").markdown.read_text()
    md_zero = build_report(zero, tmp_path / "rb").markdown.read_text()
    strip = lambda md: md.split("<details>")[0].replace(str(tmp_path / "a"), "").replace(str(tmp_path / "b"), "")  # noqa: E731
    assert "dial" not in strip(md_plain).lower() and "injected" not in md_plain
    assert "- Routing: 37% of response tokens were routed differently" in md_plain
    assert strip(md_plain) == strip(md_zero)
    assert run_dial({"rollout": {"router_flip_prob": 0.0, "router_noise_std": 0.0}}, []) is None


def test_the_dial_is_read_from_the_metrics_when_config_yaml_has_no_dial(tmp_path):
    run = _run(tmp_path / "grpo-none-s0", flip=0.1, dial_logged=True, config_dial=False)
    md = build_report(run, tmp_path / "r").markdown.read_text()
    assert "Routing-drift dial: ON, rollout.router_flip_prob=0.1, rollout.router_noise_std=0 (metrics.jsonl)" in md


def test_natural_lower_bound_by_hand():
    d = DialDrift(0.2, 0.0, "config.yaml", injected=0.2, total=0.215, steps=2)
    assert d.natural_lower_bound == pytest.approx(0.015)
    assert DialDrift(0.2, 0.0, "x", injected=0.2, total=0.19, steps=1).natural_lower_bound == 0.0  # sampling jitter
    recs = [{"step": 0, "routing/dial_flip_frac": 0.3, "routing/layer_disagree": [0.3, None]},
            {"step": 1, "routing/dial_flip_frac": 0.1, "routing/layer_disagree": [0.2, 0.4]},
            {"step": 2, "routing/dial_flip_frac": 0.5}]  # no total on step 2: left out of both means
    d = run_dial({"rollout": {"router_flip_prob": 0.2}}, recs)
    assert (d.injected, d.total, d.steps) == (pytest.approx(0.2), pytest.approx(0.3), 2)


def test_the_comparison_splits_the_drift_per_arm(tmp_path):
    on = [ArmRun("grpo-none-p20", s, _run(tmp_path / f"grpo-none-p20-s{s}", flip=0.2, dial_logged=True))
          for s in range(2)]
    off = [ArmRun("grpo-none-p0", 0, _run(tmp_path / "grpo-none-p0-s0", flip=0.0, dial_logged=False))]
    md = build_comparison(on + off, tmp_path / "cmp", reps=50).markdown.read_text()
    assert ("Routing-drift dial ON in 1 of 2 arms (grpo-none-p20): their rollout routes were perturbed on purpose"
            in md.split("## ")[0])
    rows = _table_rows(md, "Routing drift per arm")
    assert rows["grpo-none-p20"][1:] == ["rollout.router_flip_prob=0.2, rollout.router_noise_std=0", "0.2", "0.215",
                                         "not recorded (≥ 0.015: total − injected)", "0.37"]
    assert rows["grpo-none-p0"][1:] == ["off", "0 (off)", "0.215", "0.215 (measured: no dial)", "0.37"]
    md_off = build_comparison(off, tmp_path / "cmp_off", reps=50).markdown.read_text()
    assert "dial" not in md_off.replace(str(tmp_path), "").lower()


def test_a_probe_file_with_the_dial_shows_the_split(tmp_path):
    probe = synthetic_probe() | {"routing/dial_flip_prob": 0.1, "routing/dial_noise_std": 0.0,
                                 "routing/dial_flip_frac": 0.02}
    path = tmp_path / "drift.json"
    path.write_text(json.dumps(probe))
    md = build_report(path, tmp_path / "r").markdown.read_text()
    assert "routing-drift dial: ON, rollout.router_flip_prob=0.1, rollout.router_noise_std=0" in md
    table = md_table(md, "Probe: routing drift: injected by the dial, and the rest")
    assert table["total − injected: a lower bound on the natural drift"] == "0.005"  # mean(0.02, 0.03) − 0.02
    assert probe_dial(synthetic_probe()) is None
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps(synthetic_probe()))
    assert "dial" not in build_report(plain, tmp_path / "r2").markdown.read_text().replace(str(tmp_path), "").lower()
