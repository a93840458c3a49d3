"""Multi-node start-up (issue 22, item 3): two torchrun "nodes" on this machine, rendezvous over c10d,
each started in its own working directory with the same relative --run-dir, so the two ranks see two
different directories, as two nodes without a shared filesystem do."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from moe_gspo.run.rundir import RUN_OUTPUTS, SHARED_TOKEN

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--config", str(ROOT / "configs/tiny_cpu_copy_first.yaml"), "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=2", "rollout.max_new_tokens=2", "train.num_minibatches=2", "train.steps=1",
        "logging.wandb_mode=disabled", "logging.progress=false", "logging.trace_every=0", "train.export_hf=false"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_a_run_dir_the_nodes_do_not_share_stops_every_rank_with_one_line(tmp_path):
    """Was: rank 0 `rank 1 failed while writing checkpoint step_000001: FileNotFoundError` (exit 3) and
    a full traceback from rank 1 (exit 1)."""
    cmd = [sys.executable, "-m", "moe_gspo.launch", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--rdzv-id", "issue22", "--max-restarts", "0",
           "-m", "moe_gspo.train", *TINY, "--run-dir", "run"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    nodes = []
    try:
        for name in ("node_a", "node_b"):
            (tmp_path / name).mkdir()
            nodes.append(subprocess.Popen(cmd, cwd=tmp_path / name, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True, start_new_session=True))
        outs = [p.communicate(timeout=300)[0] for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    assert [p.returncode for p in nodes] == [2, 2], "\n---\n".join(o[-3000:] for o in outs)
    errors = [line for o in outs for line in o.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, errors
    assert "is not the same directory on every rank" in errors[0] and "every node mounts" in errors[0]
    assert "docs/multinode.md" in errors[0]  # points at the page that explains it
    assert not any("Traceback" in o for o in outs)
    # the node where no rank printed the error repeats it in the launcher's line
    launcher = [line for o in outs for line in o.splitlines() if line.startswith("[moe_gspo.launch]")]
    assert len(launcher) == 2 and all("failed with exit code 2" in line for line in launcher), launcher
    assert sum(line.endswith(errors[0]) for line in launcher) == 1, launcher
    for name in ("node_a", "node_b"):
        run = tmp_path / name / "run"
        assert not (run / SHARED_TOKEN).exists() and not any((run / n).exists() for n in RUN_OUTPUTS)
