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


def test_under_a_tool_that_runs_the_module_the_exit_is_ordinary(tmp_path):
    """`python -m entry` ends with os._exit; `python -m cProfile -o F -m entry` writes its profile after the
    module's SystemExit, so no os._exit there."""
    (tmp_path / "entry_mod.py").write_text(
        "import os, sys\n"
        "from moe_gspo.run.quick_exit import exit_now\n"
        "real = os._exit\n"
        "os._exit = lambda code: (open(sys.argv[1], 'a').write('os._exit\\n'), real(code))\n"
        "print('ran')\n"
        "exit_now(3)\n")
    env = {"PYTHONPATH": f"{ROOT}:{tmp_path}", "PATH": "/usr/bin:/bin"}
    marks, prof = tmp_path / "marks", tmp_path / "out.prof"
    direct = subprocess.run([sys.executable, "-m", "entry_mod", str(marks)], cwd=ROOT, capture_output=True, text=True,
                            timeout=60, env=env)
    assert direct.returncode == 3 and direct.stdout == "ran\n", direct.stderr
    assert marks.read_text() == "os._exit\n"
    marks.unlink()
    p = subprocess.run([sys.executable, "-m", "cProfile", "-o", str(prof), "-m", "entry_mod", str(marks)], cwd=ROOT,
                       capture_output=True, text=True, timeout=60, env=env)
    assert "ran" in p.stdout and prof.is_file() and not marks.exists(), p.stderr
