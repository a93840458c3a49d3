"""Issue 43.3: `kill -9` of `moe_gspo.ablate` takes its running arm with it: the arm's launcher gets
SIGTERM from the kernel (PR_SET_PDEATHSIG), and its workers die with the launcher. A real process
tree: an ablate-like parent running `python -m moe_gspo.launch ... worker.py` through
`SubprocessArmRunner`."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _procs import alive

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_sleeper_worker.py")

PARENT = """
import sys
from pathlib import Path
from moe_gspo.run.arm_runner import SubprocessArmRunner
cmd = [sys.executable, "-m", "moe_gspo.launch", "--standalone", "--nproc-per-node", "1", sys.argv[1]]
print("code", SubprocessArmRunner()(None, cmd, Path(sys.argv[2])), flush=True)
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_sigkill_of_the_ablation_ends_its_arm(tmp_path):
    log = tmp_path / "train.log"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), MOE_GSPO_ROOT=str(ROOT))
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(WORKER), str(log)], env=env, cwd=tmp_path)
    launcher = worker = None
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            m = re.search(r"worker (\d+) launcher (\d+)", log.read_text() if log.exists() else "")
            if m:
                worker, launcher = int(m.group(1)), int(m.group(2))
                break
            assert parent.poll() is None
            time.sleep(0.1)
        assert worker is not None, log.read_text() if log.exists() else "no log"
        assert alive(launcher) and alive(worker)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.time() + 20
        while (alive(launcher) or alive(worker)) and time.time() < deadline:
            time.sleep(0.1)
        assert not alive(launcher), "the arm's launcher outlived the killed ablation"
        assert not alive(worker), "the arm's worker outlived the killed ablation"
    finally:
        for pid in (worker, launcher):
            if pid is not None and alive(pid):
                os.kill(pid, signal.SIGKILL)
        if parent.poll() is None:
            parent.kill()
