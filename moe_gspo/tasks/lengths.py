"""Do the prompts fit the model's context? Checked when the data loads, before anything is written.

A prompt of P tokens is sampled with up to `rollout.max_new_tokens` = R response tokens, and the
learner then runs prompt and response as one sequence, so P + R must fit the context the run has: the
model's context, `model_context_len` (max_position_embeddings, RoPE-scaled as vLLM scales it), bounded
further by the engine's own rule (`moe_gspo.rollout.engine_spec.EngineSpec.context_limit`: vLLM's
`rollout.max_model_len`). Neither transformers' generate nor the Megatron learner refuses a longer
sequence: RoPE simply runs past the positions the model was trained for (and padding to the long prompt
slows every step); vLLM cuts the response short, so its engine refuses P + R > max_model_len. The same
bound therefore holds for every engine.

The error names the first prompt that does not fit (`file:line` for a JSONL task), its token count,
the limit and the knobs, and how many more prompts are too long.
"""

from __future__ import annotations

from typing import Sequence

from moe_gspo.rollout.engine_spec import ContextLimit, engine_spec
from moe_gspo.tasks.base import Prompt
from moe_gspo.tasks.encoding import encode_prompts

# vLLM leaves max_position_embeddings as it is for these RoPE types (already scaled in the config)
# and multiplies it by `factor` for the others (`_get_and_verify_max_len`).
_UNSCALED_ROPE_TYPES = ("default", "su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")


def model_context_len(hf_config) -> tuple[int, str]:
    """(tokens, how it is derived) of the model's context: max_position_embeddings, times the RoPE
    scaling factor for the RoPE types whose config gives the unscaled length (vLLM's rule)."""
    n = int(hf_config.max_position_embeddings)
    what = f"the model's max_position_embeddings={n}"
    rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    if isinstance(rope, dict):
        kind, factor = rope.get("rope_type", rope.get("type")), rope.get("factor")
        if kind not in _UNSCALED_ROPE_TYPES and factor:
            n = int(n * factor)
            what = f"{what} x RoPE {kind} factor {factor}"
    return n, what


def engine_context(hf_config, rollout) -> ContextLimit:
    """The longest prompt + response, what sets it and the knob that raises it, for the engine of
    `rollout` (a `moe_gspo.config.RolloutConfig`) on the model of `hf_config`: the engine's rule
    (`EngineSpec.context_limit`) on the model's context; ValueError for a limit the engine refuses."""
    model_len, what = model_context_len(hf_config)
    return engine_spec(rollout.engine).context_limit(rollout, model_len, what)


def context_limit(hf_config, rollout) -> tuple[int, str]:
    """(longest prompt + response in tokens, what sets it) for the engine of `rollout` (`engine_context`)."""
    limit = engine_context(hf_config, rollout)
    return limit.tokens, limit.what


_WHITESPACE = " \t\n\r\f\v"
MAX_CHARS_FACTOR = 2
"""A prompt may hold at most this many times the characters its tokens can stand for, whitespace the tokenizer
drops included (`check_prompt_chars`): dropped whitespace is still read, tokenized and written to samples.jsonl
(issue 59: 60 M newlines, which the shipped tokenizer drops, took ~150 s and wrote 120 MB sample rows)."""


def max_token_chars(tokenizer) -> int:
    """The most characters one token of `tokenizer` can stand for: the longest vocabulary entry (for a
    byte-level BPE the entries are one character per byte, so this bounds the decoded text too)."""
    cached = getattr(tokenizer, "_moe_gspo_max_token_chars", None)
    if cached is None:
        try:
            cached = max((len(t) for t in tokenizer.get_vocab()), default=1)
        except Exception:  # noqa: BLE001 - a tokenizer without a vocabulary to list: no bound
            cached = 0
        try:
            tokenizer._moe_gspo_max_token_chars = cached
        except Exception:  # noqa: BLE001
            pass
    return cached


def kept_whitespace(tokenizer) -> str:
    """The whitespace characters `tokenizer` keeps as text (each stands for part of a token, so a run of them
    costs tokens): measured once per tokenizer on a run of each character between two letters. A tokenizer
    whose normalizer drops or collapses a whitespace character (SentencePiece's "remove extra whitespaces")
    turns a run of it into at most a token or two, so that character is not counted (issue 49: a line of 20 M
    spaces was tokenized for 2 min 50 s before its length was refused)."""
    cached = getattr(tokenizer, "_moe_gspo_kept_whitespace", None)
    if cached is None:
        run = 8 * max(1, max_token_chars(tokenizer))  # kept: at least 8 tokens; dropped or collapsed: one or two
        cached = ""
        for c in _WHITESPACE:
            try:
                extra = (len(tokenizer(f"a{c * run}a", add_special_tokens=False)["input_ids"])
                         - len(tokenizer("aa", add_special_tokens=False)["input_ids"]))
            except Exception:  # noqa: BLE001 - a tokenizer that cannot encode it: count it (a floor either way)
                extra = run
            if extra >= 8:
                cached += c
        try:
            tokenizer._moe_gspo_kept_whitespace = cached
        except Exception:  # noqa: BLE001
            pass
    return cached


def check_prompt_chars(prompts: Sequence[Prompt], tokenizer, longest: int, *, context: str) -> None:
    """Refuse, without tokenizing, a prompt that cannot fit `longest` tokens whatever its tokenization:
    one token stands for at most `max_token_chars(tokenizer)` characters, so a prompt with more
    countable characters than `longest` times that needs more tokens. Whitespace counts where the tokenizer
    keeps it (`kept_whitespace`), not where its normalizer drops it; every character counts past
    `MAX_CHARS_FACTOR` times the bound. Tokenizing a 20 MB line first took minutes and gigabytes."""
    per_token = max_token_chars(tokenizer)
    if per_token <= 0:
        return
    limit = longest * per_token
    for i, p in enumerate(prompts):
        if len(p.text) <= limit:
            continue
        dropped = [c for c in _WHITESPACE if c not in kept_whitespace(tokenizer)]
        chars = len(p.text) - sum(p.text.count(c) for c in dropped)
        where = p.where or f"prompt {i}"
        if chars > limit:
            skipped = " (not counting the whitespace this tokenizer drops)" if dropped else ""
            raise ValueError(f"{where}: the prompt has {len(p.text)} characters, which cannot fit the {longest} tokens of "
                             f"{context}: this tokenizer's tokens are at most {per_token} characters long, so a prompt "
                             f"needs at most {limit} characters{skipped}; shorten the prompt")
        if len(p.text) > MAX_CHARS_FACTOR * limit:
            raise ValueError(f"{where}: the prompt has {len(p.text)} characters, more than "
                             f"{MAX_CHARS_FACTOR * limit} ({MAX_CHARS_FACTOR} x the {limit} characters that the "
                             f"{longest} tokens of {context} can stand for), counting whitespace: even whitespace the "
                             "tokenizer drops is read, tokenized and written to samples.jsonl; shorten the prompt")


def check_prompt_lengths(prompts: Sequence[Prompt], tokenizer, hf_config, rollout, *,
                         max_new_tokens_flag: str = "rollout.max_new_tokens", chat_template: str = "none",
                         system_prompt: str | None = None) -> int:
    """Raise one ValueError when a prompt plus `rollout.max_new_tokens` does not fit the context
    (`context_limit`); returns the longest prompt's token count. Prompts are tokenized as the
    rollout does (`moe_gspo.tasks.encoding.encode_prompts`)."""
    if not prompts:
        return 0
    context = engine_context(hf_config, rollout)
    limit, what = context.tokens, context.what
    room = rollout.max_new_tokens
    longest = limit - room
    if longest < 1:
        raise ValueError(f"{max_new_tokens_flag}={room} leaves no room for a prompt in the {rollout.engine} engine's "
                         f"context of {limit} tokens ({what}); lower {max_new_tokens_flag}")
    check_prompt_chars(prompts, tokenizer, longest, context=f"the {rollout.engine} engine's context ({what}, minus "
                       f"{max_new_tokens_flag}={room} for the response)")
    ids = encode_prompts(tokenizer, [p.text for p in prompts], chat_template=chat_template, system_prompt=system_prompt)
    counts = [len(x) for x in ids]
    if 0 in counts:  # the engines refuse a prompt of no token (issue 49: after the run directory was written)
        empty = [i for i, n in enumerate(counts) if n == 0]
        shown = ", ".join(prompts[i].where or f"prompt {i}" for i in empty[:3]) + (", ..." if len(empty) > 3 else "")
        raise ValueError(f"{shown}: {len(empty)} prompt(s) encode to no token at all (an empty prompt): the rollout "
                         "engine needs at least one token to start from; remove those lines or give them a prompt "
                         "(task.chat_template=tokenizer adds the template's tokens)")
    bad = [i for i, n in enumerate(counts) if n > longest]
    if not bad:
        return max(counts)
    first = prompts[bad[0]]
    where = first.where or f"prompt {bad[0]}"
    knobs = [f"lower {max_new_tokens_flag} (now {room})"] + ([context.knob] if context.knob else [])
    more = ""
    if len(bad) > 1:
        shown = ", ".join(prompts[i].where or str(i) for i in bad[1:6])
        more = f"; {len(bad) - 1} more prompt{'s' if len(bad) > 2 else ''} too long ({shown}{', ...' if len(bad) > 6 else ''})"
    raise ValueError(
        f"{where}: the prompt has {counts[bad[0]]} tokens, more than the {longest} that fit the {rollout.engine} "
        f"engine's context ({what}, minus {max_new_tokens_flag}={room} for the response); shorten the prompt "
        f"or {' or '.join(knobs)}{more}")
