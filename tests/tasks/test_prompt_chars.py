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


class _DroppingTokenizer:
    """A character tokenizer whose normalizer drops whitespace (as some SentencePiece ones collapse it)."""

    def __init__(self):
        self.inner = load_tiny_tokenizer()

    def get_vocab(self):
        return self.inner.get_vocab()

    def __call__(self, text, add_special_tokens=False):
        return self.inner("".join(text.split()), add_special_tokens=add_special_tokens)


def test_whitespace_counts_where_the_tokenizer_keeps_it(tmp_path):
    """Issue 49: a line of 20 M spaces plus `1+1=` was tokenized for 2 min 50 s: the shipped tokenizer keeps
    spaces (one token each), so they count; a tokenizer that drops them still gets the token check."""
    from moe_gspo.tasks import Prompt
    from moe_gspo.tasks.lengths import kept_whitespace

    tok = load_tiny_tokenizer()
    assert " " in kept_whitespace(tok) and "\n" not in kept_whitespace(tok)  # a space is a token; newlines go
    model, rollout = tiny_qwen3_moe_config(max_position_embeddings=112), RolloutConfig(max_new_tokens=12)
    limit = 100 * max_token_chars(tok)
    spaces = Prompt(text="1" + " " * (limit + 10), answer="1", where="x:1")
    with pytest.raises(ValueError, match=rf"x:1: the prompt has {limit + 11} characters, which cannot fit the 100 "
                                         rf"tokens .* needs at most {limit} characters \(not counting the whitespace "
                                         r"this tokenizer drops\); shorten the prompt"):
        check_prompt_lengths([spaces], tok, model, rollout)
    huge = Prompt(text=" " * 20_000_000 + "1+1=", answer="2", where="y:1")
    t0 = time.time()
    with pytest.raises(ValueError, match="y:1: the prompt has 20000004 characters"):
        check_prompt_lengths([huge], tok, model, rollout)
    assert time.time() - t0 < 10
    dropping = _DroppingTokenizer()
    assert kept_whitespace(dropping) == ""
    fits = Prompt(text="1" + " " * (limit + 10) + "2", answer="1", where="z:1")
    assert check_prompt_lengths([fits], dropping, model, rollout) == 2  # the token check, after the char check
