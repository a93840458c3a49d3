"""Issue 49, defect 1: `--resume` loses no metrics row. A row cut off or damaged is produced again from the
newest checkpoint at or before it (resume is exact), one line says so, and the damaged lines are kept in a
sidecar file, never deleted."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from faults._tiny import rows, steady, train, warnings_of
from moe_gspo.run.resume_rows import RowScan, keep_damaged, resume_note, scan_rows


@pytest.fixture(scope="module")
def finished4(tmp_path_factory) -> Path:
    """A finished 4-step run with a checkpoint after every step, the 4 newest kept (tests copy it)."""
    run_dir = tmp_path_factory.mktemp("rows") / "run"
    assert train(run_dir, "train.steps=4", "train.keep_checkpoints=4") == 0
    return run_dir


@pytest.fixture
def run4(finished4, tmp_path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(finished4, dst)
    (dst / "done.json").unlink()
    return dst


def test_a_cut_off_last_row_is_produced_again_from_the_checkpoint_before_it(run4, finished4, capsys):
    """The issue's reproduction: the last 300 bytes of metrics.jsonl cut; the run logged steps 0, 1, 2, 4, 5."""
    metrics = run4 / "metrics.jsonl"
    size = metrics.stat().st_size
    tail = metrics.read_bytes()[size - 300:]
    os.truncate(metrics, size - 300)
    assert train(run4, "--resume", "train.steps=6", "train.keep_checkpoints=4") == 0
    out, err = capsys.readouterr()
    notes = warnings_of(err)
    assert len(notes) == 1, err
    assert ("metrics.jsonl has no intact row of step 3 (metrics.jsonl line 4 damaged (kept in "
            "metrics.jsonl.damaged)); resuming from checkpoint step_000003 instead of step_000004") in notes[0]
    assert "resuming at step 3" in out
    got = rows(run4)
    assert [r["step"] for r in got] == [0, 1, 2, 3, 4, 5]
    before = rows(finished4)
    assert [steady(r) for r in got[:4]] == [steady(r) for r in before]  # step 3 again, exactly
    torn = (run4 / "metrics.jsonl.damaged").read_bytes()  # the cut-off row, as it was left
    whole = (finished4 / "metrics.jsonl").read_bytes().splitlines()[3]
    assert torn.count(b"\n") == 1 and whole.startswith(torn[:-1]) and len(torn) - 1 == len(whole) + 1 - len(tail)


@pytest.mark.parametrize("row, source", [(1, "checkpoint step_000001"),
                                         (0, "the initial policy (no checkpoint is that old)")])
def test_a_damaged_row_resumes_from_the_checkpoint_at_or_before_it(run4, finished4, capsys, row, source):
    metrics = run4 / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    lines[row] = lines[row][:40] + "\x00garbage" + lines[row][40:]
    metrics.write_text("".join(l + "\n" for l in lines))
    assert train(run4, "--resume", "train.steps=4", "train.keep_checkpoints=4") == 0
    out, err = capsys.readouterr()
    notes = warnings_of(err)
    assert len(notes) == 1 and f"no intact row of step {row}" in notes[0], err
    assert f"resuming from {source} instead of step_000004" in notes[0]
    got = rows(run4)
    assert [r["step"] for r in got] == [0, 1, 2, 3]
    assert [steady(r) for r in got] == [steady(r) for r in rows(finished4)]  # produced again, exactly
    assert (run4 / "metrics.jsonl.damaged").read_text() == lines[row] + "\n"  # kept as it was
    assert json.loads((run4 / "done.json").read_text())["step"] == 4


# ----------------------------------------------------------------------------- the scan itself (no run)

def test_scan_finds_the_first_missing_step_and_the_damaged_lines(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_bytes(b'{"step": 0}\n{"step": 1}\n{"step": 2, "x": \n\n{"step": true}\n[1]\n{"step": 3}\n\xff\xfe\n')
    scan = scan_rows(p)
    assert scan.steps == {0, 1, 3} and scan.first_missing == 2 and scan.damaged == [3, 5, 6, 8]
    assert scan_rows(tmp_path / "absent.jsonl").first_missing == 0
    note = resume_note(scan, newest=4, resumed=2)
    assert note.startswith("--resume: metrics.jsonl has no intact row of step 2 (metrics.jsonl lines 3, 5, 6, 8 "
                           "damaged (kept in metrics.jsonl.damaged)); resuming from checkpoint step_000002")
    assert resume_note(RowScan(path=p, steps={0, 1}), newest=2, resumed=2) is None
    assert "initial policy" in resume_note(RowScan(path=p, steps={1}), newest=2, resumed=0)


def test_damaged_lines_are_appended_to_the_sidecar_never_dropped(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"st\n{"step": 1}\n')
    (tmp_path / "metrics.jsonl.damaged").write_text("older\n")
    (tmp_path / "eval.jsonl").write_text('{"step": 0}\n')
    (tmp_path / "samples.jsonl").write_text('x\n')
    written = keep_damaged(tmp_path)
    assert sorted(p.name for p in written) == ["metrics.jsonl.damaged", "samples.jsonl.damaged"]
    assert (tmp_path / "metrics.jsonl.damaged").read_text() == 'older\n{"st\n'
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 0}\n{"step": 1}\n'
    assert (tmp_path / "samples.jsonl").read_text() == ""
    assert not (tmp_path / "eval.jsonl.damaged").exists()
