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
import os
import sys
import time
from pathlib import Path

from moe_gspo.config import Config


def train(cfg: Config, run_dir: Path, resume: bool = False, *, overwrite: bool = False,
          allow_config_change: bool = False) -> dict:
    """Run (or continue) a training run in `run_dir`; see `moe_gspo.run.rundir` for what may happen to it.
    `allow_config_change`: `--resume` may change a key that defines the experiment (`moe_gspo.run.start`)."""
    from moe_gspo.plan.batch_bound import check_batch_fits_host
    from moe_gspo.run.evaluation import eval_prompts
    from moe_gspo.run.rundir import plan_run_dir
    from moe_gspo.run.setup import check_prompts_fit, init_run
    from moe_gspo.run.start import check_resume_config
    from moe_gspo.tasks import make_task

    plan = plan_run_dir(run_dir, resume=resume, overwrite=overwrite)  # output path: before any compute
    if plan.mode == "resume":  # the same experiment (dial, seed, loss) unless --allow-config-change
        check_resume_config(plan.path, cfg, allow_config_change=allow_config_change)
    task = make_task(cfg.task, holdout=cfg.eval.holdout)  # data errors: before any compute
    evals = eval_prompts(cfg, task)  # the held-out eval set (eval.*); [] when off
    check_prompts_fit(cfg, task, evals)  # prompt + max_new_tokens within the engine's context; <unk> warning
    check_batch_fits_host(cfg)  # absurd batch sizes: one line before any model is built (moe_gspo.plan.batch_bound)
    info = init_run(cfg)
    if info.device.type == "cpu":  # freed activations stay in the heap, no page faults per step (run/host_malloc.py)
        from moe_gspo.run.host_malloc import keep_freed_heap

        keep_freed_heap()
    lock = lock_run_dir(plan, info, resume=resume, overwrite=overwrite)  # one run per RUN_DIR: rank 0 holds it
    try:
        return _train_locked(cfg, plan, info, task, evals, resume)
    finally:
        if lock is not None:
            lock.release()


def lock_run_dir(plan, info, *, resume: bool, overwrite: bool):
    """Rank 0 takes RUN_DIR's lock for the run's life (`moe_gspo.run.rundir.lock_dir`) and re-plans under
    it (another run may have written there since `plan_run_dir`); every rank raises the same error when
    that fails. Returns the lock (rank 0) or None."""
    from moe_gspo.run.checkpoint import agree
    from moe_gspo.run.rundir import lock_dir, plan_run_dir

    lock, err = None, None
    if info.rank == 0:
        try:
            lock = lock_dir(plan.path, "--run-dir")
            again = plan_run_dir(plan.path, resume=resume, overwrite=overwrite, check_lock=False)
            if again.mode != plan.mode:
                raise ValueError(f"--run-dir {str(plan.path)!r} changed while this run started (another run wrote "
                                 f"there); rerun the command")
        except Exception as e:
            if lock is not None:
                lock.release()
                lock = None
            err = e
    agree(err, "locking the run directory")
    return lock


def _train_locked(cfg: Config, plan, info, task, evals, resume: bool) -> dict:
    from moe_gspo.plan.startup import check_before_loading
    from moe_gspo.run.activity import Activity
    from moe_gspo.run.learner_passes import ReferencePolicy
    from moe_gspo.run.rundir import check_same_run_dir
    from moe_gspo.run.setup import build_policy
    from moe_gspo.run.start import start_run

    check_same_run_dir(plan, rank=info.rank, world_size=info.world_size)  # multi-node: one shared RUN_DIR
    check_before_loading(cfg, info)  # optimizer options for this device; the memory plan on GPU (moe_gspo.plan)
    act = Activity(rank=info.rank, world_size=info.world_size, timeout_s=info.timeout_s)
    with act.watch():  # a collective timeout / lost rank becomes one message naming the ranks
        act("building the policy")
        policy = build_policy(cfg, info)
        # the KL reference keeps the initial weights (before any --resume checkpoint is loaded)
        reference = ReferencePolicy(cfg, info, policy.learner) if cfg.algo.kl_coef > 0 else None
        act("preparing the run directory")
        state = start_run(cfg, plan, info, policy, resume_asked=resume)
        return {} if state is None else loop(cfg, plan.path, info, policy, task, evals, state, act, reference)


def loop(cfg: Config, run_dir: Path, info, policy, task, evals, state, act, reference) -> dict:
    from tqdm import tqdm

    from moe_gspo.learner.batch import PackedBatch
    from moe_gspo.mcore.grouped_experts import expert_path_metrics
    from moe_gspo.run import sampling, steps
    from moe_gspo.run.checkpoint import save_checkpoint
    from moe_gspo.run.evaluation import maybe_evaluate
    from moe_gspo.run.learner_passes import learner_update
    from moe_gspo.run.samples import sample_rows
    from moe_gspo.run.sinks import MetricsSink
    from moe_gspo.run.start import check_trained, check_updated_policy, fingerprint
    from moe_gspo.run.timing import PhaseTimer

    learner, engine = policy.learner, policy.engine
    act("initial weight sync")
    engine.update_weights(learner.hf_weight_stream())  # collective: every rank, one layer at a time
    sink = MetricsSink(run_dir, enabled=info.is_main, wandb_mode=cfg.logging.wandb_mode,
                       project=cfg.logging.wandb_project, run_name=cfg.logging.run_name or run_dir.name,
                       config=cfg.to_dict(), start_step=state.step)
    bar = tqdm(range(state.step, cfg.train.steps), initial=state.step, total=cfg.train.steps,
               disable=not (info.is_main and cfg.logging.progress), dynamic_ncols=True)
    t_start, wall_before = time.time(), state.wall_s
    timer = PhaseTimer()  # perf/<phase>_s: where a step's time goes (benchmarks.step_profile)
    for step in bar:
        act(f"evaluation, step {step}")  # eval.every: the policy after `step` updates (perf/eval_s, not in step time)
        eval_metrics = maybe_evaluate(cfg, policy, task, evals, info, sink, step, timer=timer)
        t0 = time.time()
        act(f"rollout, step {step}")
        with timer("rollout"):
            learner.offload_for_rollout()  # train.offload_during_rollout (no-op by default)
        # generation round(s) and rewards; algo.dynamic_sampling: more rounds until enough groups differ
        drawn = sampling.collect_batch(policy, task, cfg, info, step, state.prompts_consumed, timer)
        samples, rewards = drawn.samples, drawn.rewards
        with timer("rollout"):
            engine.sleep()  # frees the engine's GPU memory for the learner (vLLM, rollout.sleep_level > 0)
            learner.reload_after_rollout()
        with timer("score"):
            batch = PackedBatch.from_samples(samples, steps.advantages(rewards, cfg), policy.tokenizer.pad_token_id)
        t_rollout = time.time() - t0
        act(f"learner passes, step {step}")
        passes = learner_update(cfg, policy, batch, samples, step, reference=reference, timer=timer)
        metrics = passes.metrics
        with timer("guard"):  # NaN/Inf weights never reach the engine or a checkpoint
            check_updated_policy(learner, passes.new.logp_BS if passes.new is not None else None,
                                 batch.response_mask_BS, cfg=cfg, step=step, run_dir=run_dir, device=info.device)
        act(f"weight sync, step {step}")
        with timer("sync"):
            engine.update_weights(learner.hf_weight_stream())  # wakes a sleeping vLLM engine
        with timer("traces"):
            if info.is_main and cfg.logging.trace_every and step % cfg.logging.trace_every == 0:
                steps.save_step_traces(run_dir, step, policy, samples, batch, passes.old, passes.new, rewards,
                                       replayed_logp_BS=passes.replayed_logp_BS, rollout_routes=passes.rollout_routes)
            if info.is_main and cfg.logging.samples_every and step % cfg.logging.samples_every == 0:
                sink.log_samples(sample_rows(step, policy.tokenizer, drawn.prompts, samples, rewards, batch.advantages_B,
                                             rollout_routes=passes.rollout_routes, learner_routes=passes.old.routes,
                                             num_groups=cfg.logging.num_samples))
        with timer("metrics"):
            metrics.update(steps.sample_metrics(rewards, samples, batch.advantages_B, cfg.rollout.samples_per_prompt))
            metrics.update(steps.dial_metrics(samples, cfg.rollout))  # routing/dial_*, when the dial is on
            metrics.update(drawn.metrics)  # sampling/*
            metrics.update(eval_metrics)  # eval/*, on eval steps
            state.step, state.prompts_consumed = step + 1, state.prompts_consumed + drawn.num_prompts_drawn
            state.wall_s = wall_before + time.time() - t_start
            dt = time.time() - t0
            num_tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
            metrics.update({"perf/step_time_s": dt, "perf/learner_s": dt - t_rollout, "perf/tokens_per_s": num_tokens / dt})
            metrics.update(expert_path_metrics(learner.model))  # perf/expert_path_fallback_frac (grouped layout)
        metrics.update(timer.take())
        with timer("log"):  # logged in the next step's row, like the checkpoint
            sink.log(step, metrics)
        if cfg.train.checkpoint_every and state.step % cfg.train.checkpoint_every == 0:
            act(f"checkpoint, step {state.step}")
            with timer("checkpoint"):  # logged in the next step's row
                save_checkpoint(run_dir, state, learner.state_dict(), rank=info.rank,
                                keep=cfg.train.keep_checkpoints, fingerprint=fingerprint(cfg, policy, info))
        bar.set_postfix({"reward": f"{metrics['reward/mean']:.3f}", "entropy": f"{metrics.get('actor/entropy', 0):.3f}",
                         "flip": f"{metrics.get('routing/any_layer_flip', 0):.3f}", "clip": f"{metrics.get('clip/token_frac', 0):.3f}"})
        every = cfg.logging.progress_every  # logging.progress=false: a plain line every N steps instead of the bar
        if (info.is_main and not cfg.logging.progress and every
                and (state.step % every == 0 or state.step == cfg.train.steps)):
            print(f"step {state.step}/{cfg.train.steps}: reward {metrics['reward/mean']:.3f}, entropy "
                  f"{metrics.get('actor/entropy', 0):.3f}, {dt:.2f} s/step", flush=True)
        del drawn, samples, batch, passes  # the step's routes go now, not when the next step rebinds the names
    check_trained(learner, cfg, is_main=info.is_main)  # every optimizer step skipped: an error, no done.json
    act("final evaluation")
    maybe_evaluate(cfg, policy, task, evals, info, sink, state.step, timer=None)  # the final policy: eval.jsonl
    sink.close()
    engine.close()
    act("finishing")
    return finish(cfg, run_dir, info, policy, state)


def finish(cfg: Config, run_dir: Path, info, policy, state) -> dict:
    """Final checkpoint (unless the loop just wrote it), HF export, learning summary, done.json (wall
    time summed over resumed segments)."""
    from moe_gspo.mcore.checkpoint import save_hf_checkpoint
    from moe_gspo.run.checkpoint import latest_checkpoint, save_checkpoint
    from moe_gspo.files import atomic_write_text
    from moe_gspo.run.start import fingerprint

    last = latest_checkpoint(run_dir)
    if last is None or last.name != f"step_{state.step:06d}":
        save_checkpoint(run_dir, state, policy.learner.state_dict(), rank=info.rank,
                        keep=cfg.train.keep_checkpoints, fingerprint=fingerprint(cfg, policy, info))
    if cfg.train.export_hf:
        from moe_gspo.tokenizer import ASSET_DIR

        tok_dir = cfg.model.tokenizer or cfg.model.path or str(ASSET_DIR)
        # streamed one layer at a time to rank 0's host memory (never the whole model on a GPU)
        save_hf_checkpoint(policy.learner.model, policy.hf_config, run_dir / "hf_export", tokenizer_dir=tok_dir)
    summary = {}
    if info.is_main:
        from moe_gspo.rollout.fp8 import rollout_precision

        summary = learning_summary(run_dir / "metrics.jsonl")
        r = cfg.rollout
        done = {"step": state.step, "wall_s": state.wall_s, "segments": state.segments, "summary": summary,
                "rollout": f"{r.engine} engine in {rollout_precision(r.dtype, r.quantization, r.fp8_scale, r.engine, r.fp8_activations)}"}
        atomic_write_text(run_dir / "done.json", json.dumps(done, indent=1))
        print(f"mean reward, first 10% of steps: {summary['reward_first10']:.4f}   "
              f"last 10%: {summary['reward_last10']:.4f}   ({state.step} steps, {state.wall_s:.0f} s)", flush=True)
    return summary


def learning_summary(metrics_path: Path) -> dict:
    rows = [json.loads(l) for l in metrics_path.read_text().splitlines() if l.strip()]
    rewards = [r["reward/mean"] for r in rows]
    k = max(1, len(rewards) // 10)
    return {"num_steps": len(rows), "reward_first10": sum(rewards[:k]) / k, "reward_last10": sum(rewards[-k:]) / k}


def stopped_by_exit(e: SystemExit, run_dir: str) -> str:
    """The one line of a run that code inside it ended with `sys.exit()` / `exit()` (a plug-in: `algo.name`,
    `task.reward`) before it wrote `done.json`."""
    from moe_gspo.plugins import user_frame
    from moe_gspo.run.rundir import resume_hint

    return (f"the run stopped before it finished: code inside it raised SystemExit({e.code!r}) (sys.exit() or "
            f"exit(){user_frame(e)}; a plug-in's, algo.name or task.reward?), so no done.json was written; remove "
            f"that call (raise an exception to stop with an error), then {resume_hint(run_dir)}")


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 done, 2 a user error (one line, printed once), 3 a rank failure, 128 + N
    interrupted by signal N (one line saying how to resume; see `moe_gspo.run.errors`), 1 a bug.
    Everything but `run_entry` (standard library only) is imported inside it, so that a signal during
    the imports is that one line too; the teardown touches only what was imported and initialised."""
    from moe_gspo.run.errors import run_entry

    run_dir: list[str] = []

    def entry() -> int:
        from moe_gspo.run.activity import exit_with_launcher
        from moe_gspo.run.cli import parse_train_args
        from moe_gspo.mcore.shims import transformer_engine_warning  # (importing moe_gspo.mcore runs the guard)
        from moe_gspo.run.errors import warn_once
        from moe_gspo.run.setup import quiet_known_warnings

        quiet_known_warnings()
        if (te := transformer_engine_warning()) is not None:  # an installed TE that cannot be imported: absent
            warn_once(te, is_main=os.environ.get("RANK", "0") == "0")
        exit_with_launcher()  # kill -9 of torchrun must not leave this worker writing
        args, cfg = parse_train_args(argv)  # CLI and config errors: SystemExit(2), printed once
        run_dir.append(args.run_dir)
        try:
            train(cfg, Path(args.run_dir), args.resume, overwrite=args.overwrite,
                  allow_config_change=args.allow_config_change)
        except SystemExit as e:  # sys.exit() in user code (a plug-in): the run did not finish, never exit 0
            raise ValueError(stopped_by_exit(e, args.run_dir)) from None
        return 0

    def how_to_resume() -> str:
        from moe_gspo.run.rundir import resume_hint

        return resume_hint(run_dir[0]) if run_dir else "rerun the same command"

    try:
        return run_entry(entry, how_to_resume=how_to_resume)  # Ctrl-C / SIGTERM: one line, 130 / 143
    finally:
        parallel = sys.modules.get("moe_gspo.mcore.parallel")
        if parallel is not None:
            parallel.destroy_distributed()


if __name__ == "__main__":
    from moe_gspo.run.quick_exit import exit_now

    exit_now(main())  # sys.exit(main()) without the interpreter's teardown of every module (~1.4 s of CPU)
