"""moe_gspo.run.errors / rundir / activity: exit-code classification, run-dir plans (output-path checks and
the full-disk check: tests/test_files.py)."""

from __future__ import annotations

import errno
import json

import pytest

from moe_gspo.run.activity import Activity
from moe_gspo.run.errors import RankFailure, comm_failure_kind, run_entry, user_message
from moe_gspo.run.rundir import plan_run_dir


def test_user_errors_rank_failures_and_bugs_are_told_apart():
    assert user_message(ValueError("train.lr='abc' must be a number")) == (2, "train.lr='abc' must be a number")
    assert user_message(RankFailure("rank 1 stopped")) == (3, "rank 1 stopped")
    gloo = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation")
    assert comm_failure_kind(gloo) == "timeout" and user_message(gloo)[0] == 3
    lost = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:46252")
    assert comm_failure_kind(lost) == "peer_lost"
    assert user_message(KeyError("x")) is None and user_message(RuntimeError("shape mismatch")) is None
    full = OSError(errno.ENOSPC, "No space left on device")
    assert user_message(full)[0] == 2
    wrapped = RuntimeError("enforce fail at inline_container.cc:672")
    wrapped.__context__ = full
    assert user_message(wrapped)[0] == 2


def test_run_entry_prints_one_line_and_returns_the_code(capsys):
    def bad():
        raise ValueError("task.path='x' does not exist")

    assert run_entry(bad) == 2
    assert capsys.readouterr().err == "error: task.path='x' does not exist\n"
    with pytest.raises(KeyError):  # a bug keeps its traceback
        run_entry(lambda: {}["missing"])


def test_torchelastic_error_file_gets_the_line(tmp_path, monkeypatch, capsys):
    f = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(f))
    assert run_entry(lambda: (_ for _ in ()).throw(ValueError("bad"))) == 2
    assert json.loads(f.read_text())["message"]["message"] == "error: bad"


def test_a_stopped_peer_is_named_from_its_published_activity():
    act = Activity(rank=0, world_size=1, timeout_s=20)
    act("learner passes, step 3")
    with pytest.raises(RankFailure, match=r"rank 0 waited 20 s \(parallel.collective_timeout_s\) for the other ranks "
                                          r"in 'learner passes, step 3'"):
        with act.watch():
            raise RuntimeError("Timed out waiting 20000ms for recv operation to complete")
    with pytest.raises(RuntimeError, match="unrelated"):
        with act.watch():
            raise RuntimeError("unrelated")


def test_run_dir_plans(tmp_path):
    d = tmp_path / "run"
    assert plan_run_dir(d, resume=False, overwrite=False).mode == "fresh"
    d.mkdir()
    (d / "train.log").write_text("an ablation's log is not a run\n")
    assert plan_run_dir(d, resume=False, overwrite=False).mode == "fresh"
    (d / "metrics.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(ValueError, match="already holds a run \\(metrics.jsonl\\); pass --resume .* --overwrite"):
        plan_run_dir(d, resume=False, overwrite=False)
    with pytest.raises(ValueError, match="no checkpoint to continue from"):
        plan_run_dir(d, resume=True, overwrite=False)
    assert plan_run_dir(d, resume=False, overwrite=True).mode == "overwrite"
    (d / "checkpoints" / "step_000001").mkdir(parents=True)
    assert plan_run_dir(d, resume=True, overwrite=False).mode == "resume"


def test_the_torchelastic_error_file_is_written_whole_or_not_at_all(tmp_path, monkeypatch, capsys):
    """Written through `files.atomic_write_text`: a failure (a full disk) leaves no file, no temporary, and
    the line is still printed."""
    import errno

    from moe_gspo import files

    f = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(f))

    def full(self, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files.Path, "write_text", full)
    assert run_entry(lambda: (_ for _ in ()).throw(ValueError("bad"))) == 2
    assert capsys.readouterr().err == "error: bad\n" and list(tmp_path.iterdir()) == []


def test_a_full_disk_classified_away_from_its_writer_claims_nothing_about_the_file(tmp_path):
    """Issue 59: a full disk met by a writer that does not say what became of its file (the run directory's lock
    record, ...) was reported as 'the partial file was removed'; classified here, the line says only what is known."""
    exc = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "lock.json"))
    code, msg = user_message(exc)
    assert code == 2 and "disk full while writing file" in msg and "lock.json" in msg
    assert "removed" not in msg and "kept" not in msg and "\n" not in msg
