"""Stages of the RL step that need no model: the text a reward judges, scoring."""

from types import SimpleNamespace

import numpy as np
import pytest

from moe_gspo.rollout.base import RolloutSample
from moe_gspo.run.steps import response_text, score
from moe_gspo.tasks import SyntheticTask
from moe_gspo.tokenizer import load_tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tiny_tokenizer()


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_response_text_drops_final_eos_only_and_keeps_special_tokens(tok):
    eos, pad, bos = tok.eos_token_id, tok.pad_token_id, tok.bos_token_id
    assert response_text(tok, _ids(tok, "0123") + [eos]) == "0123"
    assert response_text(tok, np.array(_ids(tok, "0123"))) == "0123"  # truncated at max_new_tokens
    text = response_text(tok, _ids(tok, "01") + [pad] + _ids(tok, "23") + [bos, eos])
    assert text != "0123" and text.startswith("01") and "23" in text


def test_score_does_not_reward_invisible_special_tokens(tok):
    """A right answer padded with <pad>/<bos> tokens is not an exact match (it was, when they were skipped)."""
    task = SyntheticTask("copy", prompt_len=4)
    prompt = task.prompts(0, 1, seed=0)[0]
    eos, pad = tok.eos_token_id, tok.pad_token_id
    responses = [_ids(tok, prompt.answer) + [eos], _ids(tok, prompt.answer) + [pad, pad, eos],
                 _ids(tok, prompt.answer[:2]) + [eos]]
    samples = [RolloutSample(prompt_index=0, prompt_ids=np.array(_ids(tok, prompt.text)), response_ids=np.array(r),
                             response_logprobs=np.zeros(len(r), np.float32), finish_reason="stop") for r in responses]
    rewards = score(SimpleNamespace(tokenizer=tok), task, [prompt], samples).tolist()
    assert rewards[0] == 1.0
    assert rewards[1] < 1.0
    assert rewards[2] == pytest.approx(2 / 5)  # 2 of 4 symbols right, wrong length: 2 / (4 + 1)
