"""benchmarks.matrix_throughput: layouts, the runner's own commands for a round, the table, the CLI's refusals
(the rounds themselves run training jobs: smoke-run them by hand, docs/results.md)."""

from pathlib import Path

import pytest

from benchmarks.matrix_throughput import (Layout, config_spec, main, parse_layout, pick_arm, round_commands,
                                          round_spec, runs_per_hour, summarize, table)
from moe_gspo.ablate import local_threads_env
from moe_gspo.run.ablation_spec import load_spec

ROOT = Path(__file__).resolve().parents[2]


def test_parse_layout_reads_arms_ranks_and_optional_threads():
    assert parse_layout("2:1") == Layout(parallel_arms=2, nproc=1, threads=None)
    assert parse_layout("1:2:1") == Layout(parallel_arms=1, nproc=2, threads=1)
    for bad in ("2", "2:0", "a:1", "1:2:3:4", "2:-1", ""):
        with pytest.raises(ValueError, match="expected P:R or P:R:T"):
            parse_layout(bad)


def test_layout_threads_follow_the_runner_unless_given():
    assert local_threads_env(1, 2, cores=2) is None  # one arm at a time: torch's default
    assert local_threads_env(2, 1, cores=2) == {"OMP_NUM_THREADS": "1"}
    assert local_threads_env(4, 1, cores=2) == {"OMP_NUM_THREADS": "1"}  # at least 1
    assert local_threads_env(2, 1, cores=16) == {"OMP_NUM_THREADS": "8"}
    assert parse_layout("2:1").env(cores=16) == {"OMP_NUM_THREADS": "8"}
    assert parse_layout("1:1").env(cores=16) is None
    assert parse_layout("1:1:3").env(cores=16) == {"OMP_NUM_THREADS": "3"}


def test_threads_per_rank_says_what_a_rank_gets_and_why():
    assert parse_layout("1:1").threads_per_rank(2, {}) == "2 (torch's default)"
    assert parse_layout("1:2").threads_per_rank(2, {}) == "1 (torchrun's, for several ranks)"
    assert parse_layout("1:2").threads_per_rank(2, {"OMP_NUM_THREADS": "3"}) == "3 (this shell's OMP_NUM_THREADS)"
    assert parse_layout("2:1").threads_per_rank(16, {"OMP_NUM_THREADS": "3"}) == "8 (the runner: cores // (P*R))"
    assert parse_layout("2:1:2").threads_per_rank(2, {}) == "2 (given)"


def test_a_round_of_a_phase_arm_is_the_runners_own_commands(tmp_path):
    spec = load_spec(ROOT / "configs/ablation_phase.yaml")
    assert pick_arm(spec, None) == "grpo-none-p0"
    with pytest.raises(ValueError, match="--arm nope: not an arm of the spec; its arms: grpo-none-p0, "):
        pick_arm(spec, "nope")
    rspec = round_spec(spec, pick_arm(spec, "grpo-none-p10"), parse_layout("3:2"), tmp_path)
    assert rspec.parallel_arms == 3 and rspec.nproc == 2 and rspec.out_dir == tmp_path
    cmds = round_commands(rspec)
    assert len(cmds) == 3  # one run per parallel arm, the spec's first seed and the next ones
    for seed, cmd in zip((1000, 1001, 1002), cmds):
        assert cmd[cmd.index("--nproc-per-node") + 1] == "2" and cmd[cmd.index("--algo") + 1] == "grpo"
        assert cmd[cmd.index("--run-dir") + 1] == str(tmp_path / f"grpo-none-p10-s{seed}")
        # the spec's seed keys, its overrides and the arm's variant, as the runner passes them
        assert f"train.seed={seed}" in cmd and f"model.init_seed={seed}" in cmd and "train.steps=300" in cmd
        assert "rollout.dtype=float32" in cmd and cmd[-1] == "rollout.router_flip_prob=0.1"
    assert runs_per_hour(2, 100.0) == pytest.approx(72.0)
    with pytest.raises(ValueError, match="positive"):
        runs_per_hour(2, 0.0)


def test_a_round_of_a_config_runs_it_with_its_own_algorithm(tmp_path):
    spec = config_spec("configs/tiny_cpu.yaml", steps=7, overrides=["algo.name=grpo", "train.lr=1e-3"])
    cmds = round_commands(round_spec(spec, pick_arm(spec, None), parse_layout("2:1"), tmp_path))
    assert len(cmds) == 2
    for seed, cmd in enumerate(cmds):
        assert cmd[cmd.index("--algo") + 1] == "grpo" and cmd[cmd.index("--nproc-per-node") + 1] == "1"
        assert f"train.seed={seed}" in cmd and "train.steps=7" in cmd and "logging.wandb_mode=disabled" in cmd
        assert cmd[-1] == "train.lr=1e-3" and "algo.name=grpo" not in cmd  # the text as given; the algorithm: --algo
    with pytest.raises(ValueError, match="nosuch"):
        config_spec("configs/tiny_cpu.yaml", steps=7, overrides=["train.nosuch=1"])


def test_the_table_gives_the_median_of_each_layout_and_the_fastest():
    layouts = [parse_layout(t) for t in ("1:1", "2:1", "1:2")]
    walls = {"1:1": [100.0, 120.0, 90.0], "2:1": [150.0, 160.0, 170.0], "1:2": [80.0, 85.0, 70.0]}
    summary = summarize(walls, layouts)
    got = {k: v["runs_per_hour"] for k, v in summary["layouts"].items()}
    assert got == pytest.approx({"1:1": 36.0, "2:1": 7200 / 160, "1:2": 3600 / 80})  # medians, 2 runs per 2:1 round
    assert summary["fastest"] == "2:1"  # 45.0 runs/hour against 45.0 for 1:2: the first of equals
    lines = table(summary, layouts, cores=2, environ={}, default="1:1")
    assert lines[0].split()[:2] == ["layout", "arms"]
    assert lines[1].startswith("1:1 (runner default)") and "36.0" in lines[1] and "100.0, 120.0, 90.0" in lines[1]
    assert "45.0 *" in lines[2] and "* " not in lines[3]
    assert lines[-2] == "fastest (*): 2:1, 45.0 runs/hour"
    assert lines[-1] == "the runner's default 1:1: 36.0 runs/hour, the fastest runs 1.25x as many"
    assert table(summary, layouts, cores=2, environ={}, default="2:1")[-1] == "the runner's default 2:1 is the fastest"


def test_main_dry_run_prints_alternating_rounds_and_runs_nothing(capsys):
    assert main(["--dry-run", "--rounds", "2", "--layout", "2:1", "--layout", "1:2", "--steps", "5"]) == 0
    out = capsys.readouterr().out
    heads = [line for line in out.splitlines() if line.startswith("round")]
    assert [h.split(",")[:2] for h in heads] == [["round 1", " layout 2:1"], ["round 1", " layout 1:2"],
                                                  ["round 2", " layout 2:1"], ["round 2", " layout 1:2"]]
    assert out.count("moe_gspo.launch") == 2 * (2 + 1)


@pytest.mark.parametrize("argv, msg", [(["--layout", "2x1"], "expected P:R"),
                                       (["--layout", "2:1", "--layout", "2:1"], "given twice"),
                                       (["--steps", "0"], "at least 1"),
                                       (["--arm", "grpo-none-p0"], "give the spec"),
                                       (["--spec", "configs/ablation_phase.yaml", "--config", "x.yaml"], "not allowed"),
                                       (["train.nosuch=1"], "nosuch")])
def test_main_refuses_bad_arguments_with_exit_2(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--dry-run", *argv])
    assert e.value.code == 2 and msg in capsys.readouterr().err
