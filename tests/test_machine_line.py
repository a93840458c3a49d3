"""The machine line of the test command's output (tests/conftest.py, issue 51): a red CI names its CPU."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

_spec = importlib.util.spec_from_file_location("_suite_conftest", Path(__file__).with_name("conftest.py"))
conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(conftest)

AMX_BOX = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8481C
flags\t\t: fpu sse2 avx avx2 fma avx512f avx512_bf16 avx512_vnni amx_bf16 amx_tile amx_int8
processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8481C
flags\t\t: fpu sse2 avx avx2 fma avx512f avx512_bf16 avx512_vnni amx_bf16 amx_tile amx_int8
"""
AVX2_BOX = """processor\t: 0
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx avx2 fma
"""


def test_the_line_names_the_model_cores_and_the_kernel_flags():
    line = conftest.cpu_description(AMX_BOX)
    assert line.startswith("Intel(R) Xeon(R) Platinum 8481C (2 cores): AMX yes, AVX-512 yes")
    assert "amx_tile" in line and "avx512_bf16" in line and "avx2" in line
    line = conftest.cpu_description(AVX2_BOX)
    assert line.startswith("AMD EPYC (1 cores): AMX no, AVX-512 no") and line.endswith("avx2 fma")
    assert conftest.cpu_description("").startswith("unknown CPU")


def test_the_test_command_prints_it_under_q(tmp_path):
    (tmp_path / "conftest.py").write_text(Path(__file__).with_name("conftest.py").read_text())
    (tmp_path / "test_ok.py").write_text("def test_ok():\n    assert True\n")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert any(line.startswith("machine: ") and " AMX " in line and "AVX-512 " in line for line in lines), out.stdout
    assert any(line.startswith("torch ") and "ATen CPU capability" in line for line in lines), out.stdout
