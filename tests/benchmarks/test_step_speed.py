"""benchmarks.step_speed: its /proc parsing, command lines and statistics (no timed run here)."""

import os
from pathlib import Path

import pytest

from benchmarks.step_speed import RunTiming, command, main, ratio_ci, stat_counters, summary, tree_counters


def test_stat_counters_read_cpu_ticks_and_minor_faults_after_a_name_with_spaces_and_parentheses():
    # proc(5): pid (comm) state ppid pgrp session tty_nr tpgid flags minflt cminflt majflt cmajflt utime stime ...
    line = "4242 (python (rank 0) x) R 1 2 3 4 5 6 77 8 9 10 123 45 0 0 20 0 1 0 100 200 300"
    assert stat_counters(line) == (123 + 45, 77)
    ticks, faults = stat_counters(Path(f"/proc/{os.getpid()}/stat").read_text())
    assert ticks >= 0 and faults > 0


def test_tree_counters_of_this_process_grow_with_work_and_fresh_memory():
    cpu0, faults0 = tree_counters(os.getpid())
    t = sum(i * i for i in range(2_000_000))
    block = bytearray(8 << 20)  # fresh pages, touched when zeroed
    cpu1, faults1 = tree_counters(os.getpid())
    assert t > 0 and len(block) and cpu1 > cpu0 and faults1 > faults0


def test_command_main_runs_the_launcher_with_two_ranks_and_arm_one_process(tmp_path):
    main_cmd = command("main", tmp_path / "r", 20, ["train.seed=1"])
    assert main_cmd[1:6] == ["-m", "moe_gspo.launch", "--standalone", "--nproc-per-node", "2"]
    assert "configs/tiny_cpu.yaml" in main_cmd and "train.steps=20" in main_cmd and main_cmd[-1] == "train.seed=1"
    arm = command("arm", tmp_path / "r", 7, [])
    assert arm[1:3] == ["-m", "moe_gspo.train"] and "moe_gspo.launch" not in arm and "train.steps=7" in arm


def test_ratio_ci_brackets_the_ratio_of_medians_and_is_a_point_for_constant_sides():
    assert ratio_ci([2.0, 2.0, 2.0], [1.5, 1.5, 1.5]) == (0.75, 0.75, 0.75)
    ratio, lo, hi = ratio_ci([1.0, 1.1, 0.9, 1.05], [0.7, 0.8, 0.75, 0.72])
    assert ratio == pytest.approx(0.735 / 1.025)
    assert lo <= ratio <= hi and hi < 1.0 and lo < hi
    with pytest.raises(ValueError):
        ratio_ci([], [1.0])


def test_summary_lines_name_mode_measure_and_ratio():
    res = {("arm", "ref"): [RunTiming(wall_s=0.4, cpu_s=0.3, faults=100.0)] * 3,
           ("arm", "new"): [RunTiming(wall_s=0.3, cpu_s=0.3, faults=20.0)] * 3}
    lines = summary("abc123", res)
    assert len(lines) == 3
    assert lines[0].startswith("arm  wall s/step") and "ratio 0.750 (95% CI 0.750-0.750, 3 + 3 runs)" in lines[0]
    assert "ratio 1.000" in lines[1] and "CPU s/step/process" in lines[1]
    assert "faults/step/process" in lines[2] and "ratio 0.200" in lines[2]


def test_main_refuses_unknown_modes_and_bad_skip(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--against", "HEAD", "--modes", "main,gpu"])
    assert e.value.code == 2 and "unknown gpu" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--against", "HEAD", "--steps", "5", "--skip", "5"])
