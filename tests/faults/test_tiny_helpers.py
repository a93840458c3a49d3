"""The fault tests' row comparison: numbers to a float tolerance (two processes), everything else exactly."""

from faults._tiny import row_differences


def test_row_differences_tolerates_rounding_and_names_every_real_change():
    want = [{"step": 0, "loss/total": 0.5, "routing/layer_disagree": [0.0, 0.25], "mismatch/flip": None,
             "perf/step_s": 1.0}]
    rounding = [{"step": 0, "loss/total": 0.5 + 1e-9, "routing/layer_disagree": [1e-8, 0.25],
                 "mismatch/flip": None, "perf/step_s": 9.0}]  # timings are not compared
    assert row_differences(rounding, want) == []
    changed = [{"step": 0, "loss/total": 0.501, "routing/layer_disagree": [0.0], "mismatch/flip": 0.0,
                "perf/step_s": 1.0, "extra": 1}]
    diffs = row_differences(changed, want)
    assert any("loss/total" in d for d in diffs)
    assert any("layer_disagree: length 1 != 2" in d for d in diffs)
    assert any("mismatch/flip" in d for d in diffs)
    assert any("keys: ['extra']" in d for d in diffs)
    assert row_differences(want + want, want) == ["2 rows != 1"]
