"""Issue 59, item 8: `--resume` with a changed dial rewrote `config.yaml`, so the run directory lost its first dose
and `analysis.phase` read the run as the new one. Now a changed key that defines the experiment (the dial, the
seed, the loss's options) is refused with one line unless `--allow-config-change`; `config.yaml` stays the run's
first config and a resume under another one writes `config.resume-N.yaml` (moe_gspo/run/start.py). The refusal
comes before any model is built (these tests build none); the allowed resume runs in
tests/faults/test_loss_plugins.py (…_resume_uses_the_checkpoint). Also the skipped-step share's warning."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import yaml

from faults._tiny import TINY, errors, train, warnings_of
from moe_gspo.config_load import load_config
from moe_gspo.run.cli import build_parser, config_from_args, parse_mixed
from moe_gspo.run.start import EXPERIMENT_KEYS, SKIPPED_WARN_FRAC, _write_config, check_trained


def _config(*overrides: str):
    return config_from_args(parse_mixed(build_parser("t", "t"), [*TINY, *overrides]))


def _finished_looking_run(run_dir, *overrides: str) -> list[str]:
    """A run directory as a run leaves it for `--resume` (config.yaml, a checkpoint directory); its listing."""
    (run_dir / "checkpoints" / "step_000001").mkdir(parents=True)
    (run_dir / "config.yaml").write_text(_config(*overrides).to_yaml())
    return sorted(p.name for p in run_dir.rglob("*"))


@pytest.mark.parametrize("change, shown", [
    ("rollout.router_flip_prob=0.1", "rollout.router_flip_prob=0.0 -> 0.1"),
    ("rollout.router_noise_std=0.5", "rollout.router_noise_std=0.0 -> 0.5"),
    ("train.seed=7", "train.seed=0 -> 7"),
])
def test_resume_with_a_changed_experiment_key_is_refused_before_any_compute(tmp_path, capsys, change, shown):
    run_dir = tmp_path / "run"
    before = _finished_looking_run(run_dir)
    first = (run_dir / "config.yaml").read_text()
    assert train(run_dir, "--resume", change) == 2
    assert errors(capsys.readouterr().err) == [
        f"error: --resume: this command changes what defines the run's experiment ({shown}; the run ran under "
        "config.yaml); resume with the old value, start a new --run-dir, or pass --allow-config-change to continue "
        "this run under the new one (the run keeps both configs: config.yaml and config.resume-N.yaml)"]
    assert sorted(p.name for p in run_dir.rglob("*")) == before and (run_dir / "config.yaml").read_text() == first


def test_the_newest_config_the_run_ran_under_is_the_one_compared(tmp_path, capsys):
    """After an allowed change (config.resume-1.yaml) the same command resumes; the first dose is refused."""
    run_dir = tmp_path / "run"
    _finished_looking_run(run_dir)
    (run_dir / "config.resume-1.yaml").write_text(_config("rollout.router_flip_prob=0.1").to_yaml())
    assert train(run_dir, "--resume", "rollout.router_flip_prob=0.0") == 2
    assert "(rollout.router_flip_prob=0.1 -> 0.0; the run ran under config.resume-1.yaml)" in capsys.readouterr().err
    from moe_gspo.run.start import check_resume_config

    check_resume_config(run_dir, _config("rollout.router_flip_prob=0.1"), allow_config_change=False)  # no raise


def test_a_changed_algorithm_is_refused_even_with_the_flag(tmp_path, capsys):
    run_dir = tmp_path / "run"
    _finished_looking_run(run_dir)
    assert train(run_dir, "--resume", "--allow-config-change", "--algo", "grpo") == 2
    assert errors(capsys.readouterr().err) == [
        "error: --resume: this run was trained with algo.name=gspo (config.yaml), this command has algo.name=grpo; "
        "resume with --algo gspo, or start a new --run-dir"]


def test_every_config_the_run_ran_under_is_kept(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    _write_config(run_dir, _config(), resumed_at=None, segment=1)
    first = (run_dir / "config.yaml").read_text()
    _write_config(run_dir, _config(), resumed_at=3, segment=2)  # the same config: nothing new
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.yaml"]
    _write_config(run_dir, _config("train.seed=5"), resumed_at=4, segment=3)
    _write_config(run_dir, _config("train.seed=5"), resumed_at=6, segment=4)  # the same as the last: nothing
    _write_config(run_dir, _config("train.seed=6", "train.lr=0.01"), resumed_at=8, segment=5)
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.resume-1.yaml", "config.resume-2.yaml", "config.yaml"]
    assert (run_dir / "config.yaml").read_text() == first
    one, two = ((run_dir / f"config.resume-{n}.yaml").read_text() for n in (1, 2))
    assert one.splitlines()[0] == ("# segment 3, resumed at step 4 under this config; it differs from config.yaml in: "
                                   "train.seed")
    assert two.splitlines()[0] == ("# segment 5, resumed at step 8 under this config; it differs from "
                                   "config.resume-1.yaml in: train.seed, train.lr")
    assert yaml.safe_load(two)["train"]["seed"] == 6 and load_config(str(run_dir / "config.resume-2.yaml"), [])


def test_the_experiment_keys_are_config_keys():
    flat = {f"{s}.{k}" for s, fields in _config().to_dict().items() if isinstance(fields, dict) for k in fields}
    assert set(EXPERIMENT_KEYS) <= flat


def _learner(skipped: int, applied: int):
    return SimpleNamespace(skipped_steps=skipped, num_updates=applied)


def test_a_skipped_share_above_the_threshold_is_one_warning(capsys):
    cfg = _config()
    check_trained(_learner(1, 9), cfg, is_main=True)  # 10%: not above
    assert capsys.readouterr().err == ""
    assert SKIPPED_WARN_FRAC == 0.1  # docs/runs.md states it
    check_trained(_learner(3, 17), cfg, is_main=True)
    assert warnings_of(capsys.readouterr().err) == [
        "warning: 3 of 20 optimizer steps of this run (15%) were skipped by the NaN/Inf guard (train/skipped_steps), "
        "more than 10%: the loss algo.name=gspo was often not finite, and the run made that many fewer updates"]
    with pytest.raises(ValueError, match=r"^nothing was trained: all 4 optimizer steps of this run were skipped"):
        check_trained(_learner(4, 0), cfg, is_main=True)
    check_trained(_learner(0, 0), cfg, is_main=True)  # no optimizer step at all (a resume at the end): nothing said
    assert capsys.readouterr().err == ""
