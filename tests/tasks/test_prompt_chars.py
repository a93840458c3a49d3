"""Issue 43.7: a huge prompt is refused by its character count before any tokenization (a 20 MB JSONL
line was tokenized for 107 s at 8.1 GB before the length check)."""

from __future__ import annotations

import json
import time

import pytest

from moe_gspo.config import RolloutConfig
from moe_gspo.tasks import JsonlTask
from moe_gspo.tasks import lengths
from moe_gspo.tasks.lengths import check_prompt_lengths, max_token_chars
from moe_gspo.tiny import tiny_qwen3_moe_config
from moe_gspo.tokenizer import load_tiny_tokenizer


def test_a_huge_prompt_is_refused_without_tokenizing(tmp_path, monkeypatch):
    f = tmp_path / "data.jsonl"
    f.write_text(json.dumps({"prompt": "2+3=", "answer": "5"}) + "\n"
                 + json.dumps({"prompt": "1" * 20_000_000, "answer": "1"}) + "\n")
    tok = load_tiny_tokenizer()
    per_token = max_token_chars(tok)
    assert 1 <= per_token < 100

    def no_tokenizing(*a, **k):
        raise AssertionError("tokenized a prompt that cannot fit")

    monkeypatch.setattr(lengths, "encode_prompts", no_tokenizing)
    t0 = time.time()
    with pytest.raises(ValueError, match=rf"{f}:2: the prompt has 20000000 characters, which cannot fit the 2036 "
                                         rf"tokens .* shorten the prompt"):
        check_prompt_lengths(JsonlTask(str(f)).longest_prompts(), tok, tiny_qwen3_moe_config(max_position_embeddings=2048),
                             RolloutConfig(max_new_tokens=12))
    assert time.time() - t0 < 10


def test_whitespace_does_not_count_and_fitting_prompts_still_get_the_token_check(tmp_path):
    tok = load_tiny_tokenizer()
    from moe_gspo.tasks import Prompt

    limit = 100 * max_token_chars(tok)
    spaces = Prompt(text="1" + " " * (limit + 10), answer="1", where="x:1")
    with pytest.raises(ValueError, match=r"x:1: the prompt has \d+ tokens, more than the 100"):  # the token check
        check_prompt_lengths([spaces], tok, tiny_qwen3_moe_config(max_position_embeddings=112),
                             RolloutConfig(max_new_tokens=12))
