"""Issue 43.6: absurd batch sizes are refused with one ValueError naming the field and the fix, before
any model is built (they used to reach the allocator and end in a traceback after 31-85 s)."""

from __future__ import annotations

import os
import subprocess
import sys
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
                                         rf"this machine has 16.0 GiB available; lower rollout.{field}"):
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
    r = subprocess.run([sys.executable, "-m", "moe_gspo.train", "--run-dir", str(tmp_path / "run"),
                        "rollout.samples_per_prompt=1000000"], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT)))
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: rollout.samples_per_prompt=1000000"), r.stderr
    # refused before anything is built (the subprocess timeout bounds a hang; no wall-clock assertion: CI load)
    assert not (tmp_path / "run").exists()


def _tiny(**tiny):
    from moe_gspo.config_load import load_config

    tiny_map = "{" + ", ".join(f"{k}: {v}" for k, v in tiny.items()) + "}"
    return load_config("configs/tiny_cpu.yaml", [f"model.tiny={tiny_map}"])


def test_the_floor_counts_the_attention_heads_and_the_kv_layout():
    """Issue 59: `num_attention_heads: 20000, num_key_value_heads: 1` was counted at 4.58 GiB (its weights) and
    measured at 7.04 GiB RSS; 100,000 heads passed. The attention's activations now count heads x head_dim per
    token and layer (and the key/value heads' share of the QKV output)."""
    need = batch_floor_bytes(_tiny(num_attention_heads=20000, num_key_value_heads=1), world_size=1, local_ranks=1,
                             on_cuda=False)
    assert need["model"] == pytest.approx(4.58 * 2**30, rel=0.01)
    assert sum(need.values()) > 7.04 * 2**30  # at least what one such run was measured to hold
    with pytest.raises(ValueError, match=r"^model.tiny.num_attention_heads=100000: the attention's activations "
                                         r"\(heads x head_dim per token and layer\) needs at least [\d.]+ GiB .* "
                                         r"GiB attention, 1 rank\(s\)\), and this machine has 32.0 GiB available; "
                                         r"use fewer attention heads"):
        check_batch_fits_host(_tiny(num_attention_heads=100000, num_key_value_heads=1), world_size=1,
                              local_ranks=1, on_cuda=False, host_bytes=32 << 30)

    def attention(**tiny):
        return batch_floor_bytes(_tiny(**tiny), world_size=1, local_ranks=1, on_cuda=False)["attention"]

    assert attention(num_attention_heads=2000, num_key_value_heads=1) == pytest.approx(
        10 * attention(num_attention_heads=200, num_key_value_heads=1), rel=0.01)  # linear in the heads
    # all heads with their own keys and values: the QKV output is 3x the query's
    assert attention(num_attention_heads=2000, num_key_value_heads=2000) > 1.2 * attention(
        num_attention_heads=2000, num_key_value_heads=1)
    assert attention() < 0.05 * 2**30  # the shipped tiny model: a few MB
    assert batch_floor_bytes(_tiny(num_attention_heads=2000, num_key_value_heads=1), world_size=1, local_ranks=1,
                             on_cuda=True)["attention"] == 0  # on a GPU the activations are not host memory


def test_the_floor_is_compared_with_the_available_memory(monkeypatch):
    """Not the machine's total: what is free now (MemAvailable)."""
    from moe_gspo.plan import batch_bound

    avail, total = batch_bound.available_memory_bytes(), batch_bound.physical_memory_bytes()
    with open("/proc/meminfo") as f:
        expected = next(int(l.split()[1]) * 1024 for l in f if l.startswith("MemAvailable:"))
    assert 0 < avail <= total and abs(avail - expected) < 256 << 20
    cfg = _tiny(num_attention_heads=200, num_key_value_heads=1)  # a floor of ~0.3 GiB
    check_batch_fits_host(cfg, world_size=1, local_ranks=1, on_cuda=False)
    monkeypatch.setattr(batch_bound, "available_memory_bytes", lambda: 64 << 20)
    with pytest.raises(ValueError, match=r"this machine has 0.1 GiB available; use fewer attention heads"):
        check_batch_fits_host(cfg, world_size=1, local_ranks=1, on_cuda=False)
