"""Output paths, checked before any compute: a run's data is never overwritten without a flag.

A run directory "holds a run" when it contains any output `moe_gspo.train` writes (`RUN_OUTPUTS`);
other files (an ablation's `train.log`, notes) do not count and are never touched. For train:
- absent, empty, or holding no run output: a fresh run starts at step 0;
- holding a run, without `--resume` or `--overwrite`: refused, naming both flags; nothing changes;
- `--resume`: continue from the newest intact checkpoint (`moe_gspo.run.checkpoint.resume`); a
  directory that holds a run but no checkpoint at all is refused (nothing to continue from);
- `--overwrite`: the whole directory is first moved aside to `RUN_DIR.prev<k>` (nothing is deleted),
  then a fresh run starts.
Every rank makes the same decision from the same files before `torch.distributed` starts; rank 0 then
moves the directory aside (`apply`) while the others wait at a barrier.

Multi-node: every rank must see the same directory (RUN_DIR on a filesystem every node mounts, at the
same path). `check_same_run_dir` checks that at start-up, right after `torch.distributed` starts:
rank 0 writes a random token into RUN_DIR, every rank reads it back, and a rank that cannot stops the
run on every rank with one line naming the fix (exit code 2).
"""

from __future__ import annotations

import os
import secrets
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

RUN_OUTPUTS = ("metrics.jsonl", "done.json", "config.yaml", "run.json", "eval.jsonl", "samples.jsonl", "checkpoints",
               "hf_export", "traces", "wandb")


def _ancestors_ok(path: Path, flag: str) -> None:
    """Every existing ancestor of `path` is a directory and the nearest one is writable."""
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"{flag}={str(path)!r}: {str(parent)!r} is a file, not a directory; "
                                 "choose another path")
            if not os.access(parent, os.W_OK | os.X_OK):
                raise ValueError(f"{flag}={str(path)!r}: cannot create it, {str(parent)!r} is not writable; "
                                 "choose another path")
            return


def check_output_dir(path: str | os.PathLike, flag: str) -> Path:
    """`path` is a writable directory or can be created; raises ValueError naming `flag`."""
    p = Path(path)
    if p.exists():
        if not p.is_dir():
            raise ValueError(f"{flag}={str(p)!r} is a file, not a directory; choose another path")
        if not os.access(p, os.W_OK | os.X_OK):
            raise ValueError(f"{flag}={str(p)!r} is not writable; choose another path or fix its permissions")
        return p
    _ancestors_ok(p, flag)
    return p


def check_output_file(path: str | os.PathLike, flag: str) -> Path:
    """`path` can be written as a file (its directory exists or can be created; it is not a
    directory); raises ValueError naming `flag`."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{flag}={str(p)!r} is a directory; give a file path such as {str(p / 'drift.json')!r}")
    if p.exists() and not os.access(p, os.W_OK):
        raise ValueError(f"{flag}={str(p)!r} is not writable; choose another path or fix its permissions")
    if p.parent.exists():
        check_output_dir(p.parent, flag)
    else:
        _ancestors_ok(p, flag)
    return p


def run_outputs(run_dir: Path) -> list[str]:
    """The names of `RUN_OUTPUTS` present in `run_dir`."""
    return [n for n in RUN_OUTPUTS if (run_dir / n).exists()]


def has_checkpoint_dirs(run_dir: Path) -> bool:
    root = run_dir / "checkpoints"
    return root.is_dir() and any(p.is_dir() and p.name.startswith("step_") and not p.name.endswith(".tmp")
                                 for p in root.iterdir())


@dataclass(frozen=True, kw_only=True)
class RunDirPlan:
    path: Path
    mode: Literal["fresh", "resume", "overwrite"]
    """fresh: nothing to keep; resume: continue from a checkpoint; overwrite: move aside, then fresh."""


def plan_run_dir(run_dir: str | os.PathLike, *, resume: bool, overwrite: bool) -> RunDirPlan:
    """Decide what to do with `run_dir` (see the module docstring); raises ValueError. Touches nothing."""
    p = check_output_dir(run_dir, "--run-dir")
    if resume and overwrite:
        raise ValueError("--resume continues the run in --run-dir and --overwrite moves it aside to start "
                         "afresh; give one of them")
    outputs = run_outputs(p) if p.is_dir() else []
    if not outputs:
        return RunDirPlan(path=p, mode="fresh")
    if overwrite:
        return RunDirPlan(path=p, mode="overwrite")
    if resume:
        if not has_checkpoint_dirs(p):
            raise ValueError(f"--resume: {str(p)!r} holds a run ({', '.join(outputs)}) but no checkpoint to "
                             f"continue from; rerun with --overwrite to start afresh (the old directory is moved "
                             f"to {p.name}.prev<k>) or choose another --run-dir")
        return RunDirPlan(path=p, mode="resume")
    finished = " finished" if (p / "done.json").is_file() else ""
    raise ValueError(f"--run-dir {str(p)!r} already holds a{finished} run ({', '.join(outputs)}); pass --resume "
                     f"to continue it, --overwrite to start afresh (the old directory is moved to "
                     f"{p.name}.prev<k>, nothing is deleted), or choose another --run-dir")


def move_aside(path: Path) -> Path:
    """Rename `path` to the first free `path.prev<k>` (k = 1, 2, ...); returns the new path."""
    k = 1
    while path.with_name(f"{path.name}.prev{k}").exists():
        k += 1
    target = path.with_name(f"{path.name}.prev{k}")
    os.replace(path, target)
    return target


SHARED_TOKEN = ".moe_gspo_shared_check"
"""The file `check_same_run_dir` writes into RUN_DIR for a moment (never one of `RUN_OUTPUTS`)."""


def check_same_run_dir(plan: RunDirPlan, *, rank: int, world_size: int) -> None:
    """Every rank sees the run directory rank 0 writes to (see the module docstring); raises the same
    ValueError on every rank when one does not. Collective: call it on every rank, after
    `torch.distributed` is initialised. Rank 0 creates RUN_DIR if needed and removes its token."""
    if world_size == 1:
        return
    import torch.distributed as dist

    path = plan.path
    token_file = path / SHARED_TOKEN
    sent: list = [None, None, None]
    if rank == 0:
        token = secrets.token_hex(16)
        try:
            path.mkdir(parents=True, exist_ok=True)
            token_file.write_text(token)
            sent = [token, None, socket.gethostname()]
        except OSError as e:
            sent = [None, f"{type(e).__name__}: {e}", socket.gethostname()]
    dist.broadcast_object_list(sent, src=0)
    token, rank0_error, rank0_host = sent
    if rank0_error is not None:
        raise ValueError(f"--run-dir {str(path)!r}: rank 0 cannot write there ({rank0_error}); choose another path "
                         "or fix its permissions")
    try:
        seen = token_file.read_text() == token
    except OSError:
        seen = False
    views: list = [None] * world_size
    dist.all_gather_object(views, (seen, socket.gethostname(), str(path.resolve())))
    if rank == 0:
        token_file.unlink(missing_ok=True)
    blind = [r for r, (ok, _, _) in enumerate(views) if not ok]
    if blind:
        where = ", ".join(f"rank {r} on {views[r][1]} at {views[r][2]}" for r in blind[:4])
        raise ValueError(
            f"--run-dir {str(path)!r} is not the same directory on every rank: {where} cannot see the file rank 0 "
            f"(on {rank0_host}) wrote to {views[0][2]}. Put RUN_DIR on a filesystem every node mounts at the same "
            "path (NFS, Lustre, ...) and pass that absolute path as --run-dir on every node (docs/multinode.md)")


def resume_hint(run_dir: str | os.PathLike) -> str:
    """How to continue an interrupted training run in `run_dir` (for the one line it ends with)."""
    from moe_gspo.run.checkpoint import latest_checkpoint

    p = Path(run_dir)
    last = latest_checkpoint(p) if p.is_dir() else None
    if last is not None:
        return f"rerun the same command with --resume to continue from its newest checkpoint, {last}"
    if p.is_dir() and run_outputs(p):
        return (f"{p} holds no checkpoint yet (train.checkpoint_every sets how often one is written): rerun the same "
                "command with --overwrite to start afresh (the old directory is moved aside)")
    return "nothing was written yet: rerun the same command"
