"""Shared helpers of the learner tests and of the EP=2 torchrun worker (no pytest imports here)."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from moe_gspo.config import AlgoConfig, TrainConfig
from moe_gspo.learner.batch import PackedBatch
from moe_gspo.learner.learner import Learner
from moe_gspo.learner.old_pass import OldPolicyPass
from moe_gspo.mcore.model import build_gpt_model
from moe_gspo.mcore.weights import load_hf_model_into_megatron
from moe_gspo.rollout.base import RolloutSample
from moe_gspo.tiny import build_tiny_model, tiny_qwen3_moe_config

MODEL_SEED = 0


def tiny_pair(*, seed: int = MODEL_SEED, enable_routing_replay: bool = True, recompute: bool = False,
              ep_size: int = 1, batched_experts: bool = False, sdpa_attention: bool = True):
    """(hf_config, transformers model, Megatron model with the same weights), fp32."""
    cfg = tiny_qwen3_moe_config()
    hf = build_tiny_model(cfg, seed=seed)
    model = build_gpt_model(cfg, ep_size=ep_size, enable_routing_replay=enable_routing_replay, recompute=recompute,
                            batched_experts=batched_experts, sdpa_attention=sdpa_attention)
    load_hf_model_into_megatron(model, hf)
    return cfg, hf, model


def make_samples(num: int = 8, *, seed: int = 0, vocab: int = 51, max_prompt: int = 6, max_resp: int = 8,
                 with_routes: bool = False, num_layers: int = 2, num_experts: int = 8, top_k: int = 2):
    """Random samples of different lengths (ids >= 3, i.e. no special tokens); optional random routes."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(num):
        P, R = int(rng.integers(2, max_prompt + 1)), int(rng.integers(1, max_resp + 1))
        routes = None
        if with_routes:
            T = P + R - 1
            routes = np.stack([np.stack([rng.permutation(num_experts)[:top_k] for _ in range(num_layers)])
                               for _ in range(T)]).astype(np.uint8)
        out.append(RolloutSample(prompt_index=i // 4, prompt_ids=rng.integers(3, vocab, P),
                                 response_ids=rng.integers(3, vocab, R),
                                 response_logprobs=rng.uniform(-3, -0.1, R).astype(np.float32),
                                 finish_reason="stop", routes_TLK=routes))
    return out


def make_batch(num: int = 8, *, seed: int = 0, with_routes: bool = False) -> PackedBatch:
    samples = make_samples(num, seed=seed, with_routes=with_routes)
    adv = np.random.default_rng(seed + 100).standard_normal(num).astype(np.float32)
    return PackedBatch.from_samples(samples, adv, pad_id=0)


def make_learner(model, cfg, info, *, replay=None, algo: AlgoConfig | None = None, recompute: bool = False,
                 **train_kw) -> Learner:
    """A training Learner; `replay` (a mode name: none, r2, r3) sets `algo.routing_replay`."""
    train = TrainConfig(**{"lr": 1e-2, "num_minibatches": 1, "micro_batch_size": 0, **train_kw})
    algo = algo or AlgoConfig(name="gspo")
    if replay is not None:
        algo = dataclasses.replace(algo, routing_replay=replay)
    return Learner(model, cfg, parallel=info, algo=algo, train=train, recompute=recompute)


def old_pass(logp_BS, **kw) -> OldPolicyPass:
    """`OldPolicyPass(logp_BS=logp_BS, **kw)`: the update's hand-off from bare old log-probs."""
    return OldPolicyPass(logp_BS=logp_BS, **kw)


@torch.no_grad()
def hf_token_logprobs(hf_model, batch: PackedBatch) -> torch.Tensor:
    """transformers' token-aligned log-probs of the batch (0 at position 0 and past each end)."""
    logits = hf_model(batch.input_ids_BS).logits.float()
    lp = torch.log_softmax(logits, -1)[:, :-1].gather(-1, batch.input_ids_BS[:, 1:, None]).squeeze(-1)
    out = torch.cat([torch.zeros(batch.num_seqs, 1), lp], 1)
    valid = torch.arange(batch.seq_len_padded)[None] < batch.seq_lens_B[:, None]
    return torch.where(valid, out, 0.0)


def valid_mask(batch: PackedBatch) -> torch.Tensor:
    return torch.arange(batch.seq_len_padded)[None] < batch.seq_lens_B[:, None]


def flip_fraction(routes_a, routes_b) -> float:
    """Fraction of (token, layer) pairs whose top-k SET differs."""
    diff = [(np.sort(a.astype(np.int64), -1) != np.sort(b.astype(np.int64), -1)).any(-1).ravel()
            for a, b in zip(routes_a, routes_b)]
    return float(np.concatenate(diff).mean())


def surrogate_objective(logp_BS: torch.Tensor, batch: PackedBatch) -> float:
    """GSPO's objective at ratio 1: mean_i A_i * (mean log-prob of response i); its gradient is
    the GSPO policy gradient when the old policy equals the current one."""
    mask = batch.response_mask_BS
    per_seq = (logp_BS * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return float((batch.advantages_B * per_seq).mean())


def params_snapshot(model) -> dict[str, torch.Tensor]:
    return {k: p.detach().clone() for k, p in model.named_parameters()}
