"""benchmarks.vllm_gumbel_bench runs and reports that the shim samples the kernel's tokens (a small vocabulary, so
that the interpreted kernel stays quick)."""

from __future__ import annotations

import pytest

from benchmarks.vllm_gumbel_bench import main
from moe_gspo.rollout.vllm_support import installed_vllm, on_cpu


@pytest.mark.skipif(installed_vllm() is None or not on_cpu(), reason="needs vLLM on a CPU machine")
def test_the_bench_prints_both_timings_and_the_same_tokens(capsys):
    assert main(["--vocab", "96", "1500", "--tokens", "4", "--repeats", "1"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("vocab")]
    assert len(lines) == 6  # 2 vocabularies x (sampling, log-probs, ranks)
    for line in lines:
        assert "Triton interpreter" in line and "PyTorch" in line and line.endswith("same result: yes")
