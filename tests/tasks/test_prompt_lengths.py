"""Prompt lengths are checked when the data loads, for both rollout engines, before anything is
written (issue 22, item 1), and an empty prompt file names the fix (item 8)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe_gspo import train
from moe_gspo.config import RolloutConfig
from moe_gspo.tasks import JsonlTask, SyntheticTask
from moe_gspo.tasks.lengths import check_prompt_lengths, context_limit
from moe_gspo.tiny import tiny_qwen3_moe_config
from moe_gspo.tokenizer import load_tiny_tokenizer

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--config", str(ROOT / "configs/tiny_cpu_copy_first.yaml"), "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=2", "rollout.max_new_tokens=4", "train.num_minibatches=2", "train.steps=1",
        "logging.wandb_mode=disabled", "logging.progress=false", "logging.trace_every=0", "train.export_hf=false"]


@pytest.fixture
def long_data(tmp_path) -> Path:
    """Line 1 fits, line 3 has 402 characters (402 tokens with the shipped character tokenizer)."""
    f = tmp_path / "data.jsonl"
    f.write_text("\n".join([json.dumps({"prompt": "2+3=", "answer": "5"}), "",
                            json.dumps({"prompt": "1" * 402, "answer": "1"}),
                            json.dumps({"prompt": "2" * 130, "answer": "2"})]) + "\n")
    return f


def _errors(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_a_prompt_longer_than_the_context_stops_before_anything_is_written(long_data, tmp_path, capsys, engine):
    """hf trained silently past the context; vllm failed at the step that sampled the prompt, naming
    `prompts[0]`, after config.yaml and metrics.jsonl were written (so the rerun was refused)."""
    run_dir = tmp_path / "run"
    extra = ["rollout.engine=vllm", "rollout.dtype=float32", "rollout.max_model_len=128"] if engine == "vllm" else []
    rc = train.main([*TINY, "task.name=jsonl", f"task.path={long_data}", "model.tiny={max_position_embeddings: 128}",
                     *extra, "--run-dir", str(run_dir)])
    assert rc == 2
    errors = _errors(capsys.readouterr().err)
    assert len(errors) == 1, errors
    limit = "rollout.max_model_len=128" if engine == "vllm" else "max_position_embeddings=128"
    assert f"{long_data}:3: the prompt has 402 tokens, more than the 124 that fit the {engine} engine" in errors[0]
    assert limit in errors[0] and "rollout.max_new_tokens=4" in errors[0]
    assert f"1 more prompt too long ({long_data}:4)" in errors[0]  # 130 > 124; line 1 fits
    assert not run_dir.exists()


def test_context_limit_of_each_engine():
    model = tiny_qwen3_moe_config(max_position_embeddings=128)
    assert context_limit(model, RolloutConfig(engine="hf"))[0] == 128
    assert context_limit(model, RolloutConfig(engine="vllm"))[0] == 128
    assert context_limit(model, RolloutConfig(engine="vllm", max_model_len=64))[0] == 64
    with pytest.raises(ValueError, match=r"rollout.max_model_len=256 exceeds the model's max_position_embeddings=128"):
        context_limit(model, RolloutConfig(engine="vllm", max_model_len=256))
    # vLLM's rule: a linear RoPE factor scales the context, YaRN's config is already scaled
    linear = tiny_qwen3_moe_config(max_position_embeddings=128,
                                   rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4})
    assert context_limit(linear, RolloutConfig(engine="hf"))[0] == 256


def test_synthetic_task_names_its_length_knob():
    task = SyntheticTask("copy", prompt_len=8, prompt_len_max=12, num_symbols=4, pad_prompts=True)
    (longest,) = task.longest_prompts()
    assert len(longest.text) == max(len(p.text) for p in task.prompts(0, 200, seed=0)) == 14
    tok, model = load_tiny_tokenizer(), tiny_qwen3_moe_config(max_position_embeddings=20)
    assert check_prompt_lengths([longest], tok, model, RolloutConfig(max_new_tokens=6)) == 14
    with pytest.raises(ValueError, match=r"task.name=copy with task.prompt_len_max=12: the prompt has 14 tokens, "
                                         r"more than the 7 .* lower rollout.max_new_tokens \(now 13\)"):
        check_prompt_lengths([longest], tok, model, RolloutConfig(max_new_tokens=13))
    (add,) = SyntheticTask("add", prompt_len=6).longest_prompts()
    assert add.text == "999+999="


def test_an_empty_prompt_file_names_the_fix(tmp_path):
    f = tmp_path / "empty.jsonl"
    f.write_text("\n  \n")
    with pytest.raises(ValueError, match=r"holds no prompts .* write one JSON object per line, e\.g\. \{\"prompt\""):
        JsonlTask(f)
