"""Issue 49: fault trials that held, kept as tests so that none regresses: a read-only filesystem, a `latest`
pointer that leads out of the run, `!!python` tags in a config, unicode paths, and probes of broken models. (The
other trials that held are tested where their code is; tests/faults/README.md lists every trial and its test.)"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from faults._tiny import errors, rows, train
from moe_gspo import probe


@pytest.fixture
def ro_mount(tmp_path):
    """A read-only tmpfs (root needed to mount one; root also writes through chmod 0555, so a mode is no test)."""
    mnt = tmp_path / "ro"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.decode().strip()[:80]}); needs root")
    yield mnt
    if subprocess.run(["umount", str(mnt)]).returncode:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


def test_a_read_only_filesystem_is_one_line_before_any_compute(ro_mount, capsys, monkeypatch):
    import moe_gspo.run.setup as setup

    monkeypatch.setattr(setup, "build_policy", lambda *a, **k: pytest.fail("built a model for a run it cannot write"))
    assert train(ro_mount / "run", "train.steps=1") == 2
    lines = errors(capsys.readouterr().err)
    assert len(lines) == 1 and "--run-dir=" in lines[0] and str(ro_mount) in lines[0], lines
    assert os.listdir(ro_mount) == []


def test_a_latest_pointer_out_of_the_run_loads_nothing_of_another_run(tmp_path, capsys):
    """`checkpoints/latest` replaced by a link to another run's newest checkpoint: resume uses this run's own."""
    mine, other = tmp_path / "mine", tmp_path / "other"
    assert train(mine, "train.steps=2") == 0
    assert train(other, "train.steps=3", "train.seed=1") == 0
    latest = mine / "checkpoints" / "latest"
    latest.unlink()
    latest.symlink_to(other / "checkpoints" / "step_000003")
    (mine / "done.json").unlink()
    capsys.readouterr()
    assert train(mine, "--resume", "train.steps=3") == 0
    assert "resuming at step 2" in capsys.readouterr().out  # its own step_000002, not other's step 3
    assert [r["step"] for r in rows(mine)] == [0, 1, 2]


def test_python_tags_in_a_config_are_refused_and_run_nothing(tmp_path):
    from moe_gspo.config_load import load_config

    mark = tmp_path / "ran"
    cfg = tmp_path / "evil.yaml"
    cfg.write_text(f"train:\n  steps: !!python/object/apply:os.system ['touch {mark}']\n")
    with pytest.raises(ValueError, match=rf"^config file {str(cfg)!r} line 2: could not determine a constructor "
                                         r"for the tag 'tag:yaml.org,2002:python/object/apply:os.system'"):
        load_config(cfg)
    with pytest.raises(ValueError, match="could not determine a constructor"):
        load_config(None, [f"train.steps=!!python/object/apply:os.system ['touch {mark}']"])
    assert not mark.exists()


def test_unicode_paths_train_and_report(tmp_path):
    from analysis.report import build_report

    run_dir = tmp_path / "lauf-ü-日本" / "run é"
    data = tmp_path / "données.jsonl"
    data.write_text('{"prompt": "2+3=", "answer": "5"}\n{"prompt": "7*6=", "answer": "42"}\n', encoding="utf-8")
    assert train(run_dir, "train.steps=1", "task.name=jsonl", f"task.path={data}") == 0
    assert [r["step"] for r in rows(run_dir)] == [0]
    paths = build_report(run_dir, tmp_path / "rapport ü")
    assert str(run_dir) in paths.markdown.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from moe_gspo.tiny import make_tiny_checkpoint

    d = tmp_path_factory.mktemp("probe") / "model"
    make_tiny_checkpoint(d, seed=1)
    return d


@pytest.mark.parametrize("how, msg", [("truncated", "cannot be read"), ("no_config", "config.json"),
                                      ("nan", "holds NaN/Inf values")])
def test_a_probe_of_a_broken_model_is_one_line(tiny_model, tmp_path, capsys, how, msg):
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    weights = model / "model.safetensors"
    if how == "truncated":
        os.truncate(weights, weights.stat().st_size // 2)
    elif how == "no_config":
        (model / "config.json").unlink()
    else:
        from safetensors.torch import load_file, save_file

        sd = load_file(weights)
        name = sorted(k for k in sd if "q_proj" in k)[0]
        sd[name][0, 0] = float("nan")
        save_file(sd, weights, metadata={"format": "pt"})
    (tmp_path / "prompts.txt").write_text("0123:\n")
    rc = probe.main(["--model", str(model), "--prompts", str(tmp_path / "prompts.txt"),
                     "--out", str(tmp_path / "drift.json")])
    lines = errors(capsys.readouterr().err)
    assert rc == 2 and len(lines) == 1 and msg in lines[0], lines
    assert not (tmp_path / "drift.json").exists()
