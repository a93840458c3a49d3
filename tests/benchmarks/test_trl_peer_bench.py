"""The TRL peer benchmark: its time-to-target arithmetic, the skip without TRL, and a 2-step TRL run."""

import importlib.metadata
import importlib.util
import math

import pytest

from benchmarks import trl_peer_bench as bench


def test_first_crossing_needs_a_full_window():
    r = [1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    assert bench.first_crossing(r, 0.5, 2) == 1  # mean(r[0:2]) = 1.0
    assert bench.first_crossing(r, 0.9, 3) == 6  # windows: .67 .33 .33 .67 1.0
    assert bench.first_crossing(r, 0.5, 3) == 1 + 1  # mean(r[0:3]) = 0.67 at index 2
    assert bench.first_crossing(r, 1.01, 2) is None
    assert bench.first_crossing(r[:2], 0.1, 3) is None


def test_summarize_time_and_seconds_per_step():
    c = bench.Curve(name="x")
    for i, r in enumerate([0.0, 0.6, 0.8, 0.9]):
        c.add(r, 2.0 * (i + 1))
    s = bench.summarize(c, target=0.7, window=2)
    assert s["reached"] and s["step"] == 2 and s["time_s"] == 6.0 and s["s_per_step"] == 2.0
    s = bench.summarize(c, target=0.95, window=2)
    assert not s["reached"] and s["time_s"] is None and s["s_per_step"] == 2.0 and s["time_run_s"] == 8.0


def test_phase_split_leaves_out_the_steps_a_stop_landed_in():
    curve = bench.Curve(name="x")
    phases = [{"rollout": 9.0}, {"rollout": 5.0}, {"rollout": 0.2, "drift": 0.1}, {"rollout": 0.4},
              {"rollout": 7.0, "drift": 0.1}, {"rollout": 0.3}]
    for t, ph in zip([9.0, 14.0, 14.5, 15.0, 22.5, 23.0], phases):
        curve.add(0.0, t)
        curve.phases.append(ph)
    # turns of 3 steps after the first: the stops land in steps 1 and 4
    split = bench.phase_split(curve, steps_per_turn=3)
    assert list(split) == ["rollout", "drift", "rest"]
    assert split["rollout"] == pytest.approx(0.3) and split["drift"] == pytest.approx(0.1 / 3)
    assert split["rest"] == pytest.approx((0.5 + 0.5 + 0.5) / 3 - 0.3 - 0.1 / 3)
    alone = bench.phase_split(curve, steps_per_turn=None)  # ran alone: every step but the first
    assert alone["rollout"] == pytest.approx((5.0 + 0.2 + 0.4 + 7.0 + 0.3) / 5)
    assert bench.phase_split(bench.Curve(name="empty"), steps_per_turn=3) == {}


def test_median_over_seeds_counts_a_miss_as_a_lower_bound():
    def side(reached, t, step, run_t, steps_run=300):
        return {"reached": reached, "time_s": t if reached else None, "step": step, "time_run_s": run_t,
                "steps_run": steps_run, "s_per_step": 0.1}

    per_seed = [{"trl": side(True, 40.0, 199, 50.0), "ours": side(True, 30.0, 149, 31.0)},
                {"trl": side(False, None, None, 60.0), "ours": side(True, 50.0, 249, 51.0)},
                {"trl": side(True, 20.0, 99, 30.0), "ours": side(True, 25.0, 124, 26.0)}]
    out = bench.compare_seeds(per_seed)
    assert out["trl"]["median_time_s"] == 40.0 and not out["trl"]["all_reached"]  # median of 40, 60 (miss), 20
    assert out["trl"]["median_exact"]  # the miss (>= 60 s) is above the median whatever its true time
    assert out["ours"]["median_time_s"] == 30.0 and out["ours"]["all_reached"] and out["ours"]["median_exact"]
    assert out["ours"]["median_steps"] == 150 and out["trl"]["median_steps"] == 200  # 200, 300 (ran), 100
    assert out["ratio_median_time"] == pytest.approx(0.75) and out["ratio_exact"]
    per_seed[2]["trl"] = side(False, None, None, 30.0)  # two misses of three: the median is only a bound
    out = bench.compare_seeds(per_seed)
    assert out["trl"]["median_time_s"] == 40.0 and not out["trl"]["median_exact"] and not out["ratio_exact"]


def test_seeds_come_from_the_seeds_flag(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())  # as if TRL were installed
    monkeypatch.setitem(__import__("sys").modules, "trl", type("trl", (), {"__version__": "x"}))
    with pytest.raises(SystemExit):
        bench.main(["train.seed=3"])


@pytest.mark.parametrize("argv, msg", [
    (["train.steps=5"], "set the run length with --max-steps, not train.steps="),
    (["--max-steps", "0"], "--max-steps 0 must be >= 1"),
    (["--max-steps", "50", "train.lr_decay_steps=100"], "train.lr_decay_steps=100 do not fit in train.steps=50"),
    (["model.path=/some/checkpoint"], "the comparison runs on the tiny random model (model.path=null)"),
    (["train.micro_batch_size=8"], "set train.micro_batch_size=0"),
    (["--steps-per-turn", "0"], "--steps-per-turn 0 must be >= 1"),
])
def test_the_run_length_is_max_steps_and_is_checked_with_the_schedule(monkeypatch, capsys, argv, msg):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())  # as if TRL were installed
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "x")
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2 and msg in capsys.readouterr().err


def test_without_trl_it_says_so_and_exits_0(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "trl" else real(name, *a))
    assert bench.main([]) == 0
    assert "TRL is not installed" in capsys.readouterr().out


def test_trl_two_rl_steps(tmp_path):
    pytest.importorskip("trl")
    from moe_gspo.config_load import load_config

    cfg = load_config(bench.ROOT / bench.DEFAULT_CONFIG, ["rollout.prompts_per_step=2", "rollout.samples_per_prompt=4",
                                                          "train.num_minibatches=2"])
    from benchmarks.trl_worker import run_trl

    curve = run_trl(cfg, max_steps=2, target=2.0, window=1, out_dir=tmp_path)
    assert len(curve.rewards) == 2  # one reward per RL step (generation), not per optimizer step
    assert all(0.0 <= r <= 1.0 for r in curve.rewards)
    assert 0 < curve.times_s[0] < curve.times_s[1]
    # TRL's entropy (mean over the RL step's optimizer steps) and its frac_reward_zero_std, per RL step
    assert len(curve.entropy) == len(curve.frac_zero_std) == 2
    assert all(0.0 < e < 4.0 for e in curve.entropy) and all(0.0 <= z <= 1.0 for z in curve.frac_zero_std)
    # where each RL step's time went (step_profile --trl): TRL computes pi_old in a pass of its own here
    # (steps_per_generation 2 > gradient_accumulation_steps 1); nested phases are not counted twice
    from benchmarks.trl_worker import TRL_PHASES

    assert len(curve.phases) == 2 and all(set(p) == set(TRL_PHASES) for p in curve.phases)
    assert all(p["generate"] > 0 and p["old_logp"] > 0 and p["update"] > 0 and p["score"] > 0 for p in curve.phases)
    assert sum(curve.phases[1].values()) < curve.times_s[1] - curve.times_s[0]


def test_both_sides_run_in_turn_end_to_end(tmp_path, capsys):
    """The bench as a user runs it, tiny: TRL's worker and `torchrun -m moe_gspo.train` take turns (of the
    default 5 RL steps), and each side's curve has its steps with increasing charged times."""
    pytest.importorskip("trl")
    from benchmarks import interleave

    if not interleave.supported():
        pytest.skip("needs Linux /proc process trees")
    out = tmp_path / "out"
    assert bench.main(["--seeds", "0", "--max-steps", "3", "--full", "--out", str(out), "--json", str(out / "r.json"),
                       "rollout.prompts_per_step=2", "rollout.samples_per_prompt=4", "train.num_minibatches=2"]) == 0
    text = capsys.readouterr().out
    assert "5 RL steps each in turn" in text
    import json

    res = json.loads((out / "r.json").read_text())["per_seed"][0]
    for side in ("trl", "ours"):
        curve = res[f"{side}_curve"]
        assert len(curve["rewards"]) == 3 and res[side]["steps_run"] == 3
        assert 0 < curve["times_s"][0] < curve["times_s"][1] < curve["times_s"][2]  # no wall bound: a loaded box
        assert all(0.0 <= r <= 1.0 for r in curve["rewards"])
    assert len((out / "seed0" / "trl" / "rl_steps.jsonl").read_text().splitlines()) >= 3  # the worker's records
    assert res["ratio_time"] > 0
    # each side's split by phase (ours perf/<phase>_s, TRL's own phases), from RL step 2: step 0 ran alone
    # and the stop after it landed in step 1
    assert "rollout" in res["ours_split"] and "update" in res["ours_split"]
    assert "generate" in res["trl_split"] and "s/RL step by phase" in text


def test_bootstrap_ci_of_the_medians_and_their_ratio_by_hand():
    """Two seeds, ours 1 s and 3 s, TRL 2 s both: a paired resample is seeds {0,0} (ratio 1/2, p 1/4),
    {1,1} (3/2, p 1/4) or one of each (median 2 over 2: ratio 1, p 1/2), so the 95% percentile CI of the
    ratio is [0.5, 1.5]; ours' median lies in [1, 3], TRL's is 2 in every resample. One seed: no CI."""
    def side(t):
        return {"reached": True, "time_s": t, "step": 9, "time_run_s": t, "steps_run": 10, "s_per_step": 0.1}

    per_seed = [{"ours": side(1.0), "trl": side(2.0)}, {"ours": side(3.0), "trl": side(2.0)}]
    ci = bench.bootstrap_median_ci(per_seed)
    assert ci["ratio"] == [0.5, 1.5] and ci["ours"] == [1.0, 3.0] and ci["trl"] == [2.0, 2.0]
    assert ci["num_seeds"] == 2
    out = bench.compare_seeds(per_seed)
    assert out["ratio_median_time"] == 1.0 and out["ratio_median_time_ci"] == [0.5, 1.5]
    assert out["ours"]["median_time_ci_s"] == [1.0, 3.0]
    one = bench.bootstrap_median_ci(per_seed[:1])
    assert all(math.isnan(v) for v in one["ratio"] + one["ours"] + one["trl"])
