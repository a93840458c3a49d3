"""benchmarks.side_by_side: the per-phase means it prints (the runs themselves are the main job's tests)."""

from __future__ import annotations

import pytest

from benchmarks.side_by_side import phase_means


def test_phase_means_skip_the_warm_up_and_count_a_missing_phase_as_zero():
    rows = [{"perf/step_time_s": 9.0, "perf/eval_s": 9.0},  # warm-up, left out
            {"perf/step_time_s": 0.2, "perf/eval_s": 0.3, "loss/total": 1.0},
            {"perf/step_time_s": 0.4}]
    got = phase_means(rows, skip=1)
    assert got == pytest.approx({"perf/eval_s": 0.15, "perf/step_time_s": 0.3})
    assert "loss/total" not in got
