"""Starting, resuming and finishing a training run (used by `moe_gspo.train`).

`start_run` prepares RUN_DIR per the plan `moe_gspo.run.rundir.plan_run_dir` made before any compute
(move a previous run aside for `--overwrite`; resume from the newest intact checkpoint for
`--resume`), writes `config.yaml`, and prints the header. `check_updated_policy` is the NaN/Inf guard
on the weights after an update.
"""

from __future__ import annotations

import json

from pathlib import Path

import torch
import torch.distributed as dist
import yaml

from moe_gspo.config import Config
from moe_gspo.run.checkpoint import (TrainState, gather_objects, agree, checkpoint_candidates, latest_checkpoint, resume,
                                     run_fingerprint)
from moe_gspo.run.resume_rows import keep_damaged, resume_note, scan_rows
from moe_gspo.run.errors import warn_once
from moe_gspo.run.rundir import RunDirPlan, move_contents_aside
from moe_gspo.files import atomic_write_text
from moe_gspo.yaml_limits import load_capped

# Settings a resumed run may change freely (anything else that differs is listed in a note).
_QUIET_CHANGES = ("train.steps", "logging.progress", "logging.progress_every")


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and not prefix:
            out.update(_flat(v, f"{k}."))
        else:
            out[prefix + k] = v
    return out


RESUME_CONFIG = "config.resume-{n}.yaml"
"""The config a resumed segment ran under when it differs from the one before it (`config.yaml` stays the run's
first config): `config.resume-1.yaml`, `-2`, ... in the order they were written."""

EXPERIMENT_KEYS = ("rollout.router_flip_prob", "rollout.router_noise_std", "train.seed", "algo.options")
"""Config keys that define the experiment a run directory holds (the routing-drift dial, the seed, the loss's
options): `--resume` with another value is refused unless `--allow-config-change` (`check_resume_config`).
`algo.name` and `algo.routing_replay` are refused always (the checkpoint's fingerprint names them)."""


def resume_configs(run_dir: Path) -> list[Path]:
    """The run's `config.resume-N.yaml` files, oldest first."""
    found = []
    for p in run_dir.glob("config.resume-*.yaml"):
        n = p.name.removeprefix("config.resume-").removesuffix(".yaml")
        if n.isdigit():
            found.append((int(n), p))
    return [p for _, p in sorted(found)]


def _previous_config(run_dir: Path) -> tuple[dict, str]:
    """The config the run's last segment ran under (flattened) and its file's name: the newest
    `config.resume-N.yaml`, else `config.yaml`; ({}, "") when neither reads."""
    for path in [*reversed(resume_configs(run_dir)), run_dir / "config.yaml"]:
        try:
            data = load_capped(path.read_text(), what=path.name)  # deep or alias-bombed: skipped
        except (OSError, ValueError, yaml.YAMLError, UnicodeDecodeError):
            continue
        if isinstance(data, dict):
            return _flat(data), path.name
    return {}, ""


def check_resume_config(run_dir: Path, cfg: Config, *, allow_config_change: bool) -> None:
    """Before any compute, on `--resume`: a changed `algo.name` / `algo.routing_replay` is refused, and so is a
    changed `EXPERIMENT_KEYS` key unless `allow_config_change` (one ValueError line naming every such key)."""
    prev, source = _previous_config(run_dir)
    now = _flat(cfg.to_dict())
    for key, flag in (("algo.name", "--algo"), ("algo.routing_replay", "--routing-replay")):
        if key in prev and prev[key] != now[key]:
            raise ValueError(f"--resume: this run was trained with {key}={prev[key]} ({source}), this command "
                             f"has {key}={now[key]}; resume with {flag} {prev[key]}, or start a new --run-dir")
    changed = [f"{k}={prev[k]!r} -> {now[k]!r}" for k in EXPERIMENT_KEYS if k in prev and k in now and prev[k] != now[k]]
    if changed and not allow_config_change:
        raise ValueError(f"--resume: this command changes what defines the run's experiment ({', '.join(changed)}; the "
                         f"run ran under {source}); resume with the old value, start a new --run-dir, or pass "
                         "--allow-config-change to continue this run under the new one (the run keeps both configs: "
                         f"config.yaml and config.resume-N.yaml)")


def _write_config(run_dir: Path, cfg: Config, *, resumed_at: int | None, segment: int) -> None:
    """`config.yaml` for a fresh run (or a resume that finds none); on a resume whose config differs from the
    last one the run ran under, a new `config.resume-N.yaml` (temp then rename; `config.yaml` is never
    rewritten, so the run keeps every config it ran under)."""
    text = cfg.to_yaml()
    if resumed_at is None or not (run_dir / "config.yaml").is_file():
        atomic_write_text(run_dir / "config.yaml", text)
        return
    prev, source = _previous_config(run_dir)
    changed = [k for k, v in _flat(cfg.to_dict()).items() if prev.get(k, v) != v or k not in prev]
    if not changed:
        return
    n = len(resume_configs(run_dir)) + 1
    while (run_dir / RESUME_CONFIG.format(n=n)).exists():
        n += 1
    head = (f"# segment {segment}, resumed at step {resumed_at} under this config; it differs from {source} in: "
            f"{', '.join(changed)}\n")
    atomic_write_text(run_dir / RESUME_CONFIG.format(n=n), head + text)


def fingerprint(cfg: Config, policy, info) -> dict:
    from moe_gspo.mcore.grouped_experts import built_expert_layout

    return run_fingerprint(cfg, policy.hf_config, info.world_size,
                           expert_layout=built_expert_layout(policy.learner.model))


def start_run(cfg: Config, plan: RunDirPlan, info, policy, *, resume_asked: bool) -> TrainState | None:
    """The state to continue from, or None when a resumed run has nothing left to do."""
    from moe_gspo.learner.optim import params_finite

    run_dir = plan.path
    err, moved = None, None
    if info.is_main:
        try:
            if plan.mode == "overwrite":
                moved = move_contents_aside(run_dir)  # the lock file (held by this rank) stays
            run_dir.mkdir(parents=True, exist_ok=True)
        except Exception as e:
            err = e
    agree(err, f"preparing {run_dir}")
    _barrier()
    if moved is not None:
        print(f"--overwrite: moved the previous run to {moved}", flush=True)
    state = TrainState()
    if plan.mode == "resume":
        prev, _ = _previous_config(run_dir)
        learner = policy.learner
        rows = gather_objects(scan_rows(run_dir / "metrics.jsonl") if info.is_main else None)[0]  # rank 0's view
        loaded = resume(run_dir, learner=learner, fingerprint=fingerprint(cfg, policy, info),
                        params_finite=lambda: params_finite(learner.model.parameters(), info.device),
                        warn=lambda m: warn_once(m, is_main=info.is_main), max_step=rows.first_missing)
        state = loaded if loaded is not None else state
        _keep_damaged_rows(run_dir, rows, info, resumed=state.step)
        if state.step > cfg.train.steps:
            raise ValueError(f"--resume: the checkpoint is at step {state.step}, past train.steps={cfg.train.steps}; "
                             f"set train.steps={state.step} or more")
        done = run_dir / "done.json"
        if state.step == cfg.train.steps and done.is_file():
            if info.is_main:
                print(f"{run_dir} already finished at step {state.step}; nothing to do "
                      f"(raise train.steps to continue it)", flush=True)
            return None
        changed = [f"{k} {prev[k]!r} -> {v!r}" for k, v in _flat(cfg.to_dict()).items()
                   if k in prev and prev[k] != v and k not in _QUIET_CHANGES]
        if info.is_main:
            if changed:
                print(f"note: resuming with changed settings: {', '.join(changed)}", flush=True)
            if done.is_file():  # continuing a finished run past its end: it is no longer finished
                done.unlink()
    elif resume_asked and info.is_main:
        print(f"--resume: {run_dir} holds no run yet; starting at step 0", flush=True)
    state.segments += 1
    if info.is_main:
        _write_config(run_dir, cfg, resumed_at=state.step if plan.mode == "resume" else None,
                      segment=state.segments)
        from moe_gspo.mcore.model import unwrap

        path = getattr(unwrap(policy.learner.model), "expert_path", None)  # issue 61: no silent slow path
        atomic_write_text(run_dir / "run.json", json.dumps(dict(run_facts(cfg, info), expert_path=path), indent=1))
        print(config_summary(cfg, info, run_dir) if state.step == 0 else f"resuming at step {state.step} from {run_dir}",
              flush=True)
        if path is not None:
            print(f"expert path: {path['line']}", flush=True)
    return state


def _keep_damaged_rows(run_dir: Path, rows, info, *, resumed: int) -> None:
    """After the checkpoint has loaded: the one line about metrics.jsonl's missing or damaged rows, and the
    damaged lines moved to their sidecars (rank 0; `moe_gspo.run.resume_rows`)."""
    err = None
    if info.is_main:
        try:
            candidates = checkpoint_candidates(run_dir)
            newest = int(candidates[0].name.removeprefix("step_")) if candidates else None
            note = resume_note(rows, newest=newest, resumed=resumed)
            keep_damaged(run_dir)
            if note:
                warn_once(note, is_main=True)
        except Exception as e:
            err = e
    agree(err, f"keeping the damaged rows of {run_dir}")


def config_summary(cfg: Config, info, run_dir: Path) -> str:
    """The one line a fresh run prints at start (the whole config is in RUN_DIR/config.yaml)."""
    a, r, t, tr = cfg.algo, cfg.rollout, cfg.task, cfg.train
    model = f"model.path={cfg.model.path}" if cfg.model.path else "the tiny model"
    task = f"task {t.name}" + (f" ({t.path})" if t.path else "") + (f", reward {t.reward}" if t.reward else "")
    return (f"{a.name} + routing replay {a.routing_replay} on {model}, {task}: {tr.steps} steps of "
            f"{r.prompts_per_step} prompts x {r.samples_per_prompt} samples, lr {tr.lr:g}, {r.engine} rollouts, "
            f"{info.world_size} process(es), EP {cfg.parallel.expert_parallel_size}; config: {run_dir / 'config.yaml'}")


def run_facts(cfg: Config, info) -> dict:
    """What the config leaves to the machine, as this segment resolved it (RUN_DIR/run.json, rewritten at
    every start): the learner's parameter dtype, device type and world size, how prompts were encoded
    (task.chat_template, task.system_prompt), library versions."""
    import megatron.core
    import transformers

    from moe_gspo.rollout.fp8 import rollout_precision
    from moe_gspo.run.setup import learner_dtype

    r = cfg.rollout
    return {"learner_dtype": str(learner_dtype(cfg)).removeprefix("torch."), "device": torch.device(info.device).type,
            "world_size": info.world_size, "expert_parallel_size": cfg.parallel.expert_parallel_size,
            "prompt_encoding": {"chat_template": cfg.task.chat_template, "system_prompt": cfg.task.system_prompt},
            "rollout": f"{r.engine} engine in {rollout_precision(r.dtype, r.quantization, r.fp8_scale, r.engine, r.fp8_activations)}",
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                         "megatron-core": megatron.core.__version__}}


SKIPPED_WARN_FRAC = 0.1
"""A finished run whose share of optimizer steps skipped by the NaN/Inf guard (`train/skipped_steps` over all the
optimizer steps it ran, resumed segments included) is above this gets one `warning:` line (docs/runs.md)."""


def check_trained(learner, cfg: Config, *, is_main: bool) -> None:
    """At the end of the step loop (every rank alike: the NaN/Inf guard's skips are agreed on): a run whose every
    optimizer step was skipped trained nothing, a ValueError (exit code 2, no done.json), whatever its length; one
    that skipped more than `SKIPPED_WARN_FRAC` of them gets a warning line."""
    skipped, applied = learner.skipped_steps, learner.num_updates
    total = skipped + applied
    if skipped and not applied:
        raise ValueError(f"nothing was trained: all {skipped} optimizer steps of this run were skipped by the NaN/Inf "
                         f"guard (train/skipped_steps), so the weights are the initial ones and the run is not marked "
                         f"done (no done.json); the loss algo.name={cfg.algo.name} was never finite. Fix the loss (or "
                         "what makes it NaN/Inf: lower train.lr, set train.grad_clip > 0), then rerun with --overwrite")
    if total and skipped / total > SKIPPED_WARN_FRAC:
        warn_once(f"{skipped} of {total} optimizer steps of this run ({skipped / total:.0%}) were skipped by the NaN/Inf "
                  f"guard (train/skipped_steps), more than {SKIPPED_WARN_FRAC:.0%}: the loss algo.name={cfg.algo.name} "
                  "was often not finite, and the run made that many fewer updates", is_main=is_main)


def check_updated_policy(learner, new_logp_BS: torch.Tensor | None, response_mask_BS: torch.Tensor, *, cfg: Config,
                         step: int, run_dir: Path, device) -> None:
    """Stop (ValueError) when an update left the policy non-finite: NaN/Inf weights on any rank, or
    NaN/Inf log-probs of the updated policy on the step's response tokens (finite but overflowing
    weights; only on steps with the post-update pass, see `logging.update_drift_every`). Called before the weight sync and any checkpoint, so such weights never reach the
    rollout engine or disk. A stop, not a restore: snapshotting weights and Adam state before every
    optimizer step would double the learner's memory (about 67 GiB a rank for Qwen3-30B-A3B at EP=8)."""
    from moe_gspo.learner.optim import params_finite

    weights_ok = params_finite(learner.model.parameters(), device)
    logp = new_logp_BS[response_mask_BS.bool()] if new_logp_BS is not None else torch.zeros(0)
    num_bad = int((~torch.isfinite(logp)).sum())
    if weights_ok and num_bad == 0:
        return
    what = ("its weights hold NaN/Inf" if not weights_ok else
            f"its log-probs are NaN/Inf on {num_bad} of {logp.numel()} response tokens: the weights overflow")
    last = latest_checkpoint(run_dir)
    hint = (f"then --resume continues from {last}" if last is not None else
            "no checkpoint was written yet: rerun with --overwrite")
    raise ValueError(f"step {step}: the update made the policy non-finite ({what}); stopped before the rollout "
                     f"engine or a checkpoint received it. Lower train.lr (now {cfg.train.lr:g}) or set "
                     f"train.grad_clip > 0 (now {cfg.train.grad_clip:g}), {hint}")
