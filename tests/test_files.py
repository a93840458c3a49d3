"""moe_gspo.files, the ground floor every layer writes through.

Files written atomically get the mode a plain `open()` gives (issue 32, defect 9): the HF export's
`model.safetensors` and the routing traces were 0600 (safetensors' writer, `tempfile.mkstemp`) while the
rest of the run directory was 0644, unreadable to the other users of a shared filesystem. A full disk is
recognised (also as text) and named; output paths are checked without creating anything."""

from __future__ import annotations

import errno
import os
import stat

import numpy as np
import pytest

from moe_gspo.files import (atomic_write_text, check_output_dir, check_output_file, current_umask, default_mode,
                            is_disk_full, publish_mode, writing)


@pytest.fixture(params=[0o022, 0o027], ids=["umask022", "umask027"])
def umask(request):
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_the_helper_follows_the_umask(tmp_path, umask):
    assert current_umask() == umask
    assert default_mode() == 0o666 & ~umask and default_mode(directory=True) == 0o777 & ~umask
    import tempfile

    fd, f = tempfile.mkstemp(dir=tmp_path)
    os.close(fd)
    d = tempfile.mkdtemp(dir=tmp_path)
    open(os.path.join(d, "inner"), "w").close()
    os.chmod(os.path.join(d, "inner"), 0o600)
    publish_mode(f)
    publish_mode(d, recursive=True)
    assert mode(f) == 0o666 & ~umask
    assert mode(d) == 0o777 & ~umask and mode(os.path.join(d, "inner")) == 0o666 & ~umask


def test_save_trace(tmp_path, umask):
    from moe_gspo.routing.trace import RoutingTrace, save_trace

    tr = RoutingTrace.from_samples([np.zeros((3, 1, 2), dtype=np.int64)], [2], [1], 8, [0])
    path = save_trace(tmp_path / "traces" / "step_000000_rollout.npz", tr)
    assert mode(path) == 0o666 & ~umask


def test_save_hf_checkpoint(tmp_path, umask):
    from moe_gspo.mcore.checkpoint import save_hf_checkpoint
    from moe_gspo.tiny import build_tiny_model, tiny_qwen3_moe_config

    cfg = tiny_qwen3_moe_config()
    out = save_hf_checkpoint(dict(build_tiny_model(cfg, seed=0).state_dict()), cfg, tmp_path / "hf_export")
    assert mode(out) == 0o777 & ~umask
    files = sorted(p for p in out.rglob("*"))
    assert out / "model.safetensors" in files
    assert {p.name: oct(mode(p)) for p in files} == {p.name: oct(0o666 & ~umask) for p in files}


def test_atomic_write_text_and_checkpoint_rank_files(tmp_path, umask):
    """The writers through a plain `open()`: already the default mode (kept so)."""
    from moe_gspo.run.checkpoint import _write_rank_file

    atomic_write_text(tmp_path / "run.json", "{}")
    _write_rank_file(tmp_path / "rank_00000.pt", {"x": 1})
    assert mode(tmp_path / "run.json") == mode(tmp_path / "rank_00000.pt") == 0o666 & ~umask


def test_a_full_disk_is_recognised_and_named(tmp_path):
    full = OSError(errno.ENOSPC, "No space left on device")
    assert is_disk_full(full)
    wrapped = RuntimeError("enforce fail at inline_container.cc:672")
    wrapped.__context__ = full
    assert is_disk_full(wrapped)
    assert is_disk_full(Exception("Error while serializing: I/O error: No space left on device (os error 28)"))
    assert not is_disk_full(OSError(errno.EACCES, "Permission denied"))
    with pytest.raises(ValueError, match=r"disk full while writing traces .*x\.npz.*free space or choose another"):
        with writing(tmp_path / "x.npz", "traces"):
            raise full


def test_output_paths_are_checked_without_creating_anything(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match=r"--out=.*afile' is a file, not a directory"):
        check_output_file(tmp_path / "afile" / "sub" / "drift.json", "--out")
    with pytest.raises(ValueError, match="is a directory"):
        check_output_file(tmp_path, "--out")
    with pytest.raises(ValueError, match="out_dir=.* is a file"):
        check_output_dir(tmp_path / "afile", "out_dir")
    check_output_file(tmp_path / "new" / "deeper" / "drift.json", "--out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_a_failed_atomic_write_leaves_the_file_unchanged(tmp_path, monkeypatch):
    target = tmp_path / "run.json"
    atomic_write_text(target, "old")

    def full(self, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(type(target), "write_text", full)
    with pytest.raises(ValueError, match="disk full while writing file"):
        atomic_write_text(target, "new")
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["run.json"]
