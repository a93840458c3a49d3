"""Prompt/answer JSONL files (GSM8K/MATH style) with a math answer checker.

Each line is a JSON object with a string `prompt` and an `answer` (string or number). Blank lines
are skipped. A malformed line raises one ValueError naming the file and line number. The stream
cycles through the file in an order shuffled per epoch by the seed.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from moe_gspo.files import not_a_file
from moe_gspo.tasks.base import Prompt, Task
from moe_gspo.tasks.math_answer import math_reward


def iter_text_lines(p: Path):
    """(line number, text) for each line of a UTF-8 file; a line that is not valid UTF-8 raises one
    ValueError naming the file, line and byte."""
    with p.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                yield lineno, raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{p}:{lineno}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                                 "save the file as UTF-8") from None


def iter_prompt_objects(p: Path):
    """(line number, object) for each non-blank line of a JSONL file; every object has a string
    `prompt`. A malformed line raises one ValueError naming the file and line."""
    for lineno, line in iter_text_lines(p):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}:{lineno}: not valid JSON ({e.msg}); each line must be one JSON object") from None
        except ValueError as e:  # Python's int-string limit (sys.get_int_max_str_digits(), 4300 digits by default)
            raise ValueError(f"{p}:{lineno}: a number too long to read ({e.args[0].split(';')[0]}); write it as a "
                             'JSON string, e.g. "answer": "123..."') from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
            raise ValueError(f"{p}:{lineno}: needs a string field 'prompt'")
        yield lineno, obj


def read_prompt_file(path: str | Path, *, field: str = "task.path") -> list[Prompt]:
    """The prompts of a JSONL prompt/answer file; errors name `field` (the config key that gave it)."""
    p = Path(path)
    if (what := not_a_file(p)) is not None:  # a FIFO is never opened: it would wait for a writer
        raise ValueError(f"{field}={str(p)!r} {what}; point it at a JSONL file of prompt/answer lines")
    items: list[Prompt] = []
    for lineno, obj in iter_prompt_objects(p):
        ans = obj.get("answer")
        if isinstance(ans, bool) or not isinstance(ans, (str, int, float)):
            raise ValueError(f"{p}:{lineno}: needs an 'answer' field (string or number)")
        items.append(Prompt(text=obj["prompt"], answer=str(ans), where=f"{p}:{lineno}"))
    if not items:
        raise ValueError(f"{field}={str(p)!r} holds no prompts (only blank lines, or nothing); write one JSON "
                         'object per line, e.g. {"prompt": "what is 2+3?", "answer": "5"}, or point it '
                         "at another file")
    return items


HOLDOUT_SEED = "moe_gspo.eval.holdout"
"""Seed of the held-out choice: the same prompts for every train.seed, so seeds share one eval set."""


class JsonlTask(Task):
    """The prompts of a JSONL file, scored by the math answer checker. `holdout` = N keeps N prompts (a
    fixed random choice) out of the training stream as the eval set (`eval.holdout`)."""

    def __init__(self, path: str | Path, *, holdout: int = 0):
        items = read_prompt_file(path)
        if holdout and holdout >= len(items):
            raise ValueError(f"eval.holdout={holdout} leaves no training prompts: task.path={str(path)!r} holds "
                             f"{len(items)}; hold out fewer (e.g. {max(1, len(items) // 10)})")
        order = list(range(len(items)))
        random.Random(HOLDOUT_SEED).shuffle(order)
        held = set(order[:holdout])
        self.held_out = [items[i] for i in sorted(held)]
        self.items = [x for i, x in enumerate(items) if i not in held]

    def eval_prompts(self, count: int | None) -> list[Prompt]:
        if not self.held_out:
            raise ValueError("task.name=jsonl has no held-out prompts: set eval.holdout=N or eval.path=FILE.jsonl")
        return self.held_out[:count]

    def prompts(self, start: int, count: int, seed: int) -> list[Prompt]:
        n = len(self.items)
        out = []
        for i in range(start, start + count):
            epoch, pos = divmod(i, n)
            order = list(range(n))
            random.Random(f"{seed}:{epoch}").shuffle(order)
            out.append(self.items[order[pos]])
        return out

    def reward(self, response: str, prompt: Prompt) -> float:
        return math_reward(response, prompt.answer)

    def longest_prompts(self) -> list[Prompt]:
        return list(self.items)
