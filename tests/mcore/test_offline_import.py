"""Issue 61, item 1: megatron-core imports on the offline GPU machine whatever it has, setuptools included.

`import megatron.core` imports `torch.utils.cpp_extension` (via `nccl_allocator`), which imports setuptools,
and Python 3.12 ships none. docs/gpu.md ("An offline GPU machine, step by step") carries setuptools' wheel
beside megatron-core's and installs `.whl/*.whl` into a target folder. Here, in subprocesses where setuptools
is hidden from the interpreter (a `sitecustomize` on `PYTHONPATH` whose meta-path finder refuses it, and its
`distutils` shims, outside the allowed folders): without the install `import megatron.core` fails naming
setuptools; after the documented install line (read from docs/gpu.md, run with this interpreter's pip on a
setuptools wheel made of the installed distribution's files, the same package; `.whl/`'s real wheel when the
checkout has it) `import megatron.core` works and the documented `pytest -m gpu` line collects its tests.
megatron-core itself is this environment's (the cp312 wheel does not install on this Python).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]
HIDE = '''
import importlib.machinery, os, sys
HIDDEN = ("setuptools", "pkg_resources", "_distutils_hack", "distutils")
ALLOW = [p for p in os.environ.get("HIDE_SETUPTOOLS_EXCEPT", "").split(os.pathsep) if p]
for name in [m for m in sys.modules if m.partition(".")[0] in HIDDEN]:
    del sys.modules[name]
sys.meta_path[:] = [f for f in sys.meta_path if type(f).__module__.partition(".")[0] not in HIDDEN]

class HideSetuptools:
    def find_spec(self, name, path=None, target=None):
        if path is not None or name not in HIDDEN:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, ALLOW) if ALLOW else None
        if spec is None:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return spec

sys.meta_path.insert(0, HideSetuptools())
'''


def documented_lines() -> tuple[str, str]:
    """docs/gpu.md's device install line and its `pytest -m gpu` line (continuation lines joined)."""
    text = (ROOT / "docs" / "gpu.md").read_text().replace("\\\n", " ")
    install = re.search(r"^python3 -m pip install --no-index[^\n]*", text, re.M)
    gpu_tests = re.search(r"^python3 -m pytest -q -m gpu [^\n#]*", text, re.M)
    assert install and gpu_tests, "docs/gpu.md lost its offline install or pytest -m gpu line"
    return install.group(0), gpu_tests.group(0)


def setuptools_wheel(folder: Path) -> Path:
    """A setuptools wheel in `folder`: `.whl/`'s (the documented download) when there, else one made of the
    installed distribution's files (what that wheel unpacks to; the tests need no network)."""
    carried = sorted((ROOT / ".whl").glob("setuptools-*-py3-none-any.whl"))
    if carried:
        return carried[-1]
    dist = metadata.distribution("setuptools")
    wheel = folder / f"setuptools-{dist.version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for f in dist.files:
            if "__pycache__" not in f.parts and f.name not in ("INSTALLER", "REQUESTED", "direct_url.json"):
                z.write(f.locate(), str(f))
    return wheel


def hidden_env(tmp_path: Path, *allowed: Path) -> dict:
    hook = tmp_path / "hide"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(HIDE)
    path = [str(hook), *map(str, allowed), str(ROOT)]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(path),
                HIDE_SETUPTOOLS_EXCEPT=os.pathsep.join(map(str, allowed)))


def test_megatron_core_needs_setuptools_and_the_documented_install_carries_it(tmp_path):
    install, gpu_tests = documented_lines()
    assert ".whl/*.whl" in install, install  # every carried wheel, setuptools' too
    assert "setuptools==" in (ROOT / "docs" / "gpu.md").read_text().split(install)[0], "the download fetches setuptools"
    probe = "import megatron.core, sys; print('setuptools' in sys.modules, sys.modules['setuptools'].__file__)"
    # 1. setuptools unimportable, nothing carried: megatron.core does not import, and says why
    bare = subprocess.run([sys.executable, "-c", probe], env=hidden_env(tmp_path), capture_output=True, text=True,
                          timeout=300)
    assert bare.returncode != 0 and "No module named 'setuptools'" in bare.stderr, bare.stderr[-2000:]
    # 2. the documented install of the carried wheels (here: setuptools'), then the same import
    wheels, site = tmp_path / "whl", tmp_path / "site"
    wheels.mkdir()
    wheel = setuptools_wheel(wheels)
    argv = shlex.split(install)
    argv = [sys.executable, *argv[1:]]
    argv[argv.index("--target") + 1] = str(site)
    argv = [a for a in argv if a != ".whl/*.whl"] + [str(wheel)]
    got = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr[-2000:]
    env = hidden_env(tmp_path, site)
    ok = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert ok.stdout.split()[0] == "True" and ok.stdout.split()[1].startswith(str(site)), ok.stdout
    # 3. the documented `pytest -m gpu` line's imports: its test files collect (their tests skip without CUDA)
    files = [a for a in shlex.split(gpu_tests) if a.endswith(".py")]
    assert files and all((ROOT / f).is_file() for f in files), files
    collect = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
                              "-m", "gpu", *files], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert collect.returncode == 0 and "error" not in collect.stdout.lower(), collect.stdout[-3000:]
    assert re.search(r"\d+ tests? collected|\d+/\d+ tests? collected", collect.stdout), collect.stdout[-1000:]


def test_the_hiding_hook_hides_only_setuptools(tmp_path):
    """The hook refuses setuptools and keeps other imports (a hook that hid everything would fail the test
    above for the wrong reason)."""
    code = ("import json, yaml\ntry:\n    import setuptools\n    print('imported')\n"
            "except ModuleNotFoundError as e:\n    print('refused', e.name)")
    got = subprocess.run([sys.executable, "-c", code], env=hidden_env(tmp_path), capture_output=True, text=True,
                         timeout=120)
    assert got.stdout.split() == ["refused", "setuptools"], got.stderr[-2000:]


def test_pytest_without_pytest_timeout_does_not_warn_about_the_timeout_option():
    """The device's pytest has no pytest-timeout: pyproject's `timeout` ini option is registered by
    tests/conftest.py there (`-p no:timeout` stands for the missing plugin), so no "Unknown config option"."""
    got = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:timeout", "-p", "no:cacheprovider", "-q",
                          "--collect-only", "tests/test_files.py"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert got.returncode == 0 and "tests collected" in got.stdout, got.stdout[-2000:]
    assert "Unknown config option" not in got.stdout + got.stderr, (got.stdout + got.stderr)[-2000:]
