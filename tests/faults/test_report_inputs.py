"""Issue 49, defects 10 and 12: `analysis.compare` refuses a run directory that does not exist or is given twice
(the same directory twice counted as 2 seeds, with CIs over them; a missing one gave exit 0 and an all-n/a arm,
mentioned only at line 113 of report.md), and an R3 run's report says whether routing replay worked
(`r3/replay_mismatch_frac` and `r3/fallback_*` appeared in neither report.md nor its summary)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from analysis.compare import main as compare_main
from analysis.report import build_report


def _run(d: Path, rows: list[dict], replay: str = "none") -> Path:
    d.mkdir(parents=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "reward/mean": 0.1 * i, **r}) + "\n"
                                             for i, r in enumerate(rows)))
    (d / "config.yaml").write_text(f"algo:\n  name: grpo\n  routing_replay: {replay}\n")
    return d


@pytest.mark.parametrize("how", ["twice", "same_arm_seed", "missing"])
def test_compare_refuses_a_run_given_twice_or_missing(tmp_path, capsys, how):
    a = _run(tmp_path / "a-s0", [{}] * 4)
    other = {"twice": [str(a), str(tmp_path / "." / "a-s0")],
             "same_arm_seed": [str(_run(tmp_path / "x" / "a-s0", [{}] * 4))],
             "missing": [str(tmp_path / "nonexistent")]}[how]
    out = tmp_path / "cmp"
    assert compare_main([str(out), str(a), *other]) == 2
    err = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert {"twice": f"run directory {str(tmp_path / '.' / 'a-s0')!r} is given twice",
            "same_arm_seed": "are both arm a seed 0",
            "missing": f"run directory {str(tmp_path / 'nonexistent')!r} does not exist"}[how] in err[0]
    assert not out.exists()  # nothing written


def _r3_rows(mismatch: list[float | None]) -> list[dict]:
    return [{"r3/replay_mismatch_frac": m, "r3/fallback_token_frac": 0.01 * i, "r3/fallback_seq_frac": 0.1,
             "r3/num_rows": 100, "r3/fallback_rows_missing": i, "r3/fallback_rows_range": 0}
            for i, m in enumerate(mismatch)]


def test_an_r3_report_says_whether_replay_held(tmp_path):
    held = build_report(_run(tmp_path / "held", _r3_rows([0.0, 0.0, None, 0.0]), "r3"), tmp_path / "out1")
    md = held.markdown.read_text()
    summary = md.split("## Summary", 1)[1].split("\n## ", 1)[0]
    assert ("Routing replay (R3) held: on all 3 checked steps every replayed (token, MoE layer) row used the rollout "
            "engine's experts (r3/replay_mismatch_frac 0); 1.5% of the replayed rows fell back to the learner's own "
            "routing (r3/fallback_token_frac, mean over 4 steps; max 3%); failed rows by reason: missing 6.") in summary
    table = md.split("## Routing replay (R3)", 1)[1].split("\n## ", 1)[0]
    assert "| r3/replay_mismatch_frac | 0 | 0 | 3 of 4 |" in table
    assert "| r3/fallback_rows_missing | 6 (total) | 3 | 4 of 4 |" in table

    broke = build_report(_run(tmp_path / "broke", _r3_rows([0.0, 0.02, 0.0, 0.04]), "r3"), tmp_path / "out2")
    assert ("Routing replay (R3) did NOT hold on 2 of 4 steps: up to 4% of the replayed rows used other experts than "
            "the rollout engine's (r3/replay_mismatch_frac, max over steps; mean 1.5%)") in broke.markdown.read_text()

    plain = build_report(_run(tmp_path / "plain", [{}] * 4), tmp_path / "out3").markdown.read_text()
    assert "Routing replay (R3)" not in plain  # not an R3 run: nothing said


def test_compare_shows_whether_replay_held_per_arm(tmp_path):
    runs = [_run(tmp_path / "grpo-r3-s0", _r3_rows([0.0, 0.0]), "r3"),
            _run(tmp_path / "grpo-r3-s1", _r3_rows([0.0, 0.05]), "r3"), _run(tmp_path / "grpo-none-s0", [{}] * 2)]
    assert compare_main([str(tmp_path / "cmp"), *map(str, runs), "--bootstrap-reps", "50"]) == 0
    md = (tmp_path / "cmp" / "report.md").read_text()
    section = md.split("## Train-inference mismatch", 1)[1].split("\n## ", 1)[0]
    rows = {l.split("|")[1].strip(): [c.strip() for c in l.strip("|").split("|")] for l in section.splitlines()
            if l.startswith("| grpo-")}
    assert rows["grpo-r3"][-2:] == ["0.05", "0.005"]  # the worst seed's max; fallback: mean over steps, then seeds
    assert rows["grpo-none"][-2:] == ["n/a", "n/a"]


# --------------------------------------------------------------------------- issue 59 item 7: damaged inputs

def test_a_damaged_trace_file_skips_its_figure(tmp_path, capsys):
    """An .npz that is not a zip (BadZipFile: neither OSError nor ValueError) was a traceback; now the figures that
    read it are skipped with the reason and the report is built."""
    from analysis.report import main as report_main

    d = _run(tmp_path / "run", [{}] * 4)
    (d / "traces").mkdir()
    (d / "traces" / "step_000001_logprobs.npz").write_bytes(b"PK\x03\x04 cut short")
    (d / "traces" / "step_000001_rollout.npz").write_bytes(b"garbage")
    assert report_main([str(d), "--out", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert "could not read inputs: BadZipFile" in err and "Traceback" not in err
    assert (tmp_path / "out" / "report.md").is_file()


@pytest.mark.parametrize("content,says", [
    (__import__("gzip").compress(b"{}"), "is not UTF-8 text (a compressed file?)"),
    (b"[" * 100_000 + b"]" * 100_000, "is not valid JSON: nested too deep"),
    (b'{"mismatch/k3_kl": 1,', "is not valid JSON: Expecting property name enclosed in double quotes at line 1"),
], ids=["gzip", "deep", "cut"])
def test_a_damaged_probe_file_is_one_line(tmp_path, capsys, content, says):
    from analysis.report import main as report_main

    p = tmp_path / "drift.json"
    p.write_bytes(content)
    assert report_main([str(p)]) == 2
    err = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    assert len(err) == 1 and f"probe file {str(p)!r} {says}" in err[0], err
    assert sorted(x.name for x in tmp_path.iterdir()) == ["drift.json"]


@pytest.mark.parametrize("step,says", [("1" + "0" * 30, "'step' 1e+30 is out of range"),
                                       ("NaN", "no integer 'step' field"), ("-Infinity", "no integer 'step' field")])
def test_a_step_beyond_int64_or_not_finite_is_a_skipped_line(tmp_path, capsys, step, says):
    """`step` 1e30 (a damaged line) overflowed numpy's int64 (OverflowError) in report and compare; NaN and
    Infinity (JSON as Python reads it) raised in int()."""
    from analysis.report import main as report_main

    d = _run(tmp_path / "a-s0", [{}] * 4)
    with open(d / "metrics.jsonl", "a") as f:
        f.write('{"step": %s, "reward/mean": 0.5}\n' % step)
    assert report_main([str(d), "--out", str(tmp_path / "out")]) == 0
    assert f"metrics.jsonl: skipped line 5: {says}" in capsys.readouterr().err
    assert compare_main([str(tmp_path / "cmp"), str(d), "--bootstrap-reps", "50"]) == 0


def test_staleness_names_its_own_run_pattern(tmp_path, capsys):
    """issue 59 item 8: the staleness tool's error quoted the phase tool's `<algo>-<replay>-<dose>[_<fix>]-s<seed>`."""
    from analysis.staleness import main as staleness_main

    (tmp_path / "not-a-run").mkdir()
    assert staleness_main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no finished run named <algo>-<replay>-mb<N>-s<seed>" in err and "<dose>" not in err, err
