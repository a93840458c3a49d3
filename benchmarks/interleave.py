"""Two training jobs run in alternation, a few RL steps at a time, each charged only the wall time it ran.

Timings on a shared machine drift by tens of percent within minutes (`benchmarks.fastpath_bench`,
docs/results.md), more than the per-step difference a peer comparison looks for, and two jobs run back to back
meet different machine states. `alternate` removes that drift from the comparison: each job is a
process tree (its launcher and workers) that is stopped (`SIGSTOP`) except during its turn; a turn
lasts `steps_per_turn` RL steps, and the wall time from continuing the job (`SIGCONT`) until it reports
each step is charged to the job. Every step of either job thus runs under the machine state of its
neighbours' steps, and neither job competes with the other for the cores.

A job reports a finished RL step by appending one JSON object per line to a file (`JsonLinesTail`
reads what was appended since its last read); both jobs are read by the same polling loop, so the
delay between a step's end and its detection (`poll_s`, about 1 ms) is the same for both. The first
step of each job (start-up, warm-up) runs alone before the alternation and is charged as the job itself
timed it (`first_step_s` of the caller's record parser).

Linux only: the process tree is read from `/proc/<pid>/task/<tid>/children`; `supported()` says
whether this machine has it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable


def supported() -> bool:
    """Whether this machine exposes process trees as `/proc/<pid>/task/<tid>/children` (Linux)."""
    return Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").exists()


def process_tree(pid: int) -> list[int]:
    """`pid` and all its descendants (those alive now), parents before children."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop(0)
        out.append(p)
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except FileNotFoundError:
            continue
        for t in tasks:
            try:
                todo += [int(c) for c in Path(f"/proc/{p}/task/{t}/children").read_text().split()]
            except FileNotFoundError:
                pass
    return out


@contextlib.contextmanager
def terminate_as_exit():
    """Within it, SIGTERM (a `kill`, a job scheduler's stop) raises SystemExit(143) in the main thread instead of ending
    the interpreter at once, so that the `finally` blocks that kill the sides and remove temporary worktrees run (a
    SIGTERM'd race used to leave its stopped sides behind). The previous handler is restored on exit."""
    def _raise(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def signal_tree(pid: int, sig: int) -> None:
    """Send `sig` to `pid` and every descendant (a launcher such as torchrun starts its workers in
    sessions of their own, so a process-group signal would miss them)."""
    for p in process_tree(pid):
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


class JsonLinesTail:
    """The JSON objects appended to a file since the last call (complete lines only)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._offset = 0
        self._partial = b""

    def read(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        return [json.loads(line) for line in lines if line.strip()]


@dataclass(kw_only=True)
class Job:
    """A training job in a subprocess that appends one JSON record per finished RL step to `records`."""

    name: str
    proc: subprocess.Popen
    records: JsonLinesTail
    first_step_s: Callable[[dict], float]
    """Wall time of the job's first RL step, from its first record (the job's own timing)."""
    on_step: Callable[[dict, float], bool]
    """Called with each record and the job's charged seconds so far (its first step included); return
    False to end the job (target reached, enough steps)."""
    charged_s: float = 0.0
    steps: int = 0
    launched_at: float = field(default_factory=time.perf_counter)
    setup_s: float = 0.0
    """Wall time the job ran (not stopped) from launch to the start of its first RL step."""
    pending: list = field(default_factory=list, init=False, repr=False)
    """Records read but not handed out yet."""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        signal_tree(self.proc.pid, signal.SIGSTOP)

    def cont(self) -> None:
        signal_tree(self.proc.pid, signal.SIGCONT)

    def kill(self, timeout_s: float = 30.0) -> None:
        """End the job's whole process tree: continue it (a stopped process does not act on SIGTERM),
        terminate it, and wait until every process of it is gone (SIGKILL after `timeout_s`), so that
        nothing of it competes with what runs next."""
        tree = process_tree(self.proc.pid) if self.alive() else []
        for sig in (signal.SIGCONT, signal.SIGTERM):
            for p in tree:
                try:
                    os.kill(p, sig)
                except ProcessLookupError:
                    pass
        deadline = time.perf_counter() + timeout_s
        while True:
            self.proc.poll()
            left = [p for p in tree if _running(p)]
            if not left:
                return
            if time.perf_counter() > deadline:
                for p in left:
                    try:
                        os.kill(p, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                deadline = float("inf")
            time.sleep(0.01)


def _running(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (exited, not yet reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def _next_record(job: Job, poll_s: float, timeout_s: float) -> dict | None:
    """Block until `job` appends a record (None when it exits first or `timeout_s` passes)."""
    deadline = time.perf_counter() + timeout_s
    while not job.pending:
        job.pending += job.records.read()
        if job.pending:
            break
        if not job.alive():
            job.pending += job.records.read()  # a last record written just before exiting
            break
        if time.perf_counter() > deadline:
            break
        time.sleep(poll_s)
    return job.pending.pop(0) if job.pending else None


def alternate(jobs: list[Job], *, steps_per_turn: int = 1, poll_s: float = 0.001,
              step_timeout_s: float = 600.0) -> None:
    """Run `jobs` (already launched) to their ends: each one alone through its first RL step, stopped
    after it, then `steps_per_turn` RL steps each in turn (a single job just runs). Longer turns spread
    the cost of a switch (the incoming job finds the caches cold) over more steps; they still follow drift
    that takes minutes. Every job is ended (killed) on return; a job that exits without a record, or takes
    more than `step_timeout_s` for one step, leaves the rotation (the caller reads its exit code)."""
    if steps_per_turn < 1:
        raise ValueError(f"steps_per_turn={steps_per_turn} must be >= 1")
    try:
        active, t_enter = [], time.perf_counter()
        for job in jobs:
            for other in jobs:
                if other is not job and other.alive():
                    other.stop()
            job.cont()
            t_cont = time.perf_counter()
            record = _next_record(job, poll_s, step_timeout_s)
            if record is None:
                continue
            first = job.first_step_s(record)
            # the time it ran before its first record: since launch until the rotation began (with the
            # others, starting up too), then its own turn
            ran = max(0.0, t_enter - job.launched_at) + time.perf_counter() - t_cont
            job.setup_s = max(0.0, ran - first)
            job.charged_s, job.steps = first, 1
            if job.on_step(record, job.charged_s):
                active.append(job)
            job.stop()
        while active:
            for job in list(active):
                alone = len(active) == 1  # nobody to take turns with: no stop and continue around its steps
                job.cont()
                t_last = time.perf_counter()
                for _ in range(steps_per_turn):
                    record = _next_record(job, poll_s, step_timeout_s)
                    if record is None:
                        active.remove(job)
                        break
                    now = time.perf_counter()
                    job.charged_s += now - t_last
                    t_last = now
                    job.steps += 1
                    if not job.on_step(record, job.charged_s):
                        active.remove(job)
                        job.kill()
                        break
                if not alone and job.alive():
                    job.stop()
    finally:
        for job in jobs:
            job.kill()
