"""Issue 59, item 8: messages that said something else than what happened, each one line naming what it is.

- an append to metrics.jsonl that fails on a full disk said "the partial file was removed"; the file is cut
  back to its last complete row and its rows are kept, and the line says so;
- `task.path=/dev/zero`, a FIFO or a directory said "does not exist" (and a FIFO is never opened: it would
  wait for a writer);
- an answer of more than 4,300 digits (Python's int-string limit) named no file:line;
- `model.tiny` set together with `model.path` was ignored without a word;
- a KeyboardInterrupt raised by code (a plug-in) was reported as "interrupted by SIGINT".
All in process, without a run."""

from __future__ import annotations

import errno
import os
import signal
import time

import pytest

from moe_gspo.config_load import load_config
from moe_gspo.run import sinks
from moe_gspo.run.errors import run_entry
from moe_gspo.tasks import read_prompt_file


def test_a_full_disk_during_an_append_says_the_rows_were_cut_back_and_kept(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    sinks.append_jsonl_line(path, {"step": 0, "reward/mean": 0.5}, "metrics")
    before = path.read_bytes()
    real_write = os.write

    def full(fd, data):  # half the row reaches the file, then the disk is full
        if len(data) > 8:
            return real_write(fd, bytes(data[:8]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sinks.os, "write", full)
    with pytest.raises(ValueError) as e:
        sinks.append_jsonl_line(path, {"step": 1, "reward/mean": 0.25}, "metrics")
    msg = str(e.value)
    assert msg.startswith(f"disk full while writing metrics {str(path)!r}") and "\n" not in msg, msg
    assert msg.endswith("(the row was not written: metrics.jsonl was cut back to its last complete row, and every "
                        "row before it is kept)"), msg
    assert "removed" not in msg
    assert path.read_bytes() == before  # and it is true: the torn half-row is gone, step 0's row is there


@pytest.mark.parametrize("kind", ["dev_zero", "fifo", "directory", "missing"])
def test_task_path_that_is_not_a_file_says_what_it_is(tmp_path, kind):
    if kind == "dev_zero":
        target, what = "/dev/zero", "is a character device (such as /dev/zero), not a file"
    elif kind == "fifo":
        target, what = tmp_path / "pipe", "is a named pipe (FIFO), not a file"
        os.mkfifo(target)
    elif kind == "directory":
        target, what = tmp_path, "is a directory"
    else:
        target, what = tmp_path / "nope.jsonl", "does not exist"
    t0 = time.monotonic()
    with pytest.raises(ValueError) as e:
        read_prompt_file(target)
    assert time.monotonic() - t0 < 5  # a FIFO with no writer is not opened (opening it would block)
    assert str(e.value) == (f"task.path={str(target)!r} {what}; point it at a JSONL file of prompt/answer lines")


def test_an_answer_longer_than_pythons_int_limit_names_the_file_and_line(tmp_path):
    f = tmp_path / "data.jsonl"
    f.write_text('{"prompt": "a", "answer": "5"}\n\n{"prompt": "b", "answer": ' + "9" * 5000 + "}\n")
    with pytest.raises(ValueError) as e:
        read_prompt_file(f)
    msg = str(e.value)
    assert msg.startswith(f"{f}:3: a number too long to read (Exceeds the limit (4300 digits) for integer string "
                          "conversion"), msg
    assert msg.endswith('write it as a JSON string, e.g. "answer": "123..."')
    f.write_text('{"prompt": "b", "answer": "' + "9" * 5000 + '"}\n')  # as a string it is read
    assert read_prompt_file(f)[0].answer == "9" * 5000


def test_model_tiny_with_model_path_is_refused(tmp_path):
    with pytest.raises(ValueError) as e:
        load_config(None, [f"model.path={tmp_path}", "model.tiny={num_experts: 16}"])
    assert str(e.value) == (f"model.tiny={{'num_experts': 16}} is set together with model.path={str(tmp_path)!r}: "
                            "model.tiny shapes only the tiny random model (model.path: null), the checkpoint's "
                            "config.json gives its geometry; drop model.tiny (model.tiny={} on the command line) or "
                            "set model.path=null")
    assert load_config(None, ["model.tiny={num_experts: 16}"]).model.tiny == {"num_experts": 16}  # alone: fine


def test_a_keyboard_interrupt_raised_by_code_is_not_a_signal(capsys):
    def plugin_raises():
        raise KeyboardInterrupt

    assert run_entry(plugin_raises, how_to_resume=lambda: "rerun it") == 2
    err = capsys.readouterr().err
    assert "SIGINT" not in err.replace("no SIGINT or SIGTERM", "") and "interrupted by" not in err, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: KeyboardInterrupt raised at {__file__}:"), lines
    assert lines[0].endswith("without a signal (no SIGINT or SIGTERM reached this process): code of the run raised "
                             "it (a plug-in's, algo.name or task.reward?), so the run stopped; rerun it")

    def ctrl_c():  # a real SIGINT is still an interruption
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)

    assert run_entry(ctrl_c, how_to_resume=lambda: "rerun it") == 130
    assert capsys.readouterr().err == "interrupted by SIGINT; rerun it\n"
