"""`torchrun --nproc-per-node N -m moe_gspo.train --config configs/tiny_cpu.yaml [--algo ...] [--routing-replay ...]`

The RL loop: sample prompts → the rollout engine generates G responses per prompt with routes and
log-probs → rewards → group advantages → the learner recomputes old log-probs (recording its own
routes; R2 replays them in the update, R3 replays the rollout engine's), rollout corrections and
reference log-probs when configured, then mini-batch updates with the selected loss
(`run.learner_passes.learner_update`) → weight sync to the rollout engine → metrics. `--help` lists
every option.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from moe_gspo.config import Config


def train(cfg: Config, run_dir: Path, resume: bool) -> dict:
    from tqdm import tqdm

    from moe_gspo.learner.batch import PackedBatch
    from moe_gspo.run import steps
    from moe_gspo.run.checkpoint import TrainState, latest_checkpoint, load_checkpoint, save_checkpoint, set_rng_state
    from moe_gspo.plan.startup import check_before_loading
    from moe_gspo.run.learner_passes import ReferencePolicy, learner_update
    from moe_gspo.run.setup import build_policy, init_run
    from moe_gspo.run.sinks import MetricsSink, atomic_write_text
    from moe_gspo.tasks import make_task

    info = init_run(cfg)
    check_before_loading(cfg, info)  # optimizer options for this device; the memory plan on GPU (moe_gspo.plan)
    run_dir.mkdir(parents=True, exist_ok=True)
    policy, task, state = build_policy(cfg, info), make_task(cfg.task), TrainState()
    learner, engine = policy.learner, policy.engine
    reference = ReferencePolicy(cfg, info, learner) if cfg.algo.kl_coef > 0 else None  # initial weights
    if resume and (ckpt := latest_checkpoint(run_dir)) is not None:
        state, learner_state, rng = load_checkpoint(ckpt, rank=info.rank, world_size=info.world_size)
        learner.load_state_dict(learner_state)
        set_rng_state(rng)
    engine.update_weights(learner.hf_state_dict().items())
    if info.is_main:
        atomic_write_text(run_dir / "config.yaml", cfg.to_yaml())
        print(cfg.to_yaml() if state.step == 0 else f"resuming at step {state.step} from {run_dir}", flush=True)
    sink = MetricsSink(run_dir, enabled=info.is_main, wandb_mode=cfg.logging.wandb_mode,
                       project=cfg.logging.wandb_project, run_name=cfg.logging.run_name or run_dir.name,
                       config=cfg.to_dict(), start_step=state.step)
    bar = tqdm(range(state.step, cfg.train.steps), initial=state.step, total=cfg.train.steps,
               disable=not (info.is_main and cfg.logging.progress), dynamic_ncols=True)
    t_start = time.time()
    for step in bar:
        t0 = time.time()
        prompts = steps.step_prompts(task, cfg, state.prompts_consumed)
        learner.offload_for_rollout()  # train.offload_during_rollout (no-op by default)
        samples = steps.rollout(policy, prompts, cfg, info, step)
        learner.reload_after_rollout()
        rewards = steps.score(policy, task, prompts, samples)
        batch = PackedBatch.from_samples(samples, steps.advantages(rewards, cfg), policy.tokenizer.pad_token_id)
        t_rollout = time.time() - t0
        passes = learner_update(cfg, policy, batch, samples, step, reference=reference)  # old pass, update, drift
        metrics = passes.metrics
        engine.update_weights(learner.hf_state_dict().items())
        metrics.update(steps.sample_metrics(rewards, samples))
        state.step, state.prompts_consumed = step + 1, state.prompts_consumed + cfg.rollout.prompts_per_step
        dt = time.time() - t0
        num_tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
        metrics.update({"perf/step_time_s": dt, "perf/rollout_s": t_rollout, "perf/learner_s": dt - t_rollout,
                        "perf/tokens_per_s": num_tokens / dt})
        sink.log(step, metrics)
        if info.is_main and cfg.logging.trace_every and step % cfg.logging.trace_every == 0:
            steps.save_step_traces(run_dir, step, policy, samples, batch, passes.old, passes.new, rewards,
                                   replayed_logp_BS=passes.replayed_logp_BS)
        if cfg.train.checkpoint_every and state.step % cfg.train.checkpoint_every == 0:
            save_checkpoint(run_dir, state, learner.state_dict(), rank=info.rank, keep=cfg.train.keep_checkpoints)
        bar.set_postfix({"reward": f"{metrics['reward/mean']:.3f}", "flip": f"{metrics.get('routing/any_layer_flip', 0):.3f}",
                         "clip": f"{metrics.get('clip/token_frac', 0):.3f}"})
    sink.close()
    return finish(cfg, run_dir, info, policy, state, time.time() - t_start)


def finish(cfg: Config, run_dir: Path, info, policy, state, wall_s: float) -> dict:
    """Final checkpoint, HF export, learning summary, done.json."""
    from moe_gspo.mcore.checkpoint import save_hf_checkpoint
    from moe_gspo.run.checkpoint import save_checkpoint
    from moe_gspo.run.sinks import atomic_write_text

    save_checkpoint(run_dir, state, policy.learner.state_dict(), rank=info.rank, keep=cfg.train.keep_checkpoints)
    if cfg.train.export_hf:
        from moe_gspo.tokenizer import ASSET_DIR

        tok_dir = cfg.model.tokenizer or cfg.model.path or str(ASSET_DIR)
        save_hf_checkpoint(policy.learner.hf_state_dict(), policy.hf_config, run_dir / "hf_export",
                           tokenizer_dir=tok_dir)
    summary = {}
    if info.is_main:
        summary = learning_summary(run_dir / "metrics.jsonl")
        atomic_write_text(run_dir / "done.json", json.dumps({"step": state.step, "wall_s": wall_s, "summary": summary}, indent=1))
        print(f"mean reward, first 10% of steps: {summary['reward_first10']:.4f}   "
              f"last 10%: {summary['reward_last10']:.4f}   ({state.step} steps, {wall_s:.0f} s)", flush=True)
    return summary


def learning_summary(metrics_path: Path) -> dict:
    rows = [json.loads(l) for l in metrics_path.read_text().splitlines() if l.strip()]
    rewards = [r["reward/mean"] for r in rows]
    k = max(1, len(rewards) // 10)
    return {"num_steps": len(rows), "reward_first10": sum(rewards[:k]) / k, "reward_last10": sum(rewards[-k:]) / k}


def main(argv: list[str] | None = None) -> int:
    from moe_gspo.mcore.parallel import destroy_distributed
    from moe_gspo.run.cli import parse_train_args

    from moe_gspo.run.setup import quiet_known_warnings

    quiet_known_warnings()
    args, cfg = parse_train_args(argv)
    try:
        train(cfg, Path(args.run_dir), args.resume)
    except ValueError as e:  # user errors found after config time (checkpoints, data files, grid)
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
