"""Resumable training checkpoints: model + optimizer (per rank), RNG states, data position, step.

Layout: `RUN_DIR/checkpoints/step_000020/rank_00000.pt` (one file per rank: each EP rank holds
different experts) plus `meta.json`; `RUN_DIR/checkpoints/latest` names the newest complete one.
A checkpoint is written into `step_XXXXXX.tmp/` and renamed only after every rank has written its
file, then `latest` is replaced atomically: a process killed mid-save leaves the previous
checkpoint intact, so at most the step in flight is lost.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from moe_gspo.run.sinks import atomic_write_text


@dataclass(kw_only=True)
class TrainState:
    """What the loop needs besides weights to continue exactly where it stopped."""

    step: int = 0
    """Next step to run."""
    prompts_consumed: int = 0
    """Position in the task's prompt stream."""
    skipped_steps: int = 0
    """Optimizer steps skipped for NaN/Inf so far."""


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(s: dict) -> None:
    torch.set_rng_state(s["torch"])
    np.random.set_state(s["numpy"])
    random.setstate(s["python"])
    if s.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def save_checkpoint(run_dir: Path, state: TrainState, learner_state: dict, *, rank: int, keep: int) -> Path:
    ckpt_root = run_dir / "checkpoints"
    name = f"step_{state.step:06d}"
    final, tmp = ckpt_root / name, ckpt_root / f"{name}.tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    payload = {"learner": learner_state, "rng": rng_state(), "train_state": asdict(state)}
    part = tmp / f".rank_{rank:05d}.pt.part"
    torch.save(payload, part)
    os.replace(part, tmp / f"rank_{rank:05d}.pt")
    _barrier()
    if rank == 0:
        atomic_write_text(tmp / "meta.json", json.dumps({"train_state": asdict(state),
                                                          "world_size": dist.get_world_size() if dist.is_initialized() else 1}))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        atomic_write_text(ckpt_root / "latest", name + "\n")
        done = sorted(p for p in ckpt_root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))
        for old in done[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    pointer = run_dir / "checkpoints" / "latest"
    if not pointer.is_file():
        return None
    path = run_dir / "checkpoints" / pointer.read_text().strip()
    return path if (path / "meta.json").is_file() else None


def load_checkpoint(path: Path, *, rank: int, world_size: int) -> tuple[TrainState, dict, dict]:
    """Returns (train_state, learner_state, rng) for this rank; clear errors for a mismatch."""
    meta = json.loads((path / "meta.json").read_text())
    if meta["world_size"] != world_size:
        raise ValueError(
            f"checkpoint {path} was written by {meta['world_size']} processes, this run has {world_size}; "
            f"resume with the same torchrun --nproc-per-node"
        )
    f = path / f"rank_{rank:05d}.pt"
    if not f.is_file():
        raise ValueError(f"checkpoint {path} lacks {f.name}; it is incomplete — delete it or resume from an older one")
    payload = torch.load(f, map_location="cpu", weights_only=False)
    return TrainState(**payload["train_state"]), payload["learner"], payload["rng"]
