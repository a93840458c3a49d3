"""Prompt text -> token ids, the one place every side of a run (rollout, eval, start-up length checks)
encodes prompts: raw (`task.chat_template=none`) or through the tokenizer's own chat template
(`tokenizer`: one user message, optionally after `task.system_prompt`, then the generation prompt, as
TRL and verl build chat prompts for Qwen3 checkpoints).

`unknown_token_report` finds prompts that map characters to the tokenizer's unknown token: the shipped
character-level tokenizer knows only `0-9a-z+-*=:;,.?!` and space, so "What is 2+3?" would train with
`W` as `<unk>`.
"""

from __future__ import annotations

from typing import Sequence

from moe_gspo.tasks.base import Prompt


def check_chat_template(tokenizer, chat_template: str, *, tokenizer_name: str) -> None:
    """One ValueError when `task.chat_template=tokenizer` but the tokenizer has no template."""
    if chat_template == "tokenizer" and not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"task.chat_template=tokenizer, but the tokenizer {tokenizer_name} has no chat template "
                         "(tokenizer_config.json / chat_template.jinja); set task.chat_template=none, or "
                         "model.tokenizer=DIR with a tokenizer that has one")


def encode_prompts(tokenizer, texts: Sequence[str], *, chat_template: str = "none",
                   system_prompt: str | None = None) -> list[list[int]]:
    """Token ids of each prompt text (no special tokens added outside the template)."""
    if chat_template == "none":
        return [list(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in texts]
    assert chat_template == "tokenizer", chat_template
    system = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
    out = []
    for text in texts:
        ids = tokenizer.apply_chat_template(system + [{"role": "user", "content": text}], tokenize=True,
                                            add_generation_prompt=True, return_dict=False)
        out.append([int(i) for i in ids])
    return out


def empty_prompt_report(prompts: Sequence[Prompt], *, max_listed: int = 3) -> str | None:
    """A warning text naming the prompts that are empty or whitespace only (`file:line`), or None. Such a
    prompt trains (the model answers nothing in particular), so it is a warning, not an error."""
    bad = [p for p in prompts if not p.text.strip()]
    if not bad:
        return None
    listed = ", ".join(p.where or repr(p.text) for p in bad[:max_listed])
    more = f" and {len(bad) - max_listed} more" if len(bad) > max_listed else ""
    return (f"{len(bad)} prompt(s) are empty or whitespace only: {listed}{more}; the model is trained to answer them "
            "from nothing. Remove those lines or give them a prompt")


def unknown_chars(tokenizer, text: str, unk: int) -> list[str]:
    """The distinct characters of `text` the tokenizer's vocabulary maps to `unk`, sorted: one tokenizer call over
    the text's distinct characters (a call per character took ~150 s on a prompt of 60 M newlines, issue 59)."""
    distinct = sorted(set(text) - {""})
    ids = tokenizer.convert_tokens_to_ids(distinct) if distinct else []
    return [c for c, i in zip(distinct, ids) if i == unk]


def unknown_token_report(tokenizer, prompts: Sequence[Prompt], ids: Sequence[Sequence[int]], *,
                         max_listed: int = 3) -> str | None:
    """A warning text naming where prompts tokenize to the unknown token and which characters, or None."""
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None:
        return None
    bad = [(p, x) for p, x in zip(prompts, ids) if unk in x]
    if not bad:
        return None
    listed = []
    for i, (p, _) in enumerate(bad[:max_listed]):
        chars = unknown_chars(tokenizer, p.text, unk)
        what = f"characters {''.join(chars)!r}" if chars else "some text"
        listed.append(f"{p.where or f'prompt {i}'} ({what})")
    more = f" and {len(bad) - max_listed} more" if len(bad) > max_listed else ""
    name = getattr(tokenizer, "unk_token", "<unk>")
    return (f"{len(bad)} prompt(s) contain text the tokenizer maps to {name}: {'; '.join(listed)}{more}. The model "
            f"sees {name} there; rewrite the prompts (the shipped tiny tokenizer knows 0-9a-z+-*=:;,.?! and space) "
            "or use a tokenizer that knows them (model.tokenizer)")
