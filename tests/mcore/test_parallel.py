"""Process-grid validation (pure; the EP=2 launch itself is in test_ep2.py)."""

from __future__ import annotations

import os
import sys

import pytest

from moe_gspo.mcore.parallel import validate_parallel_sizes


def test_valid_grids_pass():
    for world, ep, experts in ((1, 1, 8), (2, 2, 8), (4, 2, 8), (8, 8, 128)):
        assert validate_parallel_sizes(world_size=world, ep_size=ep, num_experts=experts) is None
        if ep > 1:  # and their neighbours fail: the check is not vacuous on these sizes
            with pytest.raises(ValueError, match="world size"):
                validate_parallel_sizes(world_size=world + 1, ep_size=ep, num_experts=experts)
            with pytest.raises(ValueError, match="num_experts"):
                validate_parallel_sizes(world_size=world, ep_size=ep, num_experts=experts + 1)


@pytest.mark.parametrize(("world", "ep", "experts", "match"), [
    (3, 3, 8, "num_experts=8 is not divisible by parallel.expert_parallel_size=3"),
    (3, 2, 8, "world size 3 is not divisible by parallel.expert_parallel_size=2"),
    (1, 0, 8, "expert_parallel_size must be >= 1"),
])
def test_bad_grids_name_the_field(world, ep, experts, match):
    with pytest.raises(ValueError, match=match):
        validate_parallel_sizes(world_size=world, ep_size=ep, num_experts=experts)


# ---- destroy_distributed in the `finally:` of an interrupted start-up (issue 32, defect 3) ----

_INTERRUPTED_IMPORT = r'''
import importlib.abc, sys

class InterruptOnce(importlib.abc.MetaPathFinder):
    """SIGINT arriving while Megatron's import chain is importing sympy."""
    def find_spec(self, name, path, target=None):
        if name == "sympy.printing":
            sys.meta_path.remove(self)
            raise KeyboardInterrupt
        return None

import torch
sys.meta_path.insert(0, InterruptOnce())
try:
    from megatron.core import parallel_state
    raise SystemExit("the simulated interrupt did not happen")
except KeyboardInterrupt:
    pass
from moe_gspo.mcore.parallel import destroy_distributed
destroy_distributed()
print("clean", "megatron.core" in sys.modules)
'''


def test_destroy_after_an_interrupted_megatron_import_is_silent(tmp_path):
    """The real sequence: Megatron's import broken off by a KeyboardInterrupt halfway through sympy,
    then the entry point's `finally: destroy_distributed()` (it used to re-import Megatron and crash
    with `module 'sympy' has no attribute ...`)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", _INTERRUPTED_IMPORT], cwd=root, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "clean False"
    assert "Traceback" not in proc.stderr and "warning" not in proc.stderr


def test_destroy_never_imports_megatron_or_torch_distributed(monkeypatch):
    """Neither module imported (or both dropped by a broken-off import): nothing to tear down, and
    importing them now would run the broken chain again."""
    import importlib.abc
    import sys

    from moe_gspo.mcore.parallel import destroy_distributed

    class Refuse(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] in ("megatron", "torch", "sympy"):
                raise AttributeError(f"module 'sympy' has no attribute 'printing' (importing {name})")
            return None

    for name in [n for n in sys.modules if n.split(".")[0] in ("megatron", "sympy") or
                 n.startswith("torch.distributed")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [Refuse(), *sys.meta_path])
    destroy_distributed()  # must neither import nor raise
    assert not any(n.split(".")[0] == "megatron" or n.startswith("torch.distributed") for n in sys.modules)


def test_destroy_skips_a_module_still_initialising(monkeypatch):
    """A module whose import is still executing (`__spec__._initializing`) is not used."""
    import importlib.machinery
    import sys
    import types

    from moe_gspo.mcore.parallel import destroy_distributed

    def boom():
        raise AssertionError("a half-imported module was used")

    for name in ("megatron.core.parallel_state", "torch.distributed"):
        half = types.ModuleType(name)
        half.__spec__ = importlib.machinery.ModuleSpec(name, None)
        half.__spec__._initializing = True
        half.model_parallel_is_initialized = half.is_available = half.is_initialized = boom
        monkeypatch.setitem(sys.modules, name, half)
    destroy_distributed()


def test_destroy_reports_a_failing_teardown_in_one_line(monkeypatch, capsys):
    import sys
    import types

    from moe_gspo.mcore.parallel import destroy_distributed

    ps = types.ModuleType("megatron.core.parallel_state")
    ps.model_parallel_is_initialized = lambda: True

    def fail():
        raise RuntimeError("process group already gone")

    ps.destroy_model_parallel = fail
    monkeypatch.setitem(sys.modules, "megatron.core.parallel_state", ps)
    destroy_distributed()
    err = capsys.readouterr().err
    assert err.strip() == ("warning: tearing down torch.distributed failed "
                           "(RuntimeError: process group already gone)")


_STORE_SCRIPT = r'''
import glob, os, sys
from moe_gspo.mcore.parallel import destroy_distributed, init_distributed
init_distributed(ep_size=1, num_experts=8, seed=0)
print("during", len(glob.glob(os.path.join(sys.argv[1], "moe_gspo_pg_*"))), flush=True)
if sys.argv[2] == "destroy":
    destroy_distributed()
os._exit(0)  # as moe_gspo.run.quick_exit ends a run: no destructor runs
'''


@pytest.mark.parametrize("destroy", [True, False])
def test_a_single_process_rendezvous_leaves_no_file_behind(tmp_path, destroy):
    """A 1-process run without torchrun rendezvous through a temp file (gloo's FileStore), which the store deletes
    only in its destructor: a run ending in os._exit left one per run in /tmp. destroy_distributed removes it; without
    it the file stays (the leak this guards against)."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")}
    env["TMPDIR"] = str(tmp_path)
    out = subprocess.run([sys.executable, "-c", _STORE_SCRIPT, str(tmp_path), "destroy" if destroy else "keep"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "during 1" in out.stdout
    assert len(list(tmp_path.glob("moe_gspo_pg_*"))) == (0 if destroy else 1)
