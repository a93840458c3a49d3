import json

import pytest

from benchmarks.metrics_match import main, mismatches


def _rows(**over):
    base = [{"step": 0, "loss/total": 0.5, "reward/mean": 0.25, "perf/step_time_s": 1.0, "eval/accuracy": float("nan")},
            {"step": 1, "loss/total": 0.4, "reward/mean": 0.5, "perf/step_time_s": 2.0, "eval/accuracy": float("nan")}]
    base[1].update(over)
    return base


def test_timings_apart_rows_match_within_tolerance_only():
    assert mismatches(_rows(), _rows(**{"perf/step_time_s": 9.0}), rtol=1e-5, atol=1e-7) == []
    assert mismatches(_rows(), _rows(**{"loss/total": 0.4 * (1 + 1e-7)}), rtol=1e-5, atol=1e-7) == []
    bad = mismatches(_rows(), _rows(**{"loss/total": 0.4001}), rtol=1e-5, atol=1e-7)
    assert bad == ["metrics row 1 (step 1): loss/total = 0.4001, the reference has 0.4"]
    assert mismatches(_rows(), _rows(**{"eval/accuracy": 1.0}), rtol=1e-5, atol=1e-7)  # NaN equals only NaN


def test_a_per_layer_list_matches_element_by_element_within_tolerance():
    """Was: lists compared exactly, so a per-layer metric (router/entropy_learner) 1e-9 off was a mismatch."""
    layers = [1.9659354154306719, 1.9143457544003921]
    close = [x * (1 + 1e-9) for x in layers]
    assert mismatches(_rows(**{"router/entropy": layers}), _rows(**{"router/entropy": close}), rtol=1e-5, atol=1e-7) == []
    far = [layers[0], layers[1] * 1.01]
    assert mismatches(_rows(**{"router/entropy": layers}), _rows(**{"router/entropy": far}), rtol=1e-5, atol=1e-7)
    assert mismatches(_rows(**{"router/entropy": layers}), _rows(**{"router/entropy": layers[:1]}), rtol=1e-5,
                      atol=1e-7)  # another length
    assert mismatches(_rows(**{"x": {"a": 1.0}}), _rows(**{"x": {"a": 1.0 + 1e-12}}), rtol=1e-5, atol=1e-7) == []


def test_missing_keys_and_rows_are_mismatches():
    short = _rows()[:1]
    assert mismatches(_rows(), short, rtol=1e-5, atol=1e-7) == ["metrics: 1 rows, the reference has 2"]
    extra = _rows(**{"clip/frac": 0.0})
    assert mismatches(_rows(), extra, rtol=1e-5, atol=1e-7) == [
        "metrics row 1 (step 1): key 'clip/frac' only in the run"]


def _write(d, rows, evals=None):
    d.mkdir()
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if evals is not None:
        (d / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))


def test_main_compares_metrics_and_eval_files(tmp_path, capsys):
    _write(tmp_path / "ref", _rows(), evals=[{"step": 0, "eval/accuracy": 0.5}])
    _write(tmp_path / "same", _rows(**{"perf/step_time_s": 0.1}), evals=[{"step": 0, "eval/accuracy": 0.5}])
    _write(tmp_path / "other", _rows(), evals=[{"step": 0, "eval/accuracy": 0.75}])
    _write(tmp_path / "noeval", _rows())
    assert main([str(tmp_path / "ref"), str(tmp_path / "same")]) == 0
    assert "match: 2 metrics rows" in capsys.readouterr().out
    assert main([str(tmp_path / "ref"), str(tmp_path / "other")]) == 1
    assert "eval.jsonl row 0 (step 0): eval/accuracy = 0.75" in capsys.readouterr().out
    assert main([str(tmp_path / "ref"), str(tmp_path / "noeval")]) == 1
    assert "missing (the reference has eval.jsonl)" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path / "nothing"), str(tmp_path / "same")])
    assert e.value.code == 2 and "not a run directory" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [[], ["a"], ["a", "b", "--against", "HEAD"], ["--against", "HEAD", "a"],
                                  ["--against", "HEAD", "--steps", "0"]])
def test_main_takes_two_run_dirs_or_a_revision(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    want = "must be at least 1" if "--steps" in argv else "REF_RUN_DIR RUN_DIR or --against REV"
    assert e.value.code == 2 and want in capsys.readouterr().err
