"""Tasks with verifiable rewards: synthetic ones for CPU runs and JSONL prompt/answer files."""

from moe_gspo.tasks.base import Prompt, Task
from moe_gspo.tasks.jsonl import JsonlTask, read_prompt_file
from moe_gspo.tasks.math_answer import extract_answer, math_reward
from moe_gspo.tasks.synthetic import SyntheticTask


def make_task(cfg, *, holdout: int = 0) -> Task:
    """Build the task described by a `moe_gspo.config.TaskConfig` (`holdout`: `eval.holdout`), scored by
    `task.reward` when one is given."""
    if cfg.name == "jsonl":
        task: Task = JsonlTask(cfg.path, holdout=holdout)
    else:
        task = SyntheticTask(cfg.name, prompt_len=cfg.prompt_len, num_symbols=cfg.num_symbols,
                             prompt_len_max=cfg.prompt_len_max, pad_prompts=cfg.pad_prompts,
                             partial_credit=cfg.partial_credit)
    if cfg.reward is not None:
        from moe_gspo.tasks.plugin import PluginRewardTask

        task = PluginRewardTask(task, cfg.reward, timeout_s=cfg.reward_timeout_s)
    return task


__all__ = ["Prompt", "Task", "JsonlTask", "SyntheticTask", "make_task", "read_prompt_file",
           "extract_answer", "math_reward"]
