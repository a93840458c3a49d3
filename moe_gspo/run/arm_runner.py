"""Running training jobs as subprocesses for `moe_gspo.ablate`: one job per arm, several at a time.

`SubprocessArmRunner` starts a command in its own process group with its output appended to a log,
and stops the whole group (torchrun and its workers) on a timeout, on an exception in the caller, or
when `stop_all()` is called (an interrupted matrix stops every running arm). `run_concurrently` maps a
function over items with at most `parallel` calls at a time and returns the results in the items'
order; on Ctrl-C / SIGTERM in the caller it calls `stop` (to end the running subprocesses), waits for
the calls to return, and re-raises.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterable, TypeVar

T = TypeVar("T")
R = TypeVar("R")


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A `preexec_fn` that has the kernel send `sig` to the child when this process dies (Linux
    `PR_SET_PDEATHSIG`; None elsewhere). The arms run in sessions of their own (so that stopping one
    stops its whole process group), so without it `kill -9` of `moe_gspo.ablate` left the running arm
    training. SIGTERM lets the arm's launcher stop its workers and say how to resume; the workers
    themselves die with the launcher (`moe_gspo.run.activity.exit_with_launcher`). Note: the signal is
    tied to the thread that started the child; the runner's thread waits for the child, so it lives
    at least as long."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here, not in the forked child
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(1, int(sig), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the request took effect
            os.kill(os.getpid(), sig)

    return preexec


class SubprocessArmRunner:
    """Runs the command in its own process group, output appended to the log; on timeout, Ctrl-C or
    `stop_all()` the whole group is terminated, then killed. `env` entries are added to the
    environment (e.g. OMP_NUM_THREADS when arms share the cores), and those `arm_env(arm)` gives for the
    arm at hand (its W&B grouping)."""

    def __init__(self, timeout_s: float | None = None, env: dict[str, str] | None = None,
                 arm_env: Callable[[Any], dict[str, str]] | None = None):
        self.timeout_s = timeout_s
        self.env = dict(env or {})
        self.arm_env = arm_env
        self._live: set[subprocess.Popen] = set()
        self._lock = threading.Lock()
        self._stopping = False

    def __call__(self, arm, command: list[str], log_path: Path) -> int:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env, **(self.arm_env(arm) if self.arm_env else {})}
        with open(log_path, "ab") as log:
            log.write(f"$ {shlex.join(command)}\n".encode())
            log.flush()
            with self._lock:
                if self._stopping:
                    raise KeyboardInterrupt("the matrix is stopping")
                proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True, preexec_fn=die_with_parent(signal.SIGTERM))
                self._live.add(proc)
            try:
                return proc.wait(timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                self._stop(proc)
                log.write(f"\n[ablate] killed after {self.timeout_s} s\n".encode())
                return 124
            except BaseException:
                self._stop(proc)
                raise
            finally:
                with self._lock:
                    self._live.discard(proc)

    @property
    def stopping(self) -> bool:
        """True once `stop_all` was called (the arms it ended did not fail on their own)."""
        return self._stopping

    def stop_all(self) -> None:
        """Stop every running command (their `__call__`s then return the signal's exit code) and start
        no new one."""
        with self._lock:
            self._stopping = True
            live = list(self._live)
        for proc in live:
            self._stop(proc)

    @staticmethod
    def _stop(proc: subprocess.Popen) -> None:
        for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(timeout=wait_s)
                return
            except subprocess.TimeoutExpired:
                continue


def run_concurrently(fn: Callable[[T], R], items: Iterable[T], parallel: int,
                     stop: Callable[[], None] | None = None) -> list[R]:
    """[fn(x) for x in items] with at most `parallel` calls running at a time (in order of start);
    `parallel == 1` runs them in this thread. On an exception here (Ctrl-C) `stop()` is called before
    the exception propagates."""
    items = list(items)
    if parallel <= 1:
        return [fn(x) for x in items]
    pool = ThreadPoolExecutor(max_workers=parallel)
    futures = [pool.submit(fn, x) for x in items]
    try:
        return [f.result() for f in futures]
    except BaseException:
        for f in futures:
            f.cancel()
        if stop is not None:
            stop()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
