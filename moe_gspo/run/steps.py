"""The stages of one RL step, each small enough to read on its own (used by `moe_gspo.train`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from moe_gspo.algos import group_advantages
from moe_gspo.config import Config
from moe_gspo.mcore.parallel import ParallelInfo
from moe_gspo.rollout.base import RolloutSample, SamplingParams
from moe_gspo.run.setup import Policy, derive_seed
from moe_gspo.tasks import Prompt, Task


def rank_prompts(task: Task, cfg: Config, info: ParallelInfo, consumed: int) -> list[Prompt]:
    """This rank's share of the step's prompts (whole groups per rank)."""
    per_rank = cfg.rollout.prompts_per_step // info.dp_size
    return task.prompts(consumed + info.dp_rank * per_rank, per_rank, cfg.train.seed)


def rollout(policy: Policy, prompts: list[Prompt], cfg: Config, info: ParallelInfo, step: int) -> list[RolloutSample]:
    tok = policy.tokenizer
    ids = [tok(p.text, add_special_tokens=False)["input_ids"] for p in prompts]
    r = cfg.rollout
    sampling = SamplingParams(n=r.samples_per_prompt, temperature=r.temperature, top_p=r.top_p,
                              max_new_tokens=r.max_new_tokens, seed=derive_seed(cfg.train.seed, step, info.rank))
    return policy.engine.generate(ids, sampling)


def score(policy: Policy, task: Task, prompts: list[Prompt], samples: list[RolloutSample]) -> torch.Tensor:
    tok = policy.tokenizer
    rewards = []
    for s in samples:
        ids = [int(t) for t in s.response_ids if int(t) != tok.eos_token_id]
        rewards.append(task.reward(tok.decode(ids, skip_special_tokens=True), prompts[s.prompt_index]))
    return torch.tensor(rewards, dtype=torch.float32)


def advantages(rewards: torch.Tensor, cfg: Config) -> torch.Tensor:
    return group_advantages(rewards, cfg.rollout.samples_per_prompt, eps=cfg.algo.adv_eps)


def gather_floats(x: torch.Tensor, info: ParallelInfo) -> torch.Tensor:
    """Concatenate a 1-D float tensor over all ranks (equal lengths)."""
    if info.world_size == 1:
        return x
    out = [torch.empty_like(x) for _ in range(info.world_size)]
    dist.all_gather(out, x.contiguous())
    return torch.cat(out)


def sample_metrics(rewards: torch.Tensor, samples: list[RolloutSample], info: ParallelInfo) -> dict:
    lens = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float32)
    stop = torch.tensor([s.finish_reason == "stop" for s in samples], dtype=torch.float32)
    r, lens, stop = (gather_floats(t, info) for t in (rewards, lens, stop))
    return {"reward/mean": r.mean().item(), "reward/std": r.std(unbiased=False).item(), "reward/max": r.max().item(),
            "response/len_mean": lens.mean().item(), "response/len_max": lens.max().item(),
            "response/stop_frac": stop.mean().item(), "num_sequences": int(r.numel())}


def save_step_traces(run_dir: Path, step: int, info: ParallelInfo, policy: Policy, samples, batch,
                     old, new, rewards: torch.Tensor) -> None:
    """Routing traces (rollout / learner / updated learner) and log-probs of this rank's samples."""
    from moe_gspo.routing.trace import RoutingTrace, save_trace
    from moe_gspo.run.sinks import atomic_write_text  # noqa: F401  (same atomic discipline)

    out = run_dir / "traces"
    out.mkdir(parents=True, exist_ok=True)
    suffix = "" if info.world_size == 1 else f"_rank{info.rank}"
    plens = [len(s.prompt_ids) for s in samples]
    rlens = [len(s.response_ids) for s in samples]
    sources = {"learner": old.routes, "updated": new.routes if new is not None else None,
               "rollout": batch.rollout_routes}
    for name, routes in sources.items():
        if routes is None:
            continue
        trace = RoutingTrace.from_samples(routes, plens, rlens, num_experts=policy.num_experts,
                                          layer_ids=policy.layer_ids, meta={"source": name, "step": step})
        save_trace(out / f"step_{step:06d}_{name}{suffix}.npz", trace)
    mask = batch.response_mask_BS.bool()
    tmp = out / f".step_{step:06d}_logprobs{suffix}.tmp.npz"
    np.savez(tmp, rollout_logp=batch.rollout_logp_BS[mask].float().numpy(),
             learner_logp=old.logp_BS[mask].float().cpu().numpy(),
             response_lens=np.asarray(rlens, np.int32), rewards=rewards.numpy().astype(np.float32))
    tmp.replace(out / f"step_{step:06d}_logprobs{suffix}.npz")
