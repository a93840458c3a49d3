"""Issue 43.11: shipped configs by name from any directory: `--config NAME`, `NAME.yaml` and
`configs/NAME.yaml` for train, probe and ablate, and an ablation spec's `base_config`; a wrong name
lists the shipped ones."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from moe_gspo.config_load import CONFIG_DIR, load_config, resolve_config_path

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["tiny_cpu_fine", "tiny_cpu_fine.yaml", "configs/tiny_cpu_fine.yaml"])
def test_a_shipped_run_config_by_name_from_anywhere(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    assert resolve_config_path(name) == CONFIG_DIR / "tiny_cpu_fine.yaml"
    assert load_config(name).model.tiny == load_config(str(CONFIG_DIR / "tiny_cpu_fine.yaml")).model.tiny


def test_a_wrong_name_lists_the_shipped_ones(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"config file 'tiny_cpu_fin' does not exist .*tiny_cpu.yaml, .*tiny_cpu_fine.yaml"):
        resolve_config_path("tiny_cpu_fin")
    with pytest.raises(ValueError, match=r"ablation spec 'ablation_nope' does not exist .*ablation_tiny.yaml"):
        resolve_config_path("ablation_nope", kind="ablation")
    with pytest.raises(ValueError):
        resolve_config_path("../pyproject")  # names only: nothing outside configs/


def test_ablation_spec_and_its_base_config_by_name(tmp_path, monkeypatch):
    from moe_gspo.ablate import load_spec

    monkeypatch.chdir(tmp_path)
    spec = load_spec("configs/ablation_tiny.yaml")
    assert spec.base_config.is_file() and spec.base_config.parent == CONFIG_DIR
    (tmp_path / "mine.yaml").write_text("base_config: tiny_cpu\nalgos: [gspo]\nrouting_replay: [none]\nseeds: [0]\n")
    assert load_spec("mine.yaml").base_config == CONFIG_DIR / "tiny_cpu.yaml"
    assert load_spec("ablation_tiny").base_config.parent == CONFIG_DIR


def test_probe_reads_a_shipped_config_by_name(tmp_path, monkeypatch):
    from moe_gspo.probe import _probe_fields

    monkeypatch.chdir(tmp_path)
    assert _probe_fields("tiny_cpu_fine")["model"] == _probe_fields(str(CONFIG_DIR / "tiny_cpu_fine.yaml"))["model"]


@pytest.mark.slow
def test_from_tmp_train_help_and_ablate_dry_run(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "moe_gspo.train", "--config", "tiny_cpu_fine", "--help"], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "error:" not in r.stderr and "train.steps" in r.stdout, r.stderr
    r = subprocess.run([sys.executable, "-m", "moe_gspo.ablate", "--config", "configs/ablation_tiny.yaml", "--dry-run",
                        "--out", str(tmp_path / "abl")], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "12 runs (6 arms x 2 seeds), 12 to run, 0 with an invalid config" in r.stdout


@pytest.mark.slow
def test_from_tmp_a_short_run_by_name(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "moe_gspo.train", "--config", "tiny_cpu_fine", "--run-dir", "run",
                        "train.steps=1", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "eval.every=0",
                        "logging.progress=false", "logging.wandb_mode=disabled", "train.export_hf=false"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "run" / "done.json").is_file()
