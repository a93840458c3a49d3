"""benchmarks.interleave: process trees across sessions, the JSON-lines tail, and two jobs taking turns
one step each (never at the same time), each charged about the time its own steps took."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import interleave
from benchmarks.interleave import Job, JsonLinesTail, alternate

pytestmark = pytest.mark.skipif(not interleave.supported(), reason="needs Linux /proc process trees")

# A fake training job: STEPS steps of BUSY_S seconds of its own CPU time each (time.process_time does not
# advance while the process is stopped), writing a heartbeat {"hb": t} every ~2 ms of work to HB and, after
# each step, {"i": step} to OUT. Timestamps are time.perf_counter(): CLOCK_MONOTONIC, shared by the processes
# of one machine. It works in a grandchild in a session of its own, as torchrun starts its workers.
JOB = """
import json, subprocess, sys, time
steps, busy, path, hb_path, nest = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5] == "1"
if nest:
    sys.exit(subprocess.call([sys.executable, __file__, *sys.argv[1:5], "0"], start_new_session=True))
with open(hb_path, "a") as hb:
    for i in range(steps):
        c0 = last = time.process_time()
        while time.process_time() - c0 < busy:
            if time.process_time() - last > 0.002:
                last = time.process_time()
                hb.write(json.dumps({"hb": time.perf_counter()}) + "\\n")
        hb.flush()
        with open(path, "a") as f:
            f.write(json.dumps({"i": i, "cpu_s": busy}) + "\\n")
"""


def _launch(tmp_path: Path, name: str, steps: int, busy_s: float, *, stop_after: int | None = None,
            seen: list | None = None, turns: list | None = None) -> Job:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    out, hb = tmp_path / f"{name}.jsonl", tmp_path / f"{name}.hb"
    proc = subprocess.Popen([sys.executable, str(script), str(steps), str(busy_s), str(out), str(hb), "1"],
                            start_new_session=True)

    def on_step(record, charged_s):
        if seen is not None:
            seen.append((name, record, charged_s))
        return stop_after is None or record["i"] + 1 < stop_after

    job = Job(name=name, proc=proc, records=JsonLinesTail(out), first_step_s=lambda r: r["cpu_s"], on_step=on_step)
    if turns is not None:  # log when the job is let run and when it is stopped
        cont, stop = job.cont, job.stop
        job.cont = lambda: (turns.append((name, "cont", time.perf_counter())), cont())
        job.stop = lambda: (stop(), turns.append((name, "stop", time.perf_counter())))
    return job


def _heartbeats(tmp_path: Path, name: str) -> list[float]:
    return [r["hb"] for r in JsonLinesTail(tmp_path / f"{name}.hb").read()]


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0]


def test_process_tree_reaches_a_grandchild_in_another_session(tmp_path):
    job = _launch(tmp_path, "a", steps=400, busy_s=0.05)
    try:
        deadline = time.time() + 120  # a loaded box starts the grandchild's interpreter slowly
        while len(interleave.process_tree(job.proc.pid)) < 2 and time.time() < deadline:
            time.sleep(0.01)
        tree = interleave.process_tree(job.proc.pid)
        assert tree[0] == job.proc.pid and len(tree) == 2

        def states_within(want, seconds=30.0):  # signals land when the scheduler runs the target: poll, no fixed sleep
            end = time.time() + seconds
            while not want([_state(p) for p in tree]) and time.time() < end:
                time.sleep(0.01)
            return [_state(p) for p in tree]

        job.stop()
        assert states_within(lambda st: st == ["T", "T"]) == ["T", "T"]  # both stopped, the grandchild in its own session too
        job.cont()
        assert all(st != "T" for st in states_within(lambda st: all(x != "T" for x in st)))
        job.stop()  # kill() ends a stopped tree too
    finally:
        job.kill()
    assert job.proc.poll() is not None
    assert not any(interleave._running(p) for p in tree)  # the grandchild is gone as well, not left running


def test_json_lines_tail_returns_complete_lines_once(tmp_path):
    path = tmp_path / "r.jsonl"
    tail = JsonLinesTail(path)
    assert tail.read() == []  # no file yet
    path.write_text('{"a": 1}\n{"b": ')
    assert tail.read() == [{"a": 1}]
    with open(path, "a") as f:
        f.write('2}\n\n{"c": NaN}\n')
    got = tail.read()
    assert got[0] == {"b": 2} and list(got[1]) == ["c"] and got[1]["c"] != got[1]["c"]
    assert tail.read() == []


def test_two_jobs_take_turns_and_are_charged_their_own_time(tmp_path):
    seen, turns = [], []
    a = _launch(tmp_path, "a", steps=6, busy_s=0.04, seen=seen, turns=turns)
    b = _launch(tmp_path, "b", steps=6, busy_s=0.08, seen=seen, turns=turns)
    t0 = time.perf_counter()
    alternate([a, b])
    wall_s = time.perf_counter() - t0
    assert a.proc.poll() is not None and b.proc.poll() is not None
    assert a.steps == b.steps == 6
    # turns: a's first step alone, b's first step alone, then a, b, a, b, ...
    assert [name for name, _, _ in seen] == ["a", "b"] + ["a", "b"] * 5
    # while one job has its turn (from its "cont" to its "stop"), the other does no work: none of its
    # heartbeats falls inside that turn (margin: a few ms for the signals to land)
    for name, other in (("a", "b"), ("b", "a")):
        windows, start = [], None
        for who, what, t in turns:
            if who == name and what == "cont":
                start = t
            elif who == name and what == "stop" and start is not None:
                windows.append((start + 0.005, t - 0.005))
                start = None
        beats = _heartbeats(tmp_path, other)
        assert len(windows) >= 5 and len(beats) > 50
        assert not [t for t in beats for lo, hi in windows if lo < t < hi]
    # each job is charged at least the CPU time of its steps, and together no more than the whole run took
    # (the turns do not overlap, and neither job is charged the other's), whatever else loads the machine
    assert 6 * 0.04 * 0.9 <= a.charged_s and 6 * 0.08 * 0.9 <= b.charged_s
    assert a.charged_s + b.charged_s <= wall_s
    charged_b = [c for name, _, c in seen if name == "b"]
    assert charged_b == sorted(charged_b)  # cumulative


def test_a_job_leaves_the_rotation_when_done_or_when_it_exits(tmp_path):
    seen = []
    a = _launch(tmp_path, "a", steps=50, busy_s=0.01, stop_after=3, seen=seen)  # the caller stops it after 3
    b = _launch(tmp_path, "b", steps=2, busy_s=0.01, seen=seen)  # exits by itself after 2 (its records all read)
    alternate([a, b])
    assert a.steps == 3 and b.steps == 2
    assert [name for name, _, _ in seen] == ["a", "b", "a", "b", "a"]
    assert a.proc.poll() is not None  # killed once done


def test_a_single_job_just_runs(tmp_path):
    a = _launch(tmp_path, "a", steps=3, busy_s=0.01)
    alternate([a])
    assert a.steps == 3 and a.proc.poll() == 0


def test_turns_of_several_steps(tmp_path):
    seen = []
    a = _launch(tmp_path, "a", steps=7, busy_s=0.01, seen=seen)
    b = _launch(tmp_path, "b", steps=5, busy_s=0.01, seen=seen)
    alternate([a, b], steps_per_turn=3)
    # first steps alone, then three each in turn; b ends after its 5th, a runs its last step alone
    assert "".join(name for name, _, _ in seen) == "ab" + "aaa" + "bbb" + "aaa" + "b"
    with pytest.raises(ValueError, match="steps_per_turn=0"):
        alternate([], steps_per_turn=0)


_SCRIPT = """
import subprocess, sys, time
from benchmarks.interleave import terminate_as_exit
guard = sys.argv[1] == "guard"
ctx = terminate_as_exit() if guard else open("/dev/null")
with ctx:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:  # the pid is printed inside `try`: the test's SIGTERM may arrive right after it
        print(child.pid, flush=True)
        time.sleep(120)
    finally:
        child.kill()
        child.wait()
"""


@pytest.mark.parametrize("guard", [True, False])
def test_a_terminated_race_ends_its_sides_only_under_terminate_as_exit(tmp_path, guard):
    """A SIGTERM'd race (trl_peer_bench runs under terminate_as_exit) runs its `finally` blocks, which end the
    sides; without the guard SIGTERM ends the interpreter at once and the side is left running (the defect)."""
    import os
    import signal

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-c", _SCRIPT, "guard" if guard else "plain"], stdout=subprocess.PIPE,
                            text=True, cwd=root, env=dict(os.environ, PYTHONPATH=str(root)))
    child = int(proc.stdout.readline())
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=60)
    time.sleep(0.2)
    child_alive = Path(f"/proc/{child}").exists() and "Z" not in Path(f"/proc/{child}/stat").read_text().split()[2]
    if not guard:
        os.kill(child, signal.SIGKILL)
    assert code == (143 if guard else -signal.SIGTERM)
    assert child_alive is (not guard)
