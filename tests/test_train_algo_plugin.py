"""A loss of one's own, from a file outside the package (`algo.name=file.py:Spec`), trains through the real
entry point: torchrun with 2 ranks, each of which loads the file (docs/architecture.md, "Adding a loss")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

TOY_LOSS = """
    import os
    from pathlib import Path

    import torch

    from moe_gspo.algos.loss_common import LossInputs, PolicyTerms, grad_carrier
    from moe_gspo.algos.registry import AlgoSpec

    # who loads it: each rank, and the launcher (its config check), which has no RANK
    Path(os.environ["TOY_MARK_DIR"], f"rank{os.environ.get('RANK', '-launcher')}").write_text("loaded")


    def toy_terms(inp: LossInputs, *, clip_low: float, clip_high: float, **_) -> PolicyTerms:
        \"\"\"Plain policy gradient: A * grad log pi per token (value A: the ratio is not used).\"\"\"
        objective_BT = torch.where(inp.mask, inp.adv_BT * grad_carrier(inp), 0.0)
        return PolicyTerms(objective_BT=objective_BT, metrics={"toy/marker": torch.tensor(42.0, dtype=torch.float64)})


    TOY = AlgoSpec(name="toy_pg", doc="plain policy gradient (a test's toy)", terms=toy_terms, level="token",
                   clip="ratio", default_clip=(0.1, 0.1), default_agg="token-mean")
"""

FAST = ["parallel.expert_parallel_size=1", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4",
        "rollout.max_new_tokens=3", "logging.wandb_mode=disabled", "logging.progress=false", "train.export_hf=false",
        "train.checkpoint_every=0", "logging.trace_every=0", "logging.samples_every=0", "eval.every=0"]


def test_a_toy_loss_from_a_file_outside_the_package_trains_two_steps(tmp_path):
    work = tmp_path / "work"  # the user's directory: the file is given relative to it
    work.mkdir()
    (work / "toy_loss.py").write_text(textwrap.dedent(TOY_LOSS))
    marks = tmp_path / "marks"
    marks.mkdir()
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "moe_gspo.launch", "--standalone", "--nproc-per-node", "2", "-m", "moe_gspo.train",
           "--config", str(ROOT / "configs/tiny_cpu_copy_first.yaml"), "--run-dir", str(run_dir),
           "algo.name=toy_loss.py:TOY", "train.steps=2", *FAST]
    env = {**os.environ, "TOY_MARK_DIR": str(marks), "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["toy/marker"] == 42.0 for r in rows)  # the toy's terms computed the loss
    assert all("clip/token_frac" not in r for r in rows)  # and no built-in's did
    assert {"rank0", "rank1"} <= {q.name for q in marks.iterdir()}  # every rank loaded the file
    assert "name: toy_loss.py:TOY" in (run_dir / "config.yaml").read_text()


def test_a_bad_plugin_is_one_line_naming_algo_name(tmp_path):
    (tmp_path / "toy_loss.py").write_text("TOY = 3\n")
    cmd = [sys.executable, "-m", "moe_gspo.train", "--run-dir", str(tmp_path / "run"), "algo.name=toy_loss.py:TOY"]
    p = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 2  # a user error
    assert ("error: algo.name='toy_loss.py:TOY': 'toy_loss.py' has 'TOY', a int, not an AlgoSpec; its AlgoSpecs: "
            "none") in p.stderr, p.stderr[-2000:]
