"""benchmarks.fastpath_bench: interleaved medians, and one short run of the whole benchmark."""

from __future__ import annotations

import pytest

from benchmarks.fastpath_bench import interleaved, main


def test_interleaved_alternates_the_variants_and_takes_medians():
    calls = []
    medians = interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, repeats=3)
    assert calls == ["a", "b"] * 4  # one warm-up each, then turn by turn
    assert set(medians) == {"a", "b"} and all(m >= 0 for m in medians.values())


def test_the_benchmark_runs_on_the_default_config(capsys):
    out = main(["--repeats", "1"])
    text = capsys.readouterr().out
    same = int(text.split("identical samples: ")[1].split(" of ")[0])
    assert same >= 0.9 * 128  # the engine's fp32 kernels draw what torch's bf16 kernels draw, but for rare rounding
    compact_same = int(text.split("compact decode steps vs transformers' forward (identical samples: ")[1].split(" of ")[0])
    assert compact_same == 128  # the compact passes compute transformers' numbers bit for bit
    rollout = {"rollout/engine", "rollout/native bf16", "rollout/fp32", "rollout/transformers decode"}
    learner = {f"{what}/{v}" for what in ("old_pass", "train_step")
               for v in ("default", "loop experts", "local attention", "unfused RoPE")}
    fused = {"old_pass_and_update/fused old pass", "old_pass_and_update/separate passes"}
    assert rollout | learner | fused == set(out)
    assert all(v > 0 for v in out.values())


def test_a_real_checkpoint_config_is_refused(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model:\n  path: /some/checkpoint\n")
    with pytest.raises(ValueError, match="model.path=null"):
        main(["--config", str(cfg), "--repeats", "1"])
