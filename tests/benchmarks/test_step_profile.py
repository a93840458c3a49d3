import pytest

from benchmarks.step_profile import format_profile, format_trl_profile, profile, trl_profile


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
    # the measuring phases: traces 0.1 s over the 3 steps, as a share of the total (log and checkpoint in it)
    total = prof["total"]
    assert f"measuring phases (compare + eval + traces): {0.1 / 3:.4f} s/step, {100 * 0.1 / 3 / total:.1f}%" in text


def test_profile_needs_steps_after_the_warm_up():
    with pytest.raises(ValueError, match="raise --steps"):
        profile([_row(1.0)], skip=1)


def test_trl_profile_takes_step_times_from_consecutive_records():
    def rec(t_s, generate, update):
        return {"t_s": t_s, "phases": {"generate": generate, "old_logp": 0.1, "score": 0.0, "update": update}}

    records = [rec(5.0, 3.0, 1.0), rec(6.0, 0.2, 0.5), rec(7.5, 0.4, 0.8)]  # the first: warm-up
    prof = trl_profile(records, skip=1)
    assert prof["num_steps"] == 2 and prof["total"] == pytest.approx(1.25)
    assert prof["generate"] == pytest.approx(0.3) and prof["update"] == pytest.approx(0.65)
    assert prof["trainer loop, untimed"] == pytest.approx(1.25 - 0.3 - 0.1 - 0.65)
    assert trl_profile(records, skip=0)["num_steps"] == 2  # a step's time needs the record before it
    assert "trainer loop, untimed" in format_trl_profile("cfg", prof)
    with pytest.raises(ValueError, match="raise --steps"):
        trl_profile(records[:1], skip=1)
