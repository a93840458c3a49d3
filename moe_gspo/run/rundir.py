"""Output paths, checked before any compute: a run's data is never overwritten without a flag.

A run directory "holds a run" when it contains any output `moe_gspo.train` writes (`RUN_OUTPUTS`);
other files (an ablation's `train.log`, notes) do not count and are never touched. For train:
- absent, empty, or holding no run output: a fresh run starts at step 0;
- holding a run, without `--resume` or `--overwrite`: refused, naming both flags; nothing changes;
- `--resume`: continue from the newest intact checkpoint (`moe_gspo.run.checkpoint.resume`); a
  directory that holds a run but no checkpoint at all is refused (nothing to continue from);
- `--overwrite`: everything in the directory is first moved aside to `RUN_DIR.prev<k>` (nothing is
  deleted; the lock file stays), then a fresh run starts.
Every rank makes the same decision from the same files before `torch.distributed` starts; rank 0 then
takes the directory's lock (`lock_dir`, held for the whole run, so a second run started on the same
directory stops with one line and exit code 2, whatever its flags), re-checks the decision under the
lock, and moves the old run aside while the others wait at a barrier.

Multi-node: every rank must see the same directory (RUN_DIR on a filesystem every node mounts, at the
same path). `check_same_run_dir` checks that at start-up, right after `torch.distributed` starts:
rank 0 writes a random token into RUN_DIR, every rank reads it back, and a rank that cannot stops the
run on every rank with one line naming the fix (exit code 2).
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from moe_gspo.files import atomic_write_text, check_output_dir, writing

RUN_OUTPUTS = ("metrics.jsonl", "done.json", "config.yaml", "run.json", "eval.jsonl", "samples.jsonl", "checkpoints",
               "hf_export", "traces", "wandb")


LOCK_FILE = ".moe_gspo.lock"
"""The lock file a running `train` (rank 0) or `ablate` holds in its output directory for its whole life
(`fcntl.flock`, exclusive; never one of `RUN_OUTPUTS`). It records the holder's pid, host and command.
The kernel releases the lock when the holder dies (even by SIGKILL), so a lock file left behind by a
dead process is free: it is taken over, and only its recorded holder is mentioned in messages."""


def _lock_record(path: Path) -> str:
    try:
        info = json.loads((path / LOCK_FILE).read_text() or "{}")
        return f"pid {info.get('pid')} on host {info.get('host')} (started {info.get('started')})"
    except (OSError, ValueError, AttributeError):
        return "a process that did not record itself"


def lock_state(path: str | os.PathLike) -> tuple[str, str] | None:
    """None when `path` holds no lock file; else ("held" | "free", who the file names). "free" means
    the process that wrote it is gone (the kernel released its lock). Probes with a non-blocking shared
    lock, released at once."""
    p = Path(path) / LOCK_FILE
    try:
        fd = os.open(p, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return "held", _lock_record(p.parent)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return "free", _lock_record(p.parent)
    finally:
        os.close(fd)


class DirLock:
    """An exclusive lock on a directory (`LOCK_FILE` in it), held until `release()` or process exit."""

    def __init__(self, path: Path, fd: int):
        self.path, self._fd = path, fd

    def release(self) -> None:
        if self._fd is not None:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            finally:
                os.close(self._fd)
                self._fd = None

    def __enter__(self) -> "DirLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def lock_dir(path: str | os.PathLike, flag: str, *, wait_s: float = 1.0) -> DirLock:
    """Take the exclusive lock of output directory `path` (created if needed), recording this process
    (pid, host, start time, command) in it. Raises ValueError naming `flag` and the holder when another
    live process holds it (retrying for `wait_s` first, so a brief probe by `lock_state` never refuses
    a run)."""
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    fd = os.open(p / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() < deadline:
                time.sleep(0.05)
                continue
            who = _lock_record(p)
            os.close(fd)
            raise ValueError(f"{flag} {str(p)!r} is in use by another run ({who}, lock file {LOCK_FILE}); wait "
                             f"for it to end or choose another {flag}")
        except BaseException:
            os.close(fd)
            raise
    record = {"pid": os.getpid(), "host": socket.gethostname(),
              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": " ".join(sys.argv)}
    try:  # into the locked file itself (a rename would lose the lock): a full disk is a user error naming it
        with writing(p / LOCK_FILE, "run-directory lock record"):
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(record).encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    return DirLock(p, fd)


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


def plan_run_dir(run_dir: str | os.PathLike, *, resume: bool, overwrite: bool, check_lock: bool = True) -> RunDirPlan:
    """Decide what to do with `run_dir` (see the module docstring); raises ValueError. Touches nothing.
    A directory another live run holds locked (`LOCK_FILE`) is refused outright, even with --resume or
    --overwrite; `check_lock=False` when this process holds the lock itself."""
    p = check_output_dir(run_dir, "--run-dir")
    if resume and overwrite:
        raise ValueError("--resume continues the run in --run-dir and --overwrite moves it aside to start "
                         "afresh; give one of them")
    outputs = run_outputs(p) if p.is_dir() else []
    if not outputs:
        return RunDirPlan(path=p, mode="fresh")
    if check_lock and (lock := lock_state(p)) is not None and lock[0] == "held":
        raise ValueError(f"--run-dir {str(p)!r} is in use by a running run ({lock[1]}); wait for it to end or "
                         f"choose another --run-dir (--resume and --overwrite are refused while it runs)")
    if overwrite:
        return RunDirPlan(path=p, mode="overwrite")
    if resume:
        if not has_checkpoint_dirs(p):
            raise ValueError(f"--resume: {str(p)!r} holds a run ({', '.join(outputs)}) but no checkpoint to "
                             f"continue from; rerun with --overwrite to start afresh (the old directory is moved "
                             f"to {p.name}.prev<k>) or choose another --run-dir")
        return RunDirPlan(path=p, mode="resume")
    finished = " finished" if (p / "done.json").is_file() else ""
    lock = lock_state(p) if check_lock else None
    if lock is not None and lock[0] == "held":
        raise ValueError(f"--run-dir {str(p)!r} is in use by a running run ({lock[1]}); wait for it to end or "
                         f"choose another --run-dir")
    dead = "" if lock is None else f"; its last process, {lock[1]}, is no longer running (the lock it left is free)"
    raise ValueError(f"--run-dir {str(p)!r} already holds a{finished} run ({', '.join(outputs)}){dead}; pass --resume "
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


def move_contents_aside(path: Path, keep: tuple[str, ...] = (LOCK_FILE,)) -> Path:
    """Move everything in `path` but the names in `keep` into the first free `path.prev<k>` (k = 1, 2,
    ...), so `path` itself, and the lock held on its `LOCK_FILE`, stay; returns the new directory."""
    k = 1
    while path.with_name(f"{path.name}.prev{k}").exists():
        k += 1
    target = path.with_name(f"{path.name}.prev{k}")
    target.mkdir()
    for entry in path.iterdir():
        if entry.name not in keep:
            os.replace(entry, target / entry.name)
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
            atomic_write_text(token_file, token)
            sent = [token, None, socket.gethostname()]
        except (OSError, ValueError) as e:  # ValueError: a full disk (files.writing), sent to every rank
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
