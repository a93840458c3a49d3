"""Tasks with verifiable rewards: synthetic ones for CPU runs and JSONL prompt/answer files."""

from moe_gspo.tasks.base import Prompt, Task
from moe_gspo.tasks.jsonl import JsonlTask, read_prompt_file
from moe_gspo.tasks.math_answer import extract_answer, math_reward
from moe_gspo.tasks.synthetic import SyntheticTask


def make_task(cfg) -> Task:
    """Build the task described by a `moe_gspo.config.TaskConfig`."""
    if cfg.name == "jsonl":
        return JsonlTask(cfg.path)
    return SyntheticTask(cfg.name, prompt_len=cfg.prompt_len, num_symbols=cfg.num_symbols,
                         prompt_len_max=cfg.prompt_len_max, pad_prompts=cfg.pad_prompts,
                         partial_credit=cfg.partial_credit)


__all__ = ["Prompt", "Task", "JsonlTask", "SyntheticTask", "make_task", "read_prompt_file",
           "extract_answer", "math_reward"]
