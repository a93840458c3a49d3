"""analysis.mechanism --states (issue 58, "the policy's state"): the option parses, bad values are one line naming the
flag, a state is trained by the project's trainer from the same initialisation the `init` state measures, cached
and reused (never overwritten by a run with other arguments), and a trained state measures differently from init."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from analysis import mechanism, mechanism_states
from analysis.mechanism_states import State, StateError, parse_states, state_checkpoint
from analysis.mechanism_step import StepSetting

SMALL = ("rollout.prompts_per_step=2", "rollout.samples_per_prompt=4", "train.num_minibatches=1")
"""The trainer's batch cut down for a test (the states' real batch is configs/tiny_cpu.yaml's)."""


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/analysis/conftest.py


def test_states_parse_sorted_and_bad_values_name_the_flag():
    assert [s.steps for s in parse_states("steps:300,init,steps:20,steps:20")] == [0, 20, 300]
    assert [s.name for s in parse_states("init, steps:5")] == ["init", "steps:5"]
    for bad in ("steps:0", "step:5", "steps:", "steps:-3", "trained", ",", "steps:1.5"):
        with pytest.raises(StateError, match="^--states: "):
            parse_states(bad)


def test_the_command_refuses_bad_states_in_one_line(tmp_path, capsys):
    for argv, said in ((["--states", "steps:x"], "--states: 'steps:x' is not a state"),
                       (["--states", "init", "--model", str(tmp_path)], "--states trains the tiny models"),
                       (["--states", "init", "--task", "sort"], "--task 'sort'"),
                       (["--states", "init", "--lengths", "1"], "--lengths must be >= 2 with --states")):
        with pytest.raises(SystemExit) as e:
            mechanism.main(["--out", str(tmp_path / "m"), *argv])
        err = capsys.readouterr().err
        assert e.value.code == 2 and said in err, err
        assert len([l for l in err.splitlines() if l.startswith("python -m analysis.mechanism: error")]) == 1
    assert not (tmp_path / "m").exists()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One 2-step state of the 1-MoE-layer tiny model on copy at response length 4, and its measurement beside init."""
    out = tmp_path_factory.mktemp("states")
    base = StepSetting(minibatches=2, groups=2, group_size=4, task="copy")
    rows = mechanism.run_grid(depths=[1], lengths=[4], doses=[0.0], seeds=[0], base=base, methods=("grpo",),
                              states=parse_states("init,steps:2"), out=out, state_overrides=SMALL)
    return out, rows


def _weights(path_or_model) -> dict:
    if isinstance(path_or_model, Path):
        from transformers import AutoModelForCausalLM

        path_or_model = AutoModelForCausalLM.from_pretrained(path_or_model, dtype=torch.float32)
    return {k: v.detach().clone() for k, v in path_or_model.state_dict().items()}


def test_a_trained_state_starts_from_init_and_measures_differently(trained):
    out, rows = trained
    path = out / "states" / "copy_d1_L4_seed0" / "step_000002"
    info = json.loads((path / "state.json").read_text())
    assert info["steps"] == 2 and 0 <= info["reward_last10"] <= 1 and info["entropy_last10"] > 0
    after = _weights(path)
    init = _weights(mechanism.build_model(1, None, seed=0, max_positions=16)[0])
    other = _weights(mechanism.build_model(1, None, seed=1, max_positions=16)[0])
    moved = max(float((after[k] - init[k]).abs().max()) for k in init)
    assert 0 < moved < 0.05  # two Adam steps at lr 5e-4 from the init the `init` state measures...
    assert max(float((other[k] - init[k]).abs().max()) for k in init) > 10 * moved  # ...not another init
    by = {(r["state"], r["k"]): r for r in rows}
    assert by[("init", 0)]["state_steps"] == 0 and by[("steps:2", 0)]["state_steps"] == 2
    assert by[("steps:2", 0)]["state_reward_last10"] == info["reward_last10"]
    assert by[("init", 0)]["rollout_nll_mean"] != by[("steps:2", 0)]["rollout_nll_mean"]
    assert math.isfinite(by[("steps:2", 1)]["token_logratio_var"])
    text = mechanism.page(rows, [])
    assert "### By policy state" in text and "rollout k3 at doses 0 |" in text
    assert f"| steps:2 | 0 | 1 | 4 | {info['reward_last10']:.3g} |" in text and "| init | 0 | 1 | 4 | n/a | n/a |" in text


def test_a_cached_state_is_reused_and_never_overwritten(trained, monkeypatch):
    out, _ = trained
    monkeypatch.setattr(mechanism_states, "_train", lambda *a, **k: pytest.fail("trained again"))
    path, info = state_checkpoint(out, State(2), depth=1, length=4, seed=0, extra=SMALL)
    assert path.name == "step_000002" and info["steps"] == 2
    with pytest.raises(StateError, match="other arguments; choose another --out"):
        state_checkpoint(out, State(2), depth=1, length=4, seed=0, extra=SMALL + ("algo.name=grpo",))
    with pytest.raises(StateError, match="past --states steps:1"):
        state_checkpoint(out, State(1), depth=1, length=4, seed=0, extra=SMALL)
    assert json.loads((path / "state.json").read_text()) == info
