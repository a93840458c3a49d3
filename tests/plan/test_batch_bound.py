"""Issue 43.6: absurd batch sizes are refused with one ValueError naming the field and the fix, before
any model is built (they used to reach the allocator and end in a traceback after 31-85 s)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moe_gspo.config import Config
from moe_gspo.plan.batch_bound import batch_floor_bytes, check_batch_fits_host

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("field", ["samples_per_prompt", "prompts_per_step"])
def test_a_batch_that_cannot_fit_names_the_field(field):
    cfg = Config()
    setattr(cfg.rollout, field, 1_000_000)
    with pytest.raises(ValueError, match=rf"rollout.{field}=1000000: .* needs at least [\d.]+ GiB of host memory .* "
                                         rf"this machine has 16.0 GiB; lower rollout.{field}"):
        check_batch_fits_host(cfg, world_size=2, local_ranks=2, on_cuda=False, host_bytes=16 << 30)


def test_the_shipped_sizes_pass_and_the_floor_scales_with_the_batch():
    cfg = Config()
    check_batch_fits_host(cfg, world_size=2, local_ranks=2, on_cuda=False, host_bytes=1 << 30)
    def step_part(c):  # the batch and the KV cache scale with the step's sequences; the model does not
        need = batch_floor_bytes(c, world_size=2, local_ranks=2, on_cuda=False)
        return need["batch"] + need["kv_cache"], need["model"]

    small, model = step_part(cfg)
    cfg.rollout.samples_per_prompt *= 10
    assert step_part(cfg) == (pytest.approx(10 * small), model)
    # on a GPU the transformers engine's KV cache is not host memory
    assert batch_floor_bytes(cfg, world_size=2, local_ranks=2, on_cuda=True)["kv_cache"] == 0


@pytest.mark.slow
def test_train_refuses_it_in_seconds_with_one_line(tmp_path):
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "moe_gspo.train", "--run-dir", str(tmp_path / "run"),
                        "rollout.samples_per_prompt=1000000"], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT)))
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: rollout.samples_per_prompt=1000000"), r.stderr
    assert time.time() - t0 < 30 and not (tmp_path / "run").exists()
