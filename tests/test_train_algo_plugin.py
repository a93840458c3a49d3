"""A loss of one's own, from a file outside the package (`--algo file.py:Spec`, i.e. `algo.name=file.py:Spec`),
with an option of its own, trains through the real entry point: torchrun with 2 ranks, each of which loads
the file. The file is the example of docs/architecture.md, "Adding a loss"."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]

MARKS = """

# added by the test: who loads this file: each rank, and the launcher (its config check), which has no RANK
import os
from pathlib import Path
Path(os.environ["TOY_MARK_DIR"], f"rank{os.environ.get('RANK', '-launcher')}").write_text("loaded")
"""


def docs_example() -> str:
    """The loss file of docs/architecture.md, "Adding a loss" (its one python block): the page's example is
    the file this test trains."""
    page = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = page.split("## Adding a loss", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^```python\n(.*?)^```", section, flags=re.S | re.M)
    assert len(blocks) == 1, "docs/architecture.md, Adding a loss: expected one python block"
    return blocks[0]


FAST = ["parallel.expert_parallel_size=1", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4",
        "rollout.max_new_tokens=3", "logging.wandb_mode=disabled", "logging.progress=false", "train.export_hf=false",
        "train.checkpoint_every=0", "logging.trace_every=0", "logging.samples_every=0", "eval.every=0"]


def test_the_docs_loss_with_an_option_of_its_own_trains_two_steps_from_one_file(tmp_path):
    """Issue 52: a loss with an option of its own is one file (no edit to the package): the option is set on
    the command line, checked against the file's spec by every process, and reaches its terms function."""
    work = tmp_path / "work"  # the user's directory: the file is given relative to it
    work.mkdir()
    (work / "my_loss.py").write_text(docs_example() + MARKS)
    marks = tmp_path / "marks"
    marks.mkdir()
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "moe_gspo.launch", "--standalone", "--nproc-per-node", "2", "-m", "moe_gspo.train",
           "--config", str(ROOT / "configs/tiny_cpu_copy_first.yaml"), "--run-dir", str(run_dir),
           "--algo", "my_loss.py:SPEC", "algo.options.neg_weight=0.25", "train.steps=2", *FAST]
    env = {**os.environ, "TOY_MARK_DIR": str(marks), "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["my_pg/neg_weight"] == 0.25 for r in rows)  # the file's terms got the option's value
    assert all("clip/token_frac" not in r for r in rows)  # and no built-in's terms ran
    assert {"rank0", "rank1"} <= {q.name for q in marks.iterdir()}  # every rank loaded the file
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())["algo"]
    assert (saved["name"], saved["options"]) == ("my_loss.py:SPEC", {"neg_weight": 0.25})


def test_a_bad_plugin_is_one_line_naming_algo_name(tmp_path):
    (tmp_path / "toy_loss.py").write_text("TOY = 3\n")
    cmd = [sys.executable, "-m", "moe_gspo.train", "--run-dir", str(tmp_path / "run"), "algo.name=toy_loss.py:TOY"]
    p = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 2  # a user error
    assert ("error: algo.name='toy_loss.py:TOY': 'toy_loss.py' has 'TOY', a int, not an AlgoSpec; its AlgoSpecs: "
            "none") in p.stderr, p.stderr[-2000:]
