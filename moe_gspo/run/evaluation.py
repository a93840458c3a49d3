"""Held-out evaluation during training (`eval.*` config section).

Which policy: the policy after `v` updates is evaluated for v = 0, eval.every, 2 * eval.every, ... (at the
start of step v, after the weight sync that brought it to the rollout engine, before the step's own
rollout) and after the last step (v = train.steps). The numbers of v < train.steps are logged on step v's
row of metrics.jsonl (the same policy that generated that row's rollouts); every evaluation, the final
one included, is one line of RUN_DIR/eval.jsonl (`{"step": v, "eval/...": ...}`) and goes to wandb.

What: `eval.num_prompts` prompts of the eval set (`eval_prompts`: eval.path, or the task's held-out
split), `eval.samples_per_prompt` = k responses each, greedy (eval.greedy) or sampled like the rollout,
scored by the task's reward (or task.reward). The generation goes through the rollout engine in chunks
of rollout.prompts_per_step prompts, each engine generating a share, like a training step.

Metrics (`eval/*`):
- `reward_mean`: mean reward over all k * n eval responses;
- `accuracy`: share of responses with reward >= 1 (exact / full-credit answers for the shipped tasks;
  mean pass@1 over prompts);
- `pass_at_k` (k > 1 only): share of prompts with at least one of their k responses at reward >= 1 (the
  unbiased estimator of Chen et al. 2021 with n = k samples);
- `k`, `num_prompts`, `response_len_mean` (tokens, EOS included), `stop_frac` (responses that ended with
  EOS), `policy_step` (v).

The training RNG streams are untouched: the engines sample from `SamplingParams.seed` only (their own
generators), and the eval seeds (`derive_seed("eval", train.seed, v, chunk, share)`) never coincide with a
training step's; prompts come from the eval set, not the training stream. A run with eval reproduces the
training metrics of a run without it exactly with the transformers engine (tested). With vLLM the eval
requests share the engine's prefix cache with the next step's rollout, which may round differently.
"""

from __future__ import annotations

import torch

from moe_gspo.config import Config
from moe_gspo.rollout.base import SamplingParams
from moe_gspo.run import steps
from moe_gspo.run.setup import derive_seed
from moe_gspo.tasks import Prompt, Task
from moe_gspo.tasks.jsonl import read_prompt_file


def eval_prompts(cfg: Config, task: Task) -> list[Prompt]:
    """The eval set: the first eval.num_prompts prompts of eval.path, else of the task's held-out split;
    [] when eval is off. Raises ValueError naming the field for a bad file."""
    e = cfg.eval
    if not e.every:
        return []
    if e.path is not None:
        items = read_prompt_file(e.path, field="eval.path")
        return items[:e.num_prompts]
    return task.eval_prompts(e.num_prompts)


def is_eval_step(cfg: Config, version: int) -> bool:
    """Whether the policy after `version` updates is evaluated (the last one always, when eval is on)."""
    every = cfg.eval.every
    return bool(every) and (version % every == 0 or version == cfg.train.steps)


def eval_metrics(rewards_NK: torch.Tensor, lens_NK: torch.Tensor, stops_NK: torch.Tensor, version: int) -> dict:
    """The `eval/*` metrics of n prompts x k responses (module docstring); pure."""
    n, k = rewards_NK.shape
    correct_NK = rewards_NK >= 1.0
    out = {"eval/reward_mean": rewards_NK.float().mean().item(), "eval/accuracy": correct_NK.float().mean().item(),
           "eval/k": float(k), "eval/num_prompts": float(n), "eval/response_len_mean": lens_NK.float().mean().item(),
           "eval/stop_frac": stops_NK.float().mean().item(), "eval/policy_step": float(version)}
    if k > 1:
        out["eval/pass_at_k"] = correct_NK.any(dim=1).float().mean().item()
    return out


def evaluate(policy, task: Task, prompts: list[Prompt], cfg: Config, info, version: int) -> dict:
    """Generate and score the eval set with the policy after `version` updates (collective: every rank
    calls it); returns the `eval/*` metrics, the same on every rank."""
    e, r = cfg.eval, cfg.rollout
    k = e.samples_per_prompt
    sampling = SamplingParams(n=k, temperature=0.0 if e.greedy else r.temperature, top_p=1.0 if e.greedy else r.top_p,
                              top_k=0 if e.greedy else r.top_k, support_cap=r.support_cap,
                              max_new_tokens=e.max_new_tokens or r.max_new_tokens)
    chunk = r.prompts_per_step
    rewards, lens, stops = [], [], []
    for c, lo in enumerate(range(0, len(prompts), chunk)):
        part = prompts[lo:lo + chunk]
        samples = steps.generate(policy, part, cfg, info, sampling,
                                 seed_of_share=lambda share: derive_seed("eval", cfg.train.seed, version, c, share))
        rewards.append(steps.score(policy, task, part, samples))
        lens.append(torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float32))
        stops.append(torch.tensor([s.finish_reason == "stop" for s in samples]))
    cat = [torch.cat(x).view(len(prompts), k) for x in (rewards, lens, stops)]
    return eval_metrics(*cat, version)


def maybe_evaluate(cfg: Config, policy, task: Task, prompts: list[Prompt], info, sink, version: int, *,
                   timer=None) -> dict:
    """Evaluate the policy after `version` updates when it is due (`is_eval_step`) and record it
    (eval.jsonl; wandb); returns the `eval/*` metrics for step `version`'s row ({} when not due, and for
    the final policy, which has no row). Time goes to the phase `eval`."""
    if not prompts or not is_eval_step(cfg, version):
        return {}
    import contextlib

    with timer("eval") if timer is not None else contextlib.nullcontext():
        metrics = evaluate(policy, task, prompts, cfg, info, version)
    final = version >= cfg.train.steps
    sink.log_eval(version, metrics, in_step_row=not final)
    return {} if final else metrics
