"""A reward function of your own (`task.reward`), in place of the task's built-in one.

`task.reward: package.module:function` (importable from the working directory or the environment) or
`task.reward: path/to/file.py:function` (a file, loaded by path). The function is called once per
response, on every rank, as

    function(prompt=str, response=str, answer=str) -> float

- `prompt`: the prompt text as the task wrote it (before any chat template);
- `response`: the decoded response, final EOS removed, special tokens kept (`moe_gspo.run.steps.response_text`);
- `answer`: the task's reference answer (a JSONL line's `answer`, as a string);
- returns a finite number (an int or a bool counts); group-relative advantages only need rewards to be
  comparable within a prompt's group, so any scale works, but `eval/accuracy` and `eval/pass_at_k`
  count a response as correct when its reward is >= 1.

Errors are one ValueError naming `task.reward`: the module or file cannot be imported, the name is not
a callable, it raises (the message names the exception and the line of your file), or it returns a
non-number / NaN / inf (the message names the prompt).
"""

from __future__ import annotations

import math
import signal
import threading
import time
from typing import Callable

from moe_gspo.plugins import import_plugin_module, user_frame
from moe_gspo.tasks.base import Prompt, Task

RewardFn = Callable[..., float]


def load_reward_function(spec: str) -> RewardFn:
    """The callable `spec` (`module:function` or `file.py:function`) names; ValueError otherwise."""
    where, _, name = spec.partition(":")
    module = import_plugin_module(spec, field="task.reward", prefix="moe_gspo_reward", attr_form="function")
    fn = getattr(module, name, None)
    if fn is None:
        public = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise ValueError(f"task.reward={spec!r}: {where!r} has no {name!r}; its functions: {', '.join(public) or 'none'}")
    if not callable(fn):
        raise ValueError(f"task.reward={spec!r}: {name!r} is a {type(fn).__name__}, not a function")
    return fn


class _RewardTimeout(BaseException):
    """Raised by the SIGALRM handler inside a reward call (a BaseException: the user's `except
    Exception` does not swallow it)."""


def _call_with_timeout(fn: RewardFn, kwargs: dict, timeout_s: float | None):
    """fn(**kwargs), raising `_RewardTimeout` once it has run `timeout_s` seconds. In the main thread a
    SIGALRM interval timer interrupts the call (the previous handler and timer are restored after);
    elsewhere the call runs in a daemon thread that is abandoned on timeout."""
    if timeout_s is None:
        return fn(**kwargs)
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
        def on_alarm(signum, frame):
            raise _RewardTimeout

        old_handler = signal.signal(signal.SIGALRM, on_alarm)
        old_delay, _ = signal.setitimer(signal.ITIMER_REAL, timeout_s)
        started = time.monotonic()
        try:
            return fn(**kwargs)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old_handler)
            if old_delay:  # someone else's timer was running: give it back what is left of it
                signal.setitimer(signal.ITIMER_REAL, max(1e-3, old_delay - (time.monotonic() - started)))
    box: dict = {}

    def run():
        try:
            box["value"] = fn(**kwargs)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = e

    t = threading.Thread(target=run, name="task.reward", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise _RewardTimeout
    if "error" in box:
        raise box["error"]
    return box["value"]


def call_reward(fn: RewardFn, spec: str, *, prompt: Prompt, response: str, timeout_s: float | None = None) -> float:
    """`fn`'s reward of one response, checked to be a finite number; a call longer than `timeout_s`
    (`task.reward_timeout_s`) is a ValueError naming the prompt."""
    try:
        value = _call_with_timeout(fn, {"prompt": prompt.text, "response": response, "answer": prompt.answer},
                                   timeout_s)
    except _RewardTimeout:
        where = prompt.where or repr(prompt.text[:60])
        raise ValueError(f"task.reward={spec!r} did not return within task.reward_timeout_s={timeout_s:g} s on the "
                         f"prompt {where}; fix the function (or raise task.reward_timeout_s, null = no limit)") from None
    except Exception as e:  # noqa: BLE001 - the user's function
        where = prompt.where or repr(prompt.text[:60])
        raise ValueError(f"task.reward={spec!r} raised {type(e).__name__}: {e}{user_frame(e)} on the prompt "
                         f"{where}") from None
    if isinstance(value, bool):
        return float(value)
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = None
    if number is None or not math.isfinite(number) or isinstance(value, (str, bytes)):
        where = prompt.where or repr(prompt.text[:60])
        raise ValueError(f"task.reward={spec!r} returned {value!r} ({type(value).__name__}) for the prompt {where}; "
                         "it must return a finite number")
    return number


class PluginRewardTask(Task):
    """`task`'s prompts, scored by the `task.reward` function instead of the task's own reward."""

    def __init__(self, task: Task, spec: str, *, timeout_s: float | None = None):
        self.task, self.spec, self.timeout_s = task, spec, timeout_s
        self.fn = load_reward_function(spec)

    def prompts(self, start: int, count: int, seed: int) -> list[Prompt]:
        return self.task.prompts(start, count, seed)

    def reward(self, response: str, prompt: Prompt) -> float:
        return call_reward(self.fn, self.spec, prompt=prompt, response=response, timeout_s=self.timeout_s)

    def longest_prompts(self) -> list[Prompt]:
        return self.task.longest_prompts()

    def eval_prompts(self, count: int | None) -> list[Prompt]:
        return self.task.eval_prompts(count)
