import time

import pytest

from moe_gspo.run.timing import PHASES, PhaseTimer


def test_phases_accumulate_and_take_clears():
    timer = PhaseTimer()
    with timer("update"):
        time.sleep(0.02)
    with timer("update"):
        time.sleep(0.01)
    timer.add("drift", 0.5)
    out = timer.take()
    assert set(out) == {"perf/update_s", "perf/drift_s"}
    assert 0.03 <= out["perf/update_s"] < 0.5 and out["perf/drift_s"] == 0.5
    assert timer.take() == {}


def test_a_phase_is_timed_when_its_body_raises():
    timer = PhaseTimer()
    with pytest.raises(RuntimeError):
        with timer("sync"):
            raise RuntimeError("boom")
    assert "perf/sync_s" in timer.take()


def test_unknown_phase_is_an_internal_error():
    with pytest.raises(AssertionError):
        with PhaseTimer()("nonsense"):
            pass
    assert "checkpoint" in PHASES
