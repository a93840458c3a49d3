"""Parity with the reference implementation: one optimizer step of our Megatron learner against TRL's
`GRPOTrainer.compute_loss` (TRL's own code, run here) on the same weights, batch, old log-probs and
advantages: the same loss, the same (clipped) gradient and the same updated weights.

Cases: GSPO (TRL `importance_sampling_level="sequence"`, `loss_type="grpo"`: one ratio per sequence,
per-sequence mean), GRPO (token ratios, `loss_type="grpo"`: token mean per sequence, then mean over
sequences = our `aggregation="seq_mean"`) and GRPO with a token mean over the batch (TRL `loss_type="bnpo"`
= our `aggregation="token_mean"`). The old log-probs are the current ones shifted per sequence (GSPO) or
per token (GRPO) by amounts chosen away from the clip boundaries, so that some units are clipped on
either side and with either sign of the advantage, and the clip decision cannot flip on float rounding.

TRL is a test dependency (`pip install -e ".[dev]"`); the test skips only when it is not installed,
and `.ci/run` installs it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _learner_common import make_learner, old_pass, tiny_pair
from moe_gspo.config import AlgoConfig
from moe_gspo.learner.batch import PackedBatch
from moe_gspo.mcore.weights import megatron_to_hf
from moe_gspo.rollout import vllm_support
from moe_gspo.rollout.base import RolloutSample

# TRL's GRPOTrainer imports vLLM when it is installed; later vLLM tests in this process need it set up first.
vllm_support.prepare_for_foreign_import()
trl = pytest.importorskip("trl", reason="TRL is a test dependency: pip install -e '.[dev]'")

pytestmark = pytest.mark.usefixtures("dist")

LR = 1e-3
CASES = {
    # name: (our algo config, TRL importance_sampling_level, TRL loss_type)
    "gspo": (AlgoConfig(name="gspo"), "sequence", "grpo"),
    "grpo_seq_mean": (AlgoConfig(name="grpo"), "token", "grpo"),
    "grpo_token_mean": (AlgoConfig(name="grpo", aggregation="token_mean"), "token", "bnpo"),
    # TRL's entropy bonus is a token mean over the micro-batch; ours is aggregated like the policy term,
    # which is the same under token-mean
    "grpo_token_mean_entropy_bonus": (AlgoConfig(name="grpo", aggregation="token_mean", entropy_coef=0.05), "token",
                                      "bnpo"),
}


def _batch(num: int = 12, prompt_len: int = 6, seed: int = 0) -> tuple[PackedBatch, np.ndarray]:
    """Equal-length prompts (TRL left-pads prompts; the copy task's prompts are fixed-width too) and
    responses of 1-7 tokens, ids >= 3 (no special tokens)."""
    rng = np.random.default_rng(seed)
    samples = [RolloutSample(prompt_index=i // 4, prompt_ids=rng.integers(3, 40, prompt_len),
                             response_ids=rng.integers(3, 40, int(rng.integers(1, 8))),
                             response_logprobs=np.zeros(1, np.float32), finish_reason="stop")
               for i in range(num)]
    for s in samples:
        s.response_logprobs = np.zeros(len(s.response_ids), np.float32)
    adv = rng.choice([-1.5, -0.5, 0.7, 1.2], size=num).astype(np.float32)
    return PackedBatch.from_samples(samples, adv, pad_id=0), adv


def _old_logp(logp_BS: torch.Tensor, batch: PackedBatch, level: str, seed: int = 1) -> torch.Tensor:
    """Old log-probs = current + a shift: per sequence for GSPO (sequence log-ratio -shift, in or well
    outside (3e-4, 4e-4)), per token for GRPO (token log-ratios in or well outside (0.2, 0.27))."""
    rng = np.random.default_rng(seed)
    mask = batch.response_mask_BS
    if level == "sequence":
        shift_B = torch.tensor(rng.choice([-2e-3, -1e-4, 0.0, 1e-4, 2e-3], size=batch.num_seqs), dtype=torch.float32)
        shift = shift_B[:, None].expand_as(logp_BS)
    else:
        shift = torch.tensor(rng.choice([-0.6, -0.05, 0.0, 0.05, 0.6], size=tuple(logp_BS.shape)), dtype=torch.float32)
    return torch.where(mask, logp_BS + shift, 0.0)


def _trl_trainer(hf_model, level: str, loss_type: str, clip: tuple[float, float], tmp_path, entropy_coef: float):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from moe_gspo.tokenizer import load_tiny_tokenizer

    args = GRPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, fp16=False, seed=0,
                      importance_sampling_level=level, loss_type=loss_type, beta=0.0, epsilon=clip[0],
                      epsilon_high=clip[1], num_generations=4, per_device_train_batch_size=12,
                      gradient_accumulation_steps=1, learning_rate=LR, weight_decay=0.0, adam_beta1=0.9,
                      adam_beta2=0.99, max_grad_norm=1.0, router_aux_loss_coef=0.0, report_to="none",
                      save_strategy="no", disable_tqdm=True, gradient_checkpointing=False, entropy_coef=entropy_coef)
    data = Dataset.from_list([{"prompt": "0123"}] * 4)
    trainer = GRPOTrainer(model=hf_model, reward_funcs=lambda completions, **_: [0.0] * len(completions),
                          args=args, train_dataset=data, processing_class=load_tiny_tokenizer())
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop; compute_loss divides by it
    return trainer


def _trl_inputs(batch: PackedBatch, old_logp_BS: torch.Tensor, adv: np.ndarray, prompt_len: int) -> dict:
    """TRL's generation-batch layout: prompt ids [B, P], completion ids [B, C] right-padded, masks,
    old per-token log-probs of the completion tokens, advantages [B]."""
    ids = batch.input_ids_BS
    C = batch.seq_len_padded - prompt_len
    resp_mask = batch.response_mask_BS[:, prompt_len:].long()
    return {"prompt_ids": ids[:, :prompt_len], "prompt_mask": torch.ones_like(ids[:, :prompt_len]),
            "completion_ids": torch.where(resp_mask.bool(), ids[:, prompt_len:], 0), "completion_mask": resp_mask,
            "old_per_token_logps": old_logp_BS[:, prompt_len:prompt_len + C].clone(),
            "advantages": torch.tensor(adv), "num_items_in_batch": resp_mask.sum()}


@pytest.mark.parametrize("case", list(CASES))
def test_one_optimizer_step_matches_trl(dist, case, tmp_path):
    algo, level, loss_type = CASES[case]
    cfg, hf, model = tiny_pair()
    batch, adv = _batch()
    prompt_len = int(batch.prompt_lens_B[0])
    learner = make_learner(model, cfg, dist, algo=algo, lr=LR, adam_beta2=0.99, grad_clip=1.0)
    old = _old_logp(learner.compute_logprobs(batch).logp_BS, batch, level)

    # ours: one train_step = one optimizer step over the whole batch; the clipped gradient is read
    # just before the optimizer step
    grads = {}
    step = learner.optimizer.step

    def capture_then_step():
        grads.update({k: p.main_grad.detach().clone() for k, p in learner.model.named_parameters()})
        step()

    learner.optimizer.step = capture_then_step
    ours = learner.train_step(batch, old_pass(old))
    our_grads = megatron_to_hf(grads, cfg)
    our_weights = megatron_to_hf({k: v.detach() for k, v in learner.model.state_dict().items()
                                  if not k.endswith("_extra_state")}, cfg)

    # TRL: its compute_loss on the same inputs, backward, transformers' clipping, its optimizer
    trainer = _trl_trainer(hf, level, loss_type, algo.clip_range(), tmp_path, algo.entropy_coef)
    model_t = trainer.model.train()
    loss = trainer.compute_loss(model_t, _trl_inputs(batch, old, adv, prompt_len))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model_t.parameters(), 1.0)
    trl_grads = {k: p.grad.detach().clone() for k, p in model_t.named_parameters()}
    opt = trainer.create_optimizer()
    opt.step()
    trl_weights = {k: v.detach() for k, v in model_t.state_dict().items()}

    assert ours["loss/total"] == pytest.approx(float(loss.detach()), rel=1e-5, abs=1e-7)
    # the clip binds somewhere (the case would not test clipping otherwise), and on the same share as
    # TRL's clip_ratio/region_mean, which counts sequences at sequence level and tokens at token level
    ours_clip = ours["clip/seq_frac" if level == "sequence" else "clip/token_frac"]
    assert 0 < ours_clip < 1
    assert ours_clip == pytest.approx(trainer._metrics["train"]["clip_ratio/region_mean"][-1], abs=1e-6)  # TRL: float32
    assert set(our_grads) == set(trl_grads)
    scale = max(float(g.abs().max()) for g in trl_grads.values())
    for k, g in trl_grads.items():
        assert torch.allclose(our_grads[k], g, rtol=1e-3, atol=1e-5 * scale), (k, float((our_grads[k] - g).abs().max()))
    # Adam's first step moves each weight by ~lr * sign(grad): compare where the gradient is not ~0
    for k, w in trl_weights.items():
        if k not in our_weights:
            continue
        sure = trl_grads[k].abs() > 1e-4 * scale
        assert torch.allclose(our_weights[k][sure], w[sure], atol=1e-6), (k, float((our_weights[k] - w)[sure].abs().max()))
        assert torch.allclose(our_weights[k], w, atol=2 * LR)
