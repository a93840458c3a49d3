"""The stages of one RL step, each small enough to read on its own (used by `moe_gspo.train`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from moe_gspo.algos import group_advantages, group_signal_metrics
from moe_gspo.config import Config
from moe_gspo.mcore.parallel import ParallelInfo
from moe_gspo.rollout.base import RolloutSample, SamplingParams
from moe_gspo.rollout.engine_spec import engine_spec
from moe_gspo.files import writing
from moe_gspo.run.setup import Policy, derive_seed
from moe_gspo.tasks import Prompt, Task
from moe_gspo.tasks.encoding import encode_prompts


def rollout_share(info: ParallelInfo, tensor_parallel_size: int = 1) -> tuple[int, int]:
    """(index, count) of this rank's rollout engine: each engine samples `1/count` of the prompts.

    Every data-parallel rank has its own engine, except that a tensor-parallel vLLM engine spans
    `tensor_parallel_size` consecutive ranks, which must sample the same prompts with the same seed.
    """
    tp = max(1, int(tensor_parallel_size))
    if tp == 1:
        return info.dp_rank, info.dp_size
    assert info.world_size == info.dp_size and info.world_size % tp == 0, (info, tp)
    return info.rank // tp, info.world_size // tp


def rollout(policy: Policy, prompts: list[Prompt], cfg: Config, info: ParallelInfo, step: int, *,
            round_index: int = 0) -> list[RolloutSample]:
    """Data-parallel sampling: each engine generates whole groups for its share of `prompts`, then every
    rank receives the global batch (the learner takes the same global batch on every rank).
    `round_index` > 0: a further generation round of the step (dynamic sampling, `run.sampling`), with
    its own seed; round 0 uses the seed a step without dynamic sampling uses."""
    r = cfg.rollout
    sampling = SamplingParams(n=r.samples_per_prompt, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                              support_cap=r.support_cap, max_new_tokens=r.max_new_tokens)
    rounds = (round_index,) if round_index else ()
    try:
        return generate(policy, prompts, cfg, info, sampling,
                        seed_of_share=lambda share: derive_seed(cfg.train.seed, step, share, *rounds))
    except RuntimeError as e:
        if "probability tensor contains" not in str(e):
            raise
        raise ValueError(f"step {step}: the rollout engine's next-token probabilities are NaN/Inf: the policy "
                         f"weights overflow in rollout.dtype={r.dtype}. Lower train.lr (now {cfg.train.lr:g}) or set "
                         f"train.grad_clip > 0, then --resume from an earlier checkpoint") from None


def generate(policy: Policy, prompts: list[Prompt], cfg: Config, info: ParallelInfo, sampling: SamplingParams, *,
             seed_of_share) -> list[RolloutSample]:
    """`sampling.n` samples of every prompt, each rollout engine generating a contiguous share of the
    prompts (sizes differ by at most one; a share may be empty) with the seed `seed_of_share(share)`;
    every rank receives all samples, in prompt order (collective: every rank calls it)."""
    share, num_shares = rollout_share(info, engine_spec(cfg.rollout.engine).rollout_tp(cfg.rollout))
    lo, hi = len(prompts) * share // num_shares, len(prompts) * (share + 1) // num_shares
    ids = encode_prompts(policy.tokenizer, [p.text for p in prompts[lo:hi]], chat_template=cfg.task.chat_template,
                         system_prompt=cfg.task.system_prompt)
    sampling = dataclasses.replace(sampling, seed=seed_of_share(share))
    local = policy.engine.generate(ids, sampling) if ids else []
    return gather_samples(local, info, prompt_offset=lo)


def gather_samples(samples: list[RolloutSample], info: ParallelInfo, *, prompt_offset: int) -> list[RolloutSample]:
    """Every data-parallel rank's samples, in rank order, on every rank (prompt indices made global)."""
    for s in samples:
        s.prompt_index += prompt_offset
    if info.world_size == 1:
        return samples
    parts: list = [None] * info.world_size
    dist.all_gather_object(parts, samples)
    seen, out = set(), []
    for rank_samples in parts:  # ranks sharing a dp_rank (none when world = EP x DP) sampled the same groups
        if rank_samples and rank_samples[0].prompt_index not in seen:
            seen.update(s.prompt_index for s in rank_samples)
            out.extend(rank_samples)
    return out


def response_text(tokenizer, response_ids) -> str:
    """The text a reward function judges: the response without its final EOS, special tokens kept.
    (Skipping them would let a policy pad a right answer with invisible <pad>/<bos> tokens for free.)"""
    ids = [int(t) for t in response_ids]
    if ids and ids[-1] == tokenizer.eos_token_id:
        ids = ids[:-1]
    return tokenizer.decode(ids, skip_special_tokens=False)


def score(policy: Policy, task: Task, prompts: list[Prompt], samples: list[RolloutSample]) -> torch.Tensor:
    tok = policy.tokenizer
    rewards = [task.reward(response_text(tok, s.response_ids), prompts[s.prompt_index]) for s in samples]
    return torch.tensor(rewards, dtype=torch.float32)


def check_rewards_agree(rewards: torch.Tensor, prompts: list[Prompt], samples: list[RolloutSample]) -> None:
    """Every rank scores the whole global batch (`generate` gives every rank all samples), so the
    rewards must be identical everywhere; a reward that differs between ranks (randomness, the clock,
    rank-dependent state in a `task.reward` function) would give each rank other advantages and
    silently train on rank 0's view (`reward/mean`). Compares a digest of the rewards across ranks
    (collective; a no-op in a world of one) and raises the same ValueError on every rank, naming the
    first differing prompt and the values, when they differ."""
    import hashlib

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    world = dist.get_world_size()
    digests: list = [None] * world
    dist.all_gather_object(digests, hashlib.sha256(rewards.numpy().tobytes()).hexdigest())
    if len(set(digests)) == 1:
        return
    values: list = [None] * world
    dist.all_gather_object(values, rewards.tolist())
    i = next((i for i in range(len(values[0])) if len({v[i] if i < len(v) else None for v in values}) > 1), 0)
    seen = ", ".join(f"rank {r}: {v[i] if i < len(v) else None!r}" for r, v in enumerate(values[:4]))
    p = prompts[samples[i].prompt_index] if i < len(samples) else None
    where = (p.where or repr(p.text[:60])) if p is not None else f"sample {i}"
    raise ValueError(f"the reward differs between ranks for the same response (prompt {where}, sample {i}: {seen}); "
                     "every rank scores the whole batch, so the reward (task.reward) must be a deterministic "
                     "function of prompt, response and answer: no random numbers, clock or per-process state")


def advantages(rewards: torch.Tensor, cfg: Config) -> torch.Tensor:
    return group_advantages(rewards, cfg.rollout.samples_per_prompt, eps=cfg.algo.adv_eps,
                            scale_rewards=cfg.algo.scale_rewards, std_correction=cfg.algo.adv_std_correction)


def sample_metrics(rewards: torch.Tensor, samples: list[RolloutSample], advantages_B: torch.Tensor,
                   group_size: int) -> dict:
    """The sampled batch: rewards, response lengths, and the groups that carry a learning signal
    (`reward/frac_zero_std`, `advantage/nonzero_frac`, see `moe_gspo.algos.collapse`)."""
    r = rewards
    lens = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float32)
    stop = torch.tensor([s.finish_reason == "stop" for s in samples], dtype=torch.float32)
    return {"reward/mean": r.mean().item(), "reward/std": r.std(unbiased=False).item(), "reward/max": r.max().item(),
            "response/len_mean": lens.mean().item(), "response/len_max": lens.max().item(),
            "response/stop_frac": stop.mean().item(), "num_sequences": int(r.numel()),
            **group_signal_metrics(r, advantages_B, group_size)}


def dial_metrics(samples: list[RolloutSample], rollout) -> dict:
    """The routing-drift dial's settings and its realised flip rate (`routing/dial_*`); {} when it is off, so an
    undialled run's rows keep their keys. The rate: the share of (token, MoE layer) routes the rollout engine
    used on the rows `routing/layer_disagree` compares (positions P-1 ... P+R-2 of each sample) whose expert
    set the dial changed against the clean top-k of the same router logits (`RolloutSample.extra`, counted by
    the engine)."""
    if not (rollout.router_noise_std > 0 or rollout.router_flip_prob > 0):
        return {}
    rows = sum(s.extra.get("dial_rows", 0) for s in samples)
    changed = sum(s.extra.get("dial_changed", 0) for s in samples)
    return {"routing/dial_noise_std": float(rollout.router_noise_std),
            "routing/dial_flip_prob": float(rollout.router_flip_prob),
            "routing/dial_flip_frac": changed / rows if rows else float("nan")}


def learner_margins(result) -> list | None:
    """[T_b, L] router margins of a learner pass (`LogprobResult.router_stats[..., 0]`), or None."""
    stats = getattr(result, "router_stats", None) if result is not None else None
    return None if stats is None else [st[..., 0] for st in stats]


def margins_for(margins: list | None, routes: list) -> list | None:
    """The router margins a trace of `routes` stores: each cut to its routes' rows; None when a sequence
    has none, or fewer rows than its routes (a trace stores margins for all rows or none)."""
    if margins is None or len(margins) != len(routes) or any(m is None for m in margins):
        return None
    cut = [np.asarray(m)[:len(r)] for m, r in zip(margins, routes)]
    return cut if all(c.shape == np.shape(r)[:2] for c, r in zip(cut, routes)) else None


def save_step_traces(run_dir: Path, step: int, policy: Policy, samples, batch, old, new,
                     rewards: torch.Tensor, *, replayed_logp_BS: torch.Tensor | None = None,
                     rollout_routes: list | None = None) -> None:
    """Routing traces (rollout / learner natural routing / updated learner, when measured) and
    log-probs of the step's global batch; under R3 also `learner_replayed_logp` (the pass replaying
    the rollout routes, the loss's pi_old). `rollout_routes`: the engine's routes to save, checked
    (`StepPasses.rollout_routes`: each cut at its first missing or malformed row); None =
    `batch.rollout_routes` as they are."""
    from moe_gspo.routing.trace import RoutingTrace, save_trace

    out = run_dir / "traces"
    out.mkdir(parents=True, exist_ok=True)
    plens = [len(s.prompt_ids) for s in samples]
    rlens = [len(s.response_ids) for s in samples]
    sources = {"learner": old.routes, "updated": new.routes if new is not None else None,
               "rollout": batch.rollout_routes if rollout_routes is None else rollout_routes}
    margins = {"learner": learner_margins(old), "updated": learner_margins(new),
               "rollout": [getattr(s, "router_margin_TL", None) for s in samples]}
    for name, routes in sources.items():
        if routes is None:
            continue
        trace = RoutingTrace.from_samples(routes, plens, rlens, num_experts=policy.num_experts,
                                          layer_ids=policy.layer_ids, meta={"source": name, "step": step},
                                          margins=margins_for(margins[name], routes))
        with writing(out / f"step_{step:06d}_{name}.npz", "routing trace"):
            save_trace(out / f"step_{step:06d}_{name}.npz", trace)
    mask = batch.response_mask_BS.bool()
    tmp = out / f".step_{step:06d}_logprobs.tmp.npz"
    extra = {} if replayed_logp_BS is None else {"learner_replayed_logp": replayed_logp_BS[mask].float().cpu().numpy()}
    try:
        with writing(out / f"step_{step:06d}_logprobs.npz", "log-probs trace"):
            np.savez(tmp, rollout_logp=batch.rollout_logp_BS[mask].float().numpy(),
                     learner_logp=old.logp_BS[mask].float().cpu().numpy(),
                     response_lens=np.asarray(rlens, np.int32), rewards=rewards.numpy().astype(np.float32), **extra)
            tmp.replace(out / f"step_{step:06d}_logprobs.npz")
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
