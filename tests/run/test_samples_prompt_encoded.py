"""Issue 43: samples.jsonl's `prompt_encoded` is the decoded text of the exact prompt token ids the rollout engine
got: with a chat template and a system prompt (the template test fixture of tests/tasks) and without."""

from __future__ import annotations

import numpy as np

from moe_gspo.rollout.base import RolloutSample
from moe_gspo.run.samples import sample_rows
from moe_gspo.tasks.base import Prompt
from moe_gspo.tasks.encoding import encode_prompts
from moe_gspo.tokenizer import load_tiny_tokenizer

CHAT = ("{% for m in messages %}{{ '<bos>' + m['role'][0] + ':' + m['content'] + '<eos>' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'a:' }}{% endif %}")


def _rows(tok, ids: list[int]) -> list[dict]:
    sample = RolloutSample(prompt_index=0, prompt_ids=np.asarray(ids, np.int64),
                           response_ids=np.asarray(tok("12", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]),
                           response_logprobs=np.zeros(3, np.float32), finish_reason="stop")
    return sample_rows(4, tok, [Prompt(text="12=", answer="12")], [sample], [1.0], np.asarray([0.5]),
                       rollout_routes=None, learner_routes=None, num_groups=1)


def test_prompt_encoded_is_the_decoded_template_ids():
    tok = load_tiny_tokenizer()
    tok.chat_template = CHAT
    (ids,) = encode_prompts(tok, ["12="], chat_template="tokenizer", system_prompt="be 1")
    (row,) = _rows(tok, ids)
    assert row["prompt"] == "12="
    assert row["prompt_encoded"] == tok.decode(ids, skip_special_tokens=False)
    bos, eos = tok.decode([tok.bos_token_id]), tok.decode([tok.eos_token_id])
    assert row["prompt_encoded"] == f"{bos}s:be 1{eos}{bos}u:12={eos}a:"


def test_prompt_encoded_without_a_template_is_the_text():
    tok = load_tiny_tokenizer()
    (ids,) = encode_prompts(tok, ["12="])
    (row,) = _rows(tok, ids)
    assert row["prompt_encoded"] == "12=" == tok.decode(ids, skip_special_tokens=False)
    assert list(row) == ["step", "prompt", "prompt_encoded", "answer", "response", "reward", "advantage",
                         "finish_reason", "response_tokens", "routing_flips"]
