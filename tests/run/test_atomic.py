"""Files written atomically get the mode a plain `open()` gives (issue 32, defect 9): the HF export's
`model.safetensors` and the routing traces were 0600 (safetensors' writer, `tempfile.mkstemp`) while the
rest of the run directory was 0644, unreadable to the other users of a shared filesystem."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest

from moe_gspo.run.atomic import current_umask, default_mode, publish_mode


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
    from moe_gspo.run.sinks import atomic_write_text

    atomic_write_text(tmp_path / "run.json", "{}")
    _write_rank_file(tmp_path / "rank_00000.pt", {"x": 1})
    assert mode(tmp_path / "run.json") == mode(tmp_path / "rank_00000.pt") == 0o666 & ~umask
