"""`moe_gspo.run.quick_exit.exit_now`: the exit code, every atexit handler (in order, once) and buffered output are
kept (its time saved, the teardown, is measured by `benchmarks.startup_bench`); a running non-daemon thread falls back to the ordinary exit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = """
import atexit, sys, threading, time
from moe_gspo.run.quick_exit import exit_now
marks = sys.argv[1]
atexit.register(lambda: open(marks, "a").write("first-registered\\n"))
atexit.register(lambda: open(marks, "a").write("second-registered\\n"))
if sys.argv[2] == "thread":
    threading.Thread(target=lambda: (time.sleep(0.3), open(marks, "a").write("thread\\n"))).start()
sys.stdout.write("buffered out, no newline")
sys.stderr.write("buffered err")
exit_now(int(sys.argv[3]))
"""


def _run(tmp_path: Path, mode: str, code: int):
    marks = tmp_path / f"marks_{mode}_{code}"
    p = subprocess.run([sys.executable, "-c", _SCRIPT, str(marks), mode, str(code)], cwd=ROOT, capture_output=True,
                       text=True, timeout=60, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    return p, marks.read_text().splitlines()


def test_exit_now_keeps_the_code_the_handlers_and_buffered_output(tmp_path):
    for code in (0, 2, 143):
        p, marks = _run(tmp_path, "plain", code)
        assert p.returncode == code, p.stderr
        assert p.stdout == "buffered out, no newline" and p.stderr == "buffered err"
        assert marks == ["second-registered", "first-registered"]  # reverse order of registration, each once


def test_a_running_thread_gets_the_ordinary_exit(tmp_path):
    p, marks = _run(tmp_path, "thread", 3)
    assert p.returncode == 3, p.stderr
    assert p.stdout == "buffered out, no newline"
    assert marks == ["thread", "second-registered", "first-registered"]  # joined before the handlers
