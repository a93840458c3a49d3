"""Tasks: prompts with verifiable rewards.

A task yields `Prompt`s (text plus the reference answer) deterministically from a seed and a
position, so a resumed run continues with exactly the prompts it would have seen. The reward of a
response is computed by the task from the decoded response text.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field


@dataclass(kw_only=True, frozen=True)
class Prompt:
    text: str
    """Prompt text fed to the tokenizer."""
    answer: str
    """Reference answer used by the reward function."""
    where: str = field(default="", compare=False)
    """Where the prompt comes from, for error messages (`file:line` for a JSONL task); "" if generated."""


class Task(abc.ABC):
    """A source of prompts with a verifiable reward."""

    @abc.abstractmethod
    def prompts(self, start: int, count: int, seed: int) -> list[Prompt]:
        """Prompts number `start ... start+count-1` of the stream defined by `seed`."""

    @abc.abstractmethod
    def reward(self, response: str, prompt: Prompt) -> float:
        """Reward in [0, 1] of a decoded response (EOS and padding already stripped)."""

    @abc.abstractmethod
    def longest_prompts(self) -> list[Prompt]:
        """Prompts at least as long as any the task can yield, for the start-up length check
        (`moe_gspo.tasks.lengths`): every prompt of a file, or the longest a generator can make."""

    def eval_prompts(self, count: int | None) -> list[Prompt]:
        """The task's held-out evaluation prompts (the first `count`; None = all or the task's default)."""
        raise ValueError(f"{type(self).__name__} has no held-out prompts to evaluate on; set eval.path=FILE.jsonl")
