"""The train command line under torchrun: a config warning is printed by rank 0 only."""

import warnings

import pytest

from moe_gspo.run import cli


@pytest.mark.parametrize("rank,num_warnings", [("0", 1), ("1", 0)])
def test_config_warnings_once_under_torchrun(monkeypatch, rank, num_warnings):
    monkeypatch.setenv("RANK", rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, cfg = cli.parse_train_args(["--algo", "gspo", "algo.clip_low=0.2", "algo.clip_high=0.2"])
    assert cfg.algo.clip_low == 0.2  # the config still loads on every rank
    assert sum("token-level range" in str(w.message) for w in caught) == num_warnings


# ----------------------------------------------------------------------------- issue 22: one CLI convention

from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _help(capsys, fn, argv) -> str:
    with pytest.raises(SystemExit) as e:
        fn(argv)
    assert e.value.code == 0
    return capsys.readouterr().out


def test_train_help_shows_the_values_of_the_config_in_use(capsys, monkeypatch):
    """Item 5: --help printed the dataclass defaults (prompts_per_step 8, steps 60, lr 3e-3, task
    copy_first), not those of the default --config configs/tiny_cpu.yaml."""
    monkeypatch.chdir(ROOT)
    out = _help(capsys, cli.parse_train_args, ["--help"])
    assert "config fields: values of configs/tiny_cpu.yaml" in out
    for line in ("rollout.prompts_per_step = 16 (built-in default 8)", "rollout.max_new_tokens = 13 (built-in default 8)",
                 "train.steps = 400 (built-in default 60)", "train.lr = 0.0005 (built-in default 0.003)",
                 "task.name = copy (built-in default copy_first)"):
        assert line in out
    out = _help(capsys, cli.parse_train_args, ["--config", "configs/tiny_cpu_copy_first.yaml", "train.steps=7",
                                               "--algo", "grpo", "--help"])
    assert "values of configs/tiny_cpu_copy_first.yaml with train.steps=7 --algo grpo" in out
    assert "train.steps = 7 (built-in default 60)" in out and "algo.name = grpo (built-in default gspo)" in out
    assert "task.name = copy_first:" in out
    out = _help(capsys, cli.parse_train_args, ["--config", "configs/missing.yaml", "--help"])
    assert "values of the built-in defaults (the command line's config does not load: config file" in out


@pytest.mark.parametrize("argv,msg", [
    (["configs/tiny_cpu.yaml"], "'configs/tiny_cpu.yaml' is not a section.key=value override; did you mean "
                                "--config configs/tiny_cpu.yaml?"),
    (["train.steps"], "override 'train.steps' must look like section.key=value (e.g. train.lr=1e-3)"),
    (["--config"], "argument --config: expected one argument (see python -m moe_gspo.train --help)"),
])
def test_train_cli_errors_are_one_line(capsys, argv, msg):
    with pytest.raises(SystemExit) as e:
        cli.parse_train_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err == f"error: {msg}\n"


def test_plan_and_ablate_take_config_flag_and_positional(tmp_path, capsys, monkeypatch):
    from moe_gspo import ablate
    from moe_gspo.plan.__main__ import main as plan

    monkeypatch.chdir(ROOT)
    assert plan(["--config", "configs/tiny_cpu.yaml", "--json", "parallel.expert_parallel_size=2"]) == 0
    assert plan(["configs/tiny_cpu.yaml", "--json"]) == 0  # the earlier positional form still works
    capsys.readouterr()
    spec = tmp_path / "abl.yaml"
    spec.write_text(f"base_config: {ROOT / 'configs/tiny_cpu_copy_first.yaml'}\nalgos: [gspo]\nrouting_replay: [none]\n"
                    f"seeds: [0]\nout_dir: {tmp_path / 'abl'}\n")
    assert ablate.main(["--config", str(spec), "--dry-run", "train.steps=7"]) == 0
    assert "train.steps=7" in capsys.readouterr().out
    assert ablate.main([str(spec), "--dry-run"]) == 0


@pytest.mark.parametrize("entry,argv,msg", [
    ("plan", ["--config"], "error: argument --config: expected one argument (see python -m moe_gspo.plan --help)"),
    ("plan", [], "error: give the run config: python -m moe_gspo.plan --config FILE"),
    ("plan", ["--config", "configs/tiny_cpu.yaml", "configs/x.yaml"], "error: 'configs/x.yaml': give one config file"),
    ("ablate", ["--bogus"], "error: unrecognized arguments: --bogus (see python -m moe_gspo.ablate --help)"),
    ("ablate", [], "error: give the ablation spec: python -m moe_gspo.ablate --config FILE"),
    ("report", [], "error: the following arguments are required: source (see python -m analysis.report --help)"),
])
def test_argparse_errors_are_one_line_with_exit_2(capsys, monkeypatch, entry, argv, msg):
    """Item 7: `plan --config` printed argparse's usage block."""
    from analysis.report import main as report
    from moe_gspo import ablate
    from moe_gspo.plan.__main__ import main as plan

    monkeypatch.chdir(ROOT)
    assert {"plan": plan, "ablate": ablate.main, "report": report}[entry](argv) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(msg) and captured.err.count("\n") == 1 and "usage:" not in captured.err


def test_launch_errors_and_help_name_it(capsys):
    from moe_gspo import launch

    with pytest.raises(SystemExit) as e:
        launch.main(["--nnodes"])
    assert e.value.code == 2
    assert capsys.readouterr().err == ("error: argument --nnodes: expected one argument "
                                       "(see python -m moe_gspo.launch --help)\n")
    out = _help(capsys, launch.main, ["--help"])
    assert out.startswith("usage: python -m moe_gspo.launch") and "launch.py" not in out
    assert "exits with that code: 2 for a" in out


def test_ablate_help_says_what_it_does(capsys):
    from moe_gspo import ablate

    out = _help(capsys, ablate.main, ["--help"])
    assert "see the module docstring" not in out and "Implementation:" not in out
    assert "base_config: configs/tiny_cpu.yaml" in out and "Resuming a matrix" in out and "--config FILE" in out
