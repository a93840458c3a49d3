"""`benchmarks.startup_bench`'s parsing and bookkeeping (no timed runs)."""

from __future__ import annotations

import pytest

from benchmarks.startup_bench import Sample, command, count_imports, order, parse_forms, summarize


def test_count_imports_counts_module_lines_of_every_process_not_headers_or_other_output():
    err = "\n".join([
        "import time: self [us] | cumulative | imported package",
        "import time:       120 |        120 |   _io",
        "import time:       300 |        420 | encodings",
        "warning: something else",
        "import time: self [us] | cumulative | imported package",  # a second process
        "import time:        50 |         50 | torch",
        "  import time: not at the start",
    ])
    assert count_imports(err) == 3
    assert count_imports("") == 0


def test_sides_alternate_between_rounds():
    assert [order(r, ["base", "new"]) for r in range(3)] == [["base", "new"], ["new", "base"], ["base", "new"]]


def test_medians_leave_failed_runs_out():
    runs = [Sample(wall_s=w, cpu_s=c, returncode=rc) for w, c, rc in [(10, 20, 0), (12, 21, 0), (1, 1, 2), (11, 30, 0)]]
    assert summarize(runs) == (11, 21)


def test_forms_and_command():
    assert parse_forms("arm1, launch2") == ["arm1", "launch2"]
    for bad in ("", "launch3", "arm1,x"):
        with pytest.raises(ValueError, match="--forms"):
            parse_forms(bad)
    cmd = command(1, "R")
    assert cmd[1:] == ["-m", "moe_gspo.launch", "--standalone", "--nproc-per-node", "1", "-m", "moe_gspo.train",
                       "--config", "configs/tiny_cpu.yaml", "--run-dir", "R", "train.steps=1"]
