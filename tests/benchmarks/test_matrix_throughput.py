import pytest

from benchmarks.matrix_throughput import Layout, main, parse_layout, round_commands, runs_per_hour
from moe_gspo.ablate import local_threads_env


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


def test_round_commands_run_one_seed_per_parallel_arm(tmp_path):
    cmds = round_commands(parse_layout("3:2"), "configs/tiny_cpu.yaml", steps=300, out_dir=tmp_path,
                          overrides=["train.lr=1e-3"])
    assert len(cmds) == 3
    for seed, cmd in enumerate(cmds):
        assert cmd[cmd.index("--nproc-per-node") + 1] == "2"
        assert f"train.seed={seed}" in cmd and "train.steps=300" in cmd and cmd[-1] == "train.lr=1e-3"
        assert cmd[cmd.index("--run-dir") + 1] == str(tmp_path / f"s{seed}")
    assert runs_per_hour(2, 100.0) == pytest.approx(72.0)
    with pytest.raises(ValueError, match="positive"):
        runs_per_hour(2, 0.0)


def test_main_dry_run_prints_alternating_rounds_and_runs_nothing(capsys):
    assert main(["--dry-run", "--rounds", "2", "--layout", "2:1", "--layout", "1:2", "--steps", "5"]) == 0
    out = capsys.readouterr().out
    heads = [line for line in out.splitlines() if line.startswith("round")]
    assert [h.split(",")[:2] for h in heads] == [["round 1", " layout 2:1"], ["round 1", " layout 1:2"],
                                                  ["round 2", " layout 2:1"], ["round 2", " layout 1:2"]]
    assert out.count("moe_gspo.launch") == 2 * (2 + 1)


@pytest.mark.parametrize("argv, msg", [(["--layout", "2x1"], "expected P:R"),
                                       (["--layout", "2:1", "--layout", "2:1"], "given twice"),
                                       (["--steps", "0"], "at least 1")])
def test_main_refuses_bad_arguments_with_exit_2(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--dry-run", *argv])
    assert e.value.code == 2 and msg in capsys.readouterr().err
