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


def test_dropped_whitespace_counts_past_twice_the_bound_before_tokenizing(monkeypatch):
    """Issue 59: a prompt of 60 M newlines (which the shipped tokenizer drops, so the character check skipped them)
    was tokenized, checked for unknown characters for ~150 s, trained on and written into 120 MB sample rows."""
    from moe_gspo.tasks import Prompt
    from moe_gspo.tasks.lengths import MAX_CHARS_FACTOR

    tok = load_tiny_tokenizer()
    model, rollout = tiny_qwen3_moe_config(max_position_embeddings=112), RolloutConfig(max_new_tokens=12)
    limit = 100 * max_token_chars(tok)
    newlines = Prompt(text="\n" * 60_000_000 + "1+1=", answer="2", where="n:1")

    def no_tokenizing(*a, **k):
        raise AssertionError("tokenized a prompt that cannot fit")

    with monkeypatch.context() as m:
        m.setattr(lengths, "encode_prompts", no_tokenizing)
        t0 = time.time()
        with pytest.raises(ValueError, match=rf"^n:1: the prompt has 60000004 characters, more than "
                                             rf"{MAX_CHARS_FACTOR * limit} \({MAX_CHARS_FACTOR} x the {limit} "
                                             r"characters that the 100 tokens of .* counting whitespace: even "
                                             r"whitespace the tokenizer drops is read, tokenized and written to samples.jsonl; "
                                             r"shorten the prompt$"):
            check_prompt_lengths([newlines], tok, model, rollout)
        assert time.time() - t0 < 10
    # up to the bound, dropped newlines still go on to the token check (a prompt with some blank lines is fine)
    at_bound = Prompt(text="1+1=" + "\n" * (MAX_CHARS_FACTOR * limit - 4), answer="2")
    assert 4 <= check_prompt_lengths([at_bound], tok, model, rollout) < 100
    with pytest.raises(ValueError, match=r"^prompt 0: the prompt has \d+ characters, more than"):
        check_prompt_lengths([Prompt(text="1+1=" + "\n" * (MAX_CHARS_FACTOR * limit - 3), answer="2")], tok, model,
                             rollout)


class _CountingTokenizer:
    """The shipped tokenizer, counting its `convert_tokens_to_ids` calls."""

    def __init__(self):
        self.inner, self.calls = load_tiny_tokenizer(), 0
        self.unk_token_id, self.unk_token = self.inner.unk_token_id, self.inner.unk_token

    def convert_tokens_to_ids(self, tokens):
        self.calls += 1
        return self.inner.convert_tokens_to_ids(tokens)


def test_the_unknown_character_report_asks_the_tokenizer_once_per_prompt():
    """Issue 59: `unknown_token_report` made one tokenizer call per character (~150 s on 60 M characters)."""
    from moe_gspo.tasks import Prompt
    from moe_gspo.tasks.encoding import encode_prompts, unknown_token_report

    tok = _CountingTokenizer()
    texts = ["What is 2+3?\n" * 100_000, "Ünï 1+1", "2+2=", "\tX"]
    prompts = [Prompt(text=t, answer="5", where=f"q.jsonl:{i + 1}") for i, t in enumerate(texts)]
    ids = encode_prompts(tok.inner, texts)
    t0 = time.time()
    report = unknown_token_report(tok, prompts, ids)
    assert time.time() - t0 < 5
    assert tok.calls == 3  # the three prompts with an unknown character, one call each
    per_char = [sorted({c for c in t if tok.inner.convert_tokens_to_ids(c) == tok.unk_token_id}) for t in texts]
    assert per_char[0] == ["\n", "W"] and per_char[2] == []
    assert report.startswith(f"3 prompt(s) contain text the tokenizer maps to <unk>: q.jsonl:1 (characters "
                             f"{''.join(per_char[0])!r}); q.jsonl:2 (characters {''.join(per_char[1])!r}); q.jsonl:4 "
                             f"(characters {''.join(per_char[3])!r})"), report
