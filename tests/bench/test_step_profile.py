import pytest

from moe_gspo.bench.step_profile import format_profile, profile


def _row(step_time, **phases):
    return {"perf/step_time_s": step_time, **{f"perf/{k}_s": v for k, v in phases.items()}}


def test_profile_amortises_periodic_phases_and_counts_untimed_time():
    rows = [_row(9.0, rollout=9.0),  # warm-up, skipped
            _row(1.0, rollout=0.2, update=0.5, traces=0.1),
            _row(1.0, rollout=0.2, update=0.5, checkpoint=0.3, log=0.1),  # the previous step's
            _row(0.8, rollout=0.2, update=0.5)]
    prof = profile(rows, skip=1)
    assert prof["num_steps"] == 3
    assert prof["rollout"] == pytest.approx(0.2) and prof["update"] == pytest.approx(0.5)
    assert prof["traces"] == pytest.approx(0.1 / 3) and prof["checkpoint"] == pytest.approx(0.3 / 3)
    assert prof["log"] == pytest.approx(0.1 / 3)
    assert prof["loop, untimed"] == pytest.approx(2.8 / 3 - 0.2 - 0.5 - 0.1 / 3)  # log, checkpoint: after the row
    assert prof["total"] == pytest.approx(2.8 / 3 + 0.4 / 3)
    text = format_profile("cfg", prof)
    assert "checkpoint" in text and "drift" not in text


def test_profile_needs_steps_after_the_warm_up():
    with pytest.raises(ValueError, match="raise --steps"):
        profile([_row(1.0)], skip=1)
