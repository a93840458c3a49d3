"""Suite-wide conventions and the machine line every test run prints.

Exact comparisons (`torch.equal`, `np.array_equal`, `atol=0`): **bitwise only for the same kernel twice.**
A test may compare bit for bit only when both sides run the same operations on operands of the same
shapes, dtypes and memory layout (determinism, resume, a refactor that must not change a number, the two
rollout decoders that call the same kernels), or when the arithmetic is exact (copies, casts that lose
nothing, integer ids, values on a quantization grid). Two different kernels (a grouped GEMM against a loop of
GEMMs), one kernel on different shapes (micro-batch sizes, padded lengths: oneDNN and MKL block their fp32
GEMMs per shape, and the blocking differs between CPUs with AMX, with AVX-512 and with AVX2 only) or different
code paths that reach different BLAS calls are compared to a tolerance that fits the dtype. Where an exact
comparison looks like a cross-kernel one, a comment beside it says why the arithmetic is the same.
docs/architecture.md ("Tests") states the same rule.

CI runs on whatever CPU it gets; `pytest_terminal_summary` below prints the CPU model and its AMX / AVX-512
flags (with `-q` too, which hides pytest's report header), so a red run names the machine it ran on.
"""

from __future__ import annotations

from pathlib import Path

# the CPU flags that decide which GEMM kernels oneDNN / MKL / ATen pick (the rounding of fp32 and bf16 GEMMs)
KERNEL_FLAGS = ("amx_tile", "amx_bf16", "amx_int8", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni",
                "avx2", "fma")


def cpu_description(cpuinfo: str | None = None) -> str:
    """One line: the CPU model, its core count and the kernel-relevant flags it has (AMX, AVX-512, AVX2)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    model, flags, cores = "unknown CPU", set(), 0
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "processor":
            cores += 1
        elif key == "model name" and model == "unknown CPU":
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    has = [f for f in KERNEL_FLAGS if f in flags]
    amx = "AMX yes" if any(f.startswith("amx") for f in has) else "AMX no"
    avx512 = "AVX-512 yes" if "avx512f" in has else "AVX-512 no"
    return f"{model} ({cores or '?'} cores): {amx}, {avx512}; flags: {' '.join(has) or 'none of ' + '/'.join(KERNEL_FLAGS)}"


def _torch_line() -> str:
    try:
        import torch
    except ImportError:  # pragma: no cover - the project needs torch
        return "torch not importable"
    capability = torch.backends.cpu.get_cpu_capability()
    return f"torch {torch.__version__}, ATen CPU capability {capability}"


def pytest_report_header(config):
    return [f"machine: {cpu_description()}", _torch_line()]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Shown under `-q` too: which machine this run's numbers (and a red result) come from."""
    terminalreporter.write_sep("-", "machine")
    terminalreporter.write_line(f"machine: {cpu_description()}")
    terminalreporter.write_line(_torch_line())


def pytest_addoption(parser, pluginmanager):
    """pyproject's `timeout` (pytest-timeout's, a dev dependency) registered as a plain ini option where that
    plugin is absent (the offline GPU machine's pytest), so pytest does not warn "Unknown config option:
    timeout"; there it limits nothing."""
    if not pluginmanager.has_plugin("timeout"):
        parser.addini("timeout", "per-test timeout in seconds (pytest-timeout; not installed: ignored)")
