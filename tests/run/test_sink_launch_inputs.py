"""`skip_unstaged_launch_inputs`: W&B's `init` imports `wandb.sdk.launch` only when Launch inputs can have been
staged in this process (their module imported); staged inputs are still applied (docs/results.md, "Start-up, after")."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = """
import sys
import wandb
from moe_gspo.run.wandb_shims import skip_unstaged_launch_inputs
applied = []
if sys.argv[2] == "staged":
    from wandb.sdk.launch.inputs.internal import StagedLaunchInputs
    StagedLaunchInputs.apply = lambda self, run: applied.append(run.id)
skip_unstaged_launch_inputs()
skip_unstaged_launch_inputs()  # idempotent
run = wandb.init(project="p", dir=sys.argv[1], mode="offline", id="r1")
run.finish()
print("launch" if "wandb.sdk.launch" in sys.modules else "no-launch", applied)
"""


def _run(tmp_path: Path, mode: str) -> str:
    p = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path), mode], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "WANDB_SILENT": "true",
                                         "HOME": str(tmp_path)})
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout.strip().splitlines()[-1]


def test_init_skips_the_launch_import_when_nothing_can_be_staged(tmp_path):
    assert _run(tmp_path, "none") == "no-launch []"


def test_staged_inputs_are_still_applied(tmp_path):
    assert _run(tmp_path, "staged") == "launch ['r1']"
