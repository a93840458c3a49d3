"""Synthetic tasks with verifiable rewards that a tiny model learns on a CPU in minutes.

Prompts are strings of `prompt_len` symbols from the first `num_symbols` characters of `0-9a-z`,
followed by an instruction marker; the answer is a deterministic function of the symbols:
- `copy_first`: the first symbol (`"3715:"` → `"3"`); the easiest, learned from random init;
- `reverse`: the symbols reversed (`"3715<"` → `"5173"`);
- `add`: the sum of two numbers written with digits (`"12+34="` → `"46"`), digits only.
Rewards give partial credit so that learning has a gradient from the start: the fraction of answer
characters right at the right position, with full credit only for an exact match.
The prompt stream is a pure function of (seed, index): resuming a run reproduces it.
"""

from __future__ import annotations

import random

from moe_gspo.tasks.base import Prompt, Task

ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz"


def positional_credit(response: str, answer: str) -> float:
    """1.0 for an exact match, else the fraction of answer positions matched (at most 0.5)."""
    response = response.strip()
    if response == answer:
        return 1.0
    if not answer:
        return 0.0
    hits = sum(1 for a, b in zip(response, answer) if a == b)
    return 0.5 * hits / max(len(answer), len(response))


class SyntheticTask(Task):
    def __init__(self, name: str, *, prompt_len: int = 4, num_symbols: int = 10):
        if name not in ("copy_first", "reverse", "add"):
            raise ValueError(f"task.name={name!r}: synthetic tasks are copy_first, reverse, add")
        if name == "add" and num_symbols > 10:
            raise ValueError("task.name=add uses digits only: set task.num_symbols <= 10")
        self.name, self.prompt_len, self.symbols = name, prompt_len, ALPHABET[:num_symbols]

    def _one(self, rng: random.Random) -> Prompt:
        s = "".join(rng.choice(self.symbols) for _ in range(self.prompt_len))
        if self.name == "copy_first":
            return Prompt(text=s + ":", answer=s[0])
        if self.name == "reverse":
            return Prompt(text=s + "<", answer=s[::-1])
        half = max(1, self.prompt_len // 2)
        a = int("".join(rng.choice(self.symbols) for _ in range(half)))
        b = int("".join(rng.choice(self.symbols) for _ in range(half)))
        return Prompt(text=f"{a}+{b}=", answer=str(a + b))

    def prompts(self, start: int, count: int, seed: int) -> list[Prompt]:
        return [self._one(random.Random(f"{self.name}:{seed}:{i}")) for i in range(start, start + count)]

    def reward(self, response: str, prompt: Prompt) -> float:
        return positional_credit(response, prompt.answer)
