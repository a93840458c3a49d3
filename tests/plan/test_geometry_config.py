"""`geometry_config`: the tiny model's geometry read without transformers equals the real `Qwen3MoeConfig`'s, and
the launcher's start-up checks of the default config import no transformers (docs/results.md, "Start-up, after")."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from moe_gspo.config_load import load_config
from moe_gspo.plan.from_config import geometry_config, resolve_hf_config
from moe_gspo.plan.params import Geometry

ROOT = Path(__file__).resolve().parents[2]

_OVERRIDES = [
    {},
    {"num_experts": 16, "num_experts_per_tok": 4},
    {"num_hidden_layers": 5, "mlp_only_layers": [0, 3], "decoder_sparse_step": 2},
    {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 16},
    {"intermediate_size": 64, "moe_intermediate_size": 48, "tie_word_embeddings": True, "vocab_size": 40},
    {"mlp_only_layers": [], "num_experts": 1, "num_experts_per_tok": 1},
]


@pytest.mark.parametrize("tiny", _OVERRIDES)
def test_tiny_geometry_without_transformers_equals_the_real_config(tiny):
    cfg = load_config(ROOT / "configs" / "tiny_cpu.yaml", [f"model.tiny.{k}={json.dumps(v)}" for k, v in tiny.items()])
    assert dict(cfg.model.tiny) == tiny
    light, real = geometry_config(cfg), resolve_hf_config(cfg)[0]
    assert Geometry.from_hf(light) == Geometry.from_hf(real)
    for key in vars(light):  # every field the tiny model sets, as transformers keeps it
        assert getattr(light, key) == getattr(real, key), key


def test_a_checkpoint_geometry_is_its_config(tmp_path):
    cfg = load_config(ROOT / "configs" / "tiny_cpu.yaml", ["model.path=/nonexistent/Qwen3-30B-A3B"])
    assert Geometry.from_hf(geometry_config(cfg)) == Geometry.from_hf(resolve_hf_config(cfg)[0])
    assert geometry_config(cfg).num_experts == 128


_LAUNCH_CHECKS = """
import sys
from moe_gspo.launch import build_parser, check_train_command
args = build_parser().parse_args(["--standalone", "--nproc-per-node", "2", "-m", "moe_gspo.train", "--config",
                                  "configs/tiny_cpu.yaml", "--run-dir", sys.argv[1], "rollout.samples_per_prompt=" + sys.argv[2]])
code = check_train_command(args)
print(code, "transformers" in sys.modules)
"""


def test_launcher_checks_import_no_transformers(tmp_path):
    """The default command's checks pass without transformers; an absurd batch is still refused there."""
    run = [sys.executable, "-c", _LAUNCH_CHECKS, str(tmp_path / "run")]
    ok = subprocess.run(run + ["8"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert ok.stdout.split() == ["0", "False"], ok.stdout + ok.stderr[-2000:]
    bad = subprocess.run(run + ["100000000"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert bad.stdout.split() == ["2", "False"], bad.stdout + bad.stderr[-2000:]
    assert "rollout.samples_per_prompt" in bad.stderr and "host memory" in bad.stderr
