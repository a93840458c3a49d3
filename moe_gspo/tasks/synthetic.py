"""Synthetic tasks with verifiable rewards that a tiny model learns on a CPU in minutes.

A prompt is a string of symbols from the first `num_symbols` characters of `0-9a-z` (its length fixed
at `prompt_len`, or drawn uniformly from `[prompt_len, prompt_len_max]`), then a task marker; the
answer is a deterministic function of the symbols:

- `copy`: the symbols (`"3715="` -> `"3715"`);
- `reverse`: the symbols reversed (`"3715?"` -> `"5173"`);
- `sort`: the symbols in ascending order (`"3715;"` -> `"1357"`);
- `copy_first`: the first symbol (`"3715:"` -> `"3"`); one-token answers, the old default;
- `add`: the sum of two numbers of `prompt_len // 2` digits (`"12+34="` -> `"46"`), digits only.

`pad_prompts` (copy, reverse) writes the symbols into a fixed-width field of `prompt_len_max + 1`
characters filled with `.`, after the symbols for `copy` (`"3715..="`) and before them for `reverse`
(`"..3715?"`). Every answer position then sits at a fixed distance from the prompt symbol it
depends on, and the end of the answer at the same distance from the first `.`, whatever the
length: a tiny transformer finds these from RoPE alone. Without padding the distance depends on the
prompt length and learning is much slower.

Rewards are 1.0 for an exact match (the response text, EOS removed, special tokens kept, equals the
answer) and partial credit otherwise, so that learning has a gradient from the start:
- `sequence_credit` (copy, reverse, sort): 0 for a response longer than any answer of the task (it
  did not stop: truncated at max_new_tokens, or ran on), else `partial_credit` x (answer positions
  right, plus one when the response has the answer's length) / (the longer length + 1). Stopping at
  the right length is worth one symbol; trailing or missing symbols cost credit. Without the zero
  for unfinished responses a policy learns the symbols long before it learns to stop, and its groups
  collapse (all samples alike, zero advantage) with EOS never sampled again: measured, see
  `configs/tiny_cpu.yaml`.
- `positional_credit` (copy_first, add; the historic reward): `partial_credit` x (answer positions
  right) / (the longer length), on the whitespace-stripped response.
`partial_credit` defaults to 1.0 for the first group and 0.5 for the second.

The prompt stream is a pure function of (task name, seed, index): a resumed run sees exactly the
prompts it would have seen. At a fixed prompt length the streams of `copy_first` and `add` are those
of earlier versions, and `reverse` draws the same symbols (its marker was `<`, which the shipped
tokenizer does not know).
"""

from __future__ import annotations

import random

from moe_gspo.tasks.base import Prompt, Task

ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz"
SYNTHETIC_TASKS = ("copy", "reverse", "sort", "copy_first", "add")
SEQUENCE_TASKS = ("copy", "reverse", "sort")
"""Tasks whose answer is a string of prompt symbols, scored with `sequence_credit`."""
PADDED_TASKS = ("copy", "reverse")
MARKERS = {"copy": "=", "reverse": "?", "sort": ";", "copy_first": ":"}
PAD_TEXT = "."
"""`pad_prompts` filler character."""


def positional_credit(response: str, answer: str, partial: float = 0.5) -> float:
    """1.0 for an exact match (surrounding whitespace ignored), else `partial` x the fraction of
    positions matched, out of the longer of response and answer."""
    response = response.strip()
    if response == answer:
        return 1.0
    if not answer:
        return 0.0
    hits = sum(1 for a, b in zip(response, answer) if a == b)
    return partial * hits / max(len(answer), len(response))


def sequence_credit(response: str, answer: str, partial: float = 1.0, max_len: int | None = None) -> float:
    """1.0 for an exact match; 0.0 for a response longer than `max_len` (it ran past any answer the
    task asks for: truncated, it never stopped); else `partial` x (positions matched + 1 if the
    lengths are equal) / (the longer length + 1)."""
    if response == answer:
        return 1.0
    if max_len is not None and len(response) > max_len:
        return 0.0
    hits = sum(1 for a, b in zip(response, answer) if a == b) + (len(response) == len(answer))
    return partial * hits / (max(len(answer), len(response)) + 1)


def default_partial_credit(name: str) -> float:
    return 1.0 if name in SEQUENCE_TASKS else 0.5


def max_answer_len(name: str, prompt_len: int, prompt_len_max: int | None = None) -> int:
    """Length of the longest answer a synthetic task can ask for."""
    n = max(prompt_len, prompt_len_max or prompt_len)
    if name == "copy_first":
        return 1
    if name == "add":
        return max(1, n // 2) + 1
    return n


def check_synthetic_config(task_cfg, *, max_new_tokens: int) -> None:
    """Range and combination checks of a `TaskConfig` naming a synthetic task (ValueError naming the field)."""
    t = task_cfg
    if t.prompt_len_max is not None and t.prompt_len_max < t.prompt_len:
        raise ValueError(f"task.prompt_len_max={t.prompt_len_max} must be >= task.prompt_len={t.prompt_len} "
                         "(or null for a fixed prompt length)")
    if t.partial_credit is not None and not 0.0 <= t.partial_credit <= 1.0:
        raise ValueError(f"task.partial_credit={t.partial_credit} must be in [0, 1] (an exact match scores 1.0)")
    if t.pad_prompts and t.name not in PADDED_TASKS:
        raise ValueError(f"task.pad_prompts=true applies to {' and '.join(PADDED_TASKS)}, not task.name={t.name}; "
                         "set task.pad_prompts=false")
    if t.name == "add" and t.num_symbols > 10:
        raise ValueError(f"task.name=add uses digits only: set task.num_symbols <= 10 (got {t.num_symbols})")
    longest = max_answer_len(t.name, t.prompt_len, t.prompt_len_max)
    if max_new_tokens < longest:
        raise ValueError(f"rollout.max_new_tokens={max_new_tokens} is shorter than the longest answer of "
                         f"task.name={t.name} ({longest} tokens), which could then never be right; set "
                         f"rollout.max_new_tokens >= {longest + 1} (the answer and EOS)")


class SyntheticTask(Task):
    def __init__(self, name: str, *, prompt_len: int = 4, num_symbols: int = 10, prompt_len_max: int | None = None,
                 pad_prompts: bool = False, partial_credit: float | None = None):
        if name not in SYNTHETIC_TASKS:
            raise ValueError(f"task.name={name!r}: synthetic tasks are {', '.join(SYNTHETIC_TASKS)}")
        if name == "add" and num_symbols > 10:
            raise ValueError("task.name=add uses digits only: set task.num_symbols <= 10")
        if prompt_len < 1 or (prompt_len_max is not None and prompt_len_max < prompt_len):
            raise ValueError(f"task.prompt_len={prompt_len}, task.prompt_len_max={prompt_len_max}: "
                             "need 1 <= prompt_len <= prompt_len_max")
        if pad_prompts and name not in PADDED_TASKS:
            raise ValueError(f"task.pad_prompts=true applies to {' and '.join(PADDED_TASKS)}, not {name}")
        self.name, self.symbols = name, ALPHABET[:num_symbols]
        self.prompt_len, self.prompt_len_max = prompt_len, prompt_len_max or prompt_len
        self.pad_prompts = pad_prompts
        self.partial_credit = default_partial_credit(name) if partial_credit is None else partial_credit

    def _length(self, rng: random.Random) -> int:
        if self.prompt_len_max == self.prompt_len:  # no draw: fixed-length streams stay as they were
            return self.prompt_len
        return rng.randint(self.prompt_len, self.prompt_len_max)

    def _one(self, rng: random.Random) -> Prompt:
        n = self._length(rng)
        s = "".join(rng.choice(self.symbols) for _ in range(n))  # drawn for every task (stream compatibility)
        if self.name == "add":
            half = max(1, n // 2)
            a = int("".join(rng.choice(self.symbols) for _ in range(half)))
            b = int("".join(rng.choice(self.symbols) for _ in range(half)))
            return Prompt(text=f"{a}+{b}=", answer=str(a + b))
        pad = PAD_TEXT * (self.prompt_len_max - n + 1) if self.pad_prompts else ""
        marker = MARKERS[self.name]
        if self.name == "copy":
            return Prompt(text=s + pad + marker, answer=s)
        if self.name == "reverse":
            return Prompt(text=pad + s + marker, answer=s[::-1])
        if self.name == "sort":
            return Prompt(text=s + marker, answer="".join(sorted(s)))
        return Prompt(text=s + marker, answer=s[0])

    def prompts(self, start: int, count: int, seed: int) -> list[Prompt]:
        return [self._one(random.Random(f"{self.name}:{seed}:{i}")) for i in range(start, start + count)]

    def eval_prompts(self, count: int | None) -> list[Prompt]:
        """`count` (None = 64) prompts of the task's own eval stream, seeded apart from every train.seed
        (generated, so not disjoint from training's prompts when the task has few distinct ones)."""
        return [self._one(random.Random(f"{self.name}:eval:{i}")) for i in range(64 if count is None else count)]

    def longest_prompts(self) -> list[Prompt]:
        """One prompt of the most symbols the task draws (every prompt of a task has the same
        characters up to the symbols drawn, and a padded one the same length whatever it draws)."""
        top = self.symbols[-1]
        n = self.prompt_len_max
        knob = "task.prompt_len_max" if n != self.prompt_len else "task.prompt_len"
        if self.name == "add":
            half = max(1, n // 2)
            text = f"{top * half}+{top * half}="
        else:
            pad = PAD_TEXT * (self.prompt_len_max - n + 1) if self.pad_prompts else ""
            text = (pad + top * n if self.name == "reverse" else top * n + pad) + MARKERS[self.name]
        return [Prompt(text=text, answer="", where=f"task.name={self.name} with {knob}={n}")]

    def reward(self, response: str, prompt: Prompt) -> float:
        if self.name in SEQUENCE_TASKS:
            return sequence_credit(response, prompt.answer, self.partial_credit, max_len=self.prompt_len_max)
        return positional_credit(response, prompt.answer, self.partial_credit)
