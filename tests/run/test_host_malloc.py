"""moe_gspo.run.host_malloc: glibc accepts the malloc settings (run in a child process: they are process-wide)."""

import platform
import subprocess
import sys

import pytest

from moe_gspo.run import host_malloc


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt settings are glibc's")
def test_glibc_accepts_every_setting_and_the_values_are_glibcs_limits_or_below():
    code = "from moe_gspo.run.host_malloc import keep_freed_heap as k; print(k(), k())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "True"]
    values = dict(host_malloc.SETTINGS)
    assert values[host_malloc.M_MMAP_THRESHOLD] <= 32 << 20  # glibc refuses a larger mmap threshold (HEAP_MAX / 2)
