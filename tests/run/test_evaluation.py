"""Held-out evaluation and saved samples (issue 32, deliverables 1-2): hand-computed eval metrics,
which policy versions are evaluated, per-token routing flips, and a run with eval + a reward plug-in +
saved samples whose training metrics equal those of the same run without them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from moe_gspo import train
from moe_gspo.config_load import load_config
from moe_gspo.run.evaluation import eval_metrics, is_eval_step
from moe_gspo.run.samples import token_flips

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--config", str(ROOT / "configs/tiny_cpu_copy_first.yaml"), "parallel.expert_parallel_size=1",
         "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=3",
         "logging.wandb_mode=disabled", "logging.progress=false", "train.export_hf=false", "logging.trace_every=0",
         "logging.update_drift_every=0", "train.steps=3"]


def test_eval_metrics_by_hand():
    rewards = torch.tensor([[1.0, 0.0, 0.5], [0.0, 0.2, 0.0]])
    lens = torch.tensor([[2, 3, 4], [1, 1, 1]])
    stops = torch.tensor([[True, False, True], [True, True, True]])
    m = eval_metrics(rewards, lens, stops, version=7)
    assert m["eval/reward_mean"] == pytest.approx(1.7 / 6)
    assert m["eval/accuracy"] == pytest.approx(1 / 6)  # one response at reward >= 1
    assert m["eval/pass_at_k"] == 0.5  # prompt 0 has a correct one of its 3, prompt 1 none
    assert (m["eval/k"], m["eval/num_prompts"], m["eval/policy_step"]) == (3.0, 2.0, 7.0)
    assert m["eval/response_len_mean"] == pytest.approx(12 / 6) and m["eval/stop_frac"] == pytest.approx(5 / 6)
    assert "eval/pass_at_k" not in eval_metrics(rewards[:, :1], lens[:, :1], stops[:, :1], version=0)


def test_evaluated_versions():
    cfg = load_config(None, ["train.steps=7", "eval.every=3"])
    assert [v for v in range(8) if is_eval_step(cfg, v)] == [0, 3, 6, 7]
    assert not any(is_eval_step(load_config(None, ["train.steps=7"]), v) for v in range(8))


def test_token_flips_count_layers_on_the_producing_row():
    # P = 2, R = 3: token j's log-prob comes from row 1 + j; rows [T=4, L=2, K=2]
    a = np.array([[[0, 1], [2, 3]], [[0, 1], [2, 3]], [[1, 0], [3, 2]], [[4, 5], [6, 7]]])
    b = a.copy()
    b[0] = [[7, 7], [7, 7]]  # a prompt row: not a response token's
    b[2, 1] = [2, 4]  # token 1: one layer differs (order within the top-k does not count)
    b[3] = [[4, 6], [5, 7]]  # row 3 = token 2: both layers
    assert token_flips(a, b, prompt_len=2, response_len=3) == [0, 1, 2]
    assert token_flips(a, b[:3], prompt_len=2, response_len=3) == [0, 1, None]  # row 3 missing on one side


@pytest.mark.slow
def test_eval_and_samples_leave_training_unchanged(tmp_path):
    """A run with eval every step, a reward plug-in file and saved samples trains exactly like the same
    run without eval and samples; eval.jsonl holds versions 0..3, metrics rows carry eval/*."""
    reward_file = tmp_path / "my_reward.py"
    reward_file.write_text("from moe_gspo.tasks.synthetic import positional_credit\n"
                           "def reward(prompt, response, answer):\n"
                           "    return positional_credit(response, answer)\n")
    plug = f"task.reward={reward_file}:reward"
    with_eval = ["eval.every=1", "eval.num_prompts=6", "eval.greedy=false", "eval.samples_per_prompt=2",
                 "logging.samples_every=2", "logging.num_samples=3"]
    assert train.main([*SMALL, "--run-dir", str(tmp_path / "a"), plug, *with_eval]) == 0
    assert train.main([*SMALL, "--run-dir", str(tmp_path / "b"), plug, "logging.samples_every=0"]) == 0
    rows_a, rows_b = ([json.loads(l) for l in (tmp_path / d / "metrics.jsonl").read_text().splitlines()] for d in "ab")

    def training(r):
        return {k: v for k, v in r.items() if not k.startswith(("perf/", "eval/"))}

    assert [training(r) for r in rows_a] == [training(r) for r in rows_b]
    assert [r["eval/policy_step"] for r in rows_a] == [0.0, 1.0, 2.0] and "eval/reward_mean" not in rows_b[0]
    evals = [json.loads(l) for l in (tmp_path / "a" / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 1, 2, 3]
    assert all(e["eval/num_prompts"] == 6 and e["eval/k"] == 2 and 0 <= e["eval/pass_at_k"] <= 1 for e in evals)
    assert {k: v for k, v in evals[1].items() if k != "step"} == {k: v for k, v in rows_a[1].items()
                                                                 if k.startswith("eval/")}
    samples = [json.loads(l) for l in (tmp_path / "a" / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [0, 0, 0, 2, 2, 2]
    for s in samples:
        assert len(s["response_tokens"]) == len(s["routing_flips"]) >= 1
        assert all(f is None or 0 <= f <= 2 for f in s["routing_flips"])
        assert 0.0 <= s["reward"] <= 1.0 and s["finish_reason"] in ("stop", "length")
    assert not (tmp_path / "b" / "samples.jsonl").exists() and not (tmp_path / "b" / "eval.jsonl").exists()
    assert json.loads((tmp_path / "a" / "run.json").read_text())["learner_dtype"] == "float32"


def test_a_run_with_the_tokenizers_chat_template(tmp_path):
    """task.chat_template=tokenizer on a tiny checkpoint whose tokenizer has a template: the rollout's
    prompts are the template's token ids (longer than the raw prompt by the template's tokens)."""
    from moe_gspo.tiny import make_tiny_checkpoint
    from moe_gspo.tokenizer import load_tiny_tokenizer

    ckpt = make_tiny_checkpoint(tmp_path / "ckpt")
    tok = load_tiny_tokenizer()
    tok.chat_template = ("{% for m in messages %}{{ '<bos>' + m['role'][0] + ':' + m['content'] + '<eos>' }}{% endfor %}"
                         "{% if add_generation_prompt %}{{ 'a:' }}{% endif %}")
    tok.save_pretrained(ckpt)  # the checkpoint's own tokenizer, now with a chat template
    common = [*SMALL, "train.steps=1", "logging.trace_every=1", f"model.path={ckpt}"]
    assert train.main([*common, "--run-dir", str(tmp_path / "chat"), "task.chat_template=tokenizer"]) == 0
    assert train.main([*common, "--run-dir", str(tmp_path / "raw")]) == 0
    lens = {}
    for d in ("chat", "raw"):
        with np.load(tmp_path / d / "traces" / "step_000000_rollout.npz") as z:
            lens[d] = z["prompt_lens"]
    # <bos> u : ... <eos> a : = 6 tokens around the text
    assert (lens["chat"] - lens["raw"] == 6).all(), lens
    # issue 43: samples.jsonl shows each prompt as the engine got it, run.json the encoding setting
    from moe_gspo.tasks.encoding import encode_prompts

    for d, template in (("chat", "tokenizer"), ("raw", "none")):
        assert json.loads((tmp_path / d / "run.json").read_text())["prompt_encoding"] == {
            "chat_template": template, "system_prompt": None}
        rows = [json.loads(line) for line in (tmp_path / d / "samples.jsonl").read_text().splitlines()]
        assert rows
        for r in rows:
            (ids,) = encode_prompts(tok, [r["prompt"]], chat_template=template)
            assert r["prompt_encoded"] == tok.decode(ids, skip_special_tokens=False)
        assert all(r["prompt_encoded"].endswith("a:") == (d == "chat") for r in rows)
