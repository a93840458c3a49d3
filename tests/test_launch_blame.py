"""Issue 43.8: the launcher names the rank that failed by itself. SIGKILL of rank 1 used to be reported
as "exit code 143 (first on rank 0)": rank 0 merely exited 143 when the agent stopped it with SIGTERM."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from _procs import worker_pids
from moe_gspo.launch import root_failure

ROOT = Path(__file__).resolve().parents[1]


def _failure(rank: int, exitcode: int, timestamp: int) -> ProcessFailure:
    f = ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file="/nonexistent")
    f.timestamp = timestamp
    return f


@pytest.mark.parametrize("stopped_code", [143, -15])
def test_a_rank_killed_by_sigkill_is_the_root_not_the_rank_the_agent_stopped(stopped_code):
    e = ChildFailedError("moe_gspo.train", {0: _failure(0, stopped_code, 100), 1: _failure(1, -9, 100)})
    rank, failure = root_failure(e)
    assert (rank, failure.exitcode) == (1, -9)


def test_an_error_code_of_its_own_still_wins_and_earliest_first():
    e = ChildFailedError("moe_gspo.train", {0: _failure(0, 143, 100), 1: _failure(1, 2, 100), 2: _failure(2, -9, 100)})
    assert root_failure(e)[0] == 1
    e = ChildFailedError("moe_gspo.train", {0: _failure(0, 3, 101), 1: _failure(1, -11, 100)})
    assert root_failure(e)[0] == 1
    e = ChildFailedError("moe_gspo.train", {0: _failure(0, 143, 100), 1: _failure(1, 143, 100)})
    assert root_failure(e)[0] == 0  # nothing but stopped ranks: the first, as before


@pytest.mark.slow
def test_sigkill_of_rank_1_is_reported_as_rank_1():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), MOE_GSPO_ROOT=str(ROOT))
    launcher = subprocess.Popen([sys.executable, "-m", "moe_gspo.launch", "--standalone", "--nproc-per-node", "2",
                                 str(ROOT / "tests/run/_sleeper_worker.py")], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        pids = {}
        while len(pids) < 2 and time.time() < deadline:
            pids = worker_pids(launcher.pid)
            time.sleep(0.2)
        assert len(pids) == 2
        time.sleep(1.0)  # both workers past their start-up
        os.kill(pids[1], signal.SIGKILL)
        _, err = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 128 + 9, err
    assert re.search(r"\[moe_gspo.launch\] rank 1 was killed by SIGKILL", err), err
