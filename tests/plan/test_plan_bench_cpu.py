"""The GPU memory benchmark's code path runs on CPU (tiny model, nothing measured)."""

from benchmarks.memory_bench import main


def test_memory_bench_code_path_on_cpu(capsys):
    import torch

    if torch.cuda.is_available():
        import pytest

        pytest.skip("covered by tests/plan/test_plan_gpu.py on CUDA")
    assert main(["--steps", "1", "--seq-len", "16", "--seqs", "4", "--group", "2"]) == 0
    out = capsys.readouterr().out
    for phase in ("rollout", "logprobs", "update", "weight_sync"):
        assert f"cpu               {phase}" in out
