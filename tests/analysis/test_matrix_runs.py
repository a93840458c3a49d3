"""analysis.matrix_runs: the saved metrics a report page regenerates from round-trip, and a failed write leaves
the previous file and no temp file behind."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from analysis.load import RunData
from analysis.matrix_runs import load_saved_records, save_records


def _run(name: str, rows: list[dict]) -> RunData:
    return RunData(source=Path("/somewhere") / name, records=rows, traces={})


def test_saved_records_keep_only_the_keys_asked_for_and_load_back(tmp_path):
    runs = [_run("grpo-none-p0-s1", [{"step": 0, "reward/mean": 0.25, "perf/step_s": 3.0},
                                     {"step": 1, "reward/mean": 0.5}]),
            _run("gspo-none-p0-s1", [{"step": 0, "reward/mean": 1.0}])]
    out = tmp_path / "sub" / "metrics.jsonl.gz"
    save_records(runs, out, keys=["step", "reward/mean"])
    back = load_saved_records(out)
    assert [r.source.name for r in back] == ["grpo-none-p0-s1", "gspo-none-p0-s1"]
    assert back[0].records == [{"step": 0, "reward/mean": 0.25}, {"step": 1, "reward/mean": 0.5}]
    assert back[1].records == [{"step": 0, "reward/mean": 1.0}]
    assert sorted(p.name for p in out.parent.iterdir()) == ["metrics.jsonl.gz"]


def test_a_failed_write_keeps_the_previous_file_and_leaves_no_temp_file(tmp_path):
    out = tmp_path / "metrics.jsonl.gz"
    save_records([_run("a-s1", [{"step": 0, "reward/mean": 0.5}])], out, keys=["step", "reward/mean"])
    before = out.read_bytes()
    bad = [_run("a-s1", [{"step": 0, "reward/mean": 0.5}]),
           _run("b-s1", [{"step": 0, "reward/mean": object()}])]  # not JSON: fails after the first line
    with pytest.raises(TypeError):
        save_records(bad, out, keys=["step", "reward/mean"])
    assert out.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl.gz"]
    with gzip.open(out, "rt") as f:
        assert [json.loads(line)["run"] for line in f] == ["a-s1"]
