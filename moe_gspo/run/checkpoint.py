"""Resumable training checkpoints: model + optimizer (per rank), RNG states, data position, step.

Layout: `RUN_DIR/checkpoints/step_000020/rank_00000.pt` (one file per rank: each EP rank holds
different experts) plus `meta.json` (train state, world size, every rank file's size, and the run's
fingerprint: algorithm, routing replay, process grid, model geometry); `RUN_DIR/checkpoints/latest`
names the newest complete one.

Saving: every rank writes its file into `step_XXXXXX.tmp/` (through a `.part` file, fsynced, renamed);
the ranks agree that all files were written (a full disk or any failure on one rank stops every rank
with one message, and the temporary directory is removed: no half-written files are left); rank 0
writes `meta.json`, renames the directory into place, then replaces `latest` (written last,
atomically). A process killed mid-save leaves the previous checkpoint intact. Rotation keeps the
`keep` newest checkpoints up to the step just written and never touches the one just written (nor
stale higher-numbered ones, which a fallback may have skipped).

Resuming (`resume`): candidates are the checkpoint `latest` names, then older ones, newest first.
Every rank checks a candidate (meta present and readable, its own rank file complete and loadable,
weights finite) and the ranks agree; an unusable candidate is skipped with a one-line warning naming
the reason, and an incompatible run (another algorithm, routing replay, world size, EP size or model
geometry) stops with an error naming both values. `max_step` leaves out the checkpoints past the first step
whose metrics row is missing (`moe_gspo.run.resume_rows`). Only once a checkpoint has loaded does the caller
drop later metrics rows. No intact checkpoint: an error, never a silent restart from step 0.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from moe_gspo.files import atomic_write_text, writing
from moe_gspo.run.errors import RankFailure, user_message

META = "meta.json"
_STEP_RE = re.compile(r"^step_(\d+)$")
# Qwen3-MoE config fields that fix the shapes of the weights a checkpoint holds.
GEOMETRY_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "num_experts", "num_experts_per_tok",
                 "decoder_sparse_step", "mlp_only_layers", "tie_word_embeddings")
# Fingerprint entries that must match to resume, with how to restore them.
_MUST_MATCH = {"algo.name": "--algo", "algo.routing_replay": "--routing-replay",
               "world_size": "torchrun --nproc-per-node", "parallel.expert_parallel_size": "parallel.expert_parallel_size",
               "model.expert_layout": "model.expert_layout; its parameters and optimizer state are named per layout"}


@dataclass(kw_only=True)
class TrainState:
    """What the loop needs besides weights to continue exactly where it stopped."""

    step: int = 0
    """Next step to run."""
    prompts_consumed: int = 0
    """Position in the task's prompt stream."""
    skipped_steps: int = 0
    """Optimizer steps skipped for NaN/Inf so far."""
    wall_s: float = 0.0
    """Wall time spent training up to `step`, summed over resumed segments (time of steps lost to a
    kill and recomputed after the resume is not counted)."""
    segments: int = 0
    """Number of runs (the first one and each resume) that contributed to this state."""


def rng_state() -> dict:
    """The RNG states as tensors and plain Python data only (so `torch.load(weights_only=True)` reads
    them): numpy's MT19937 key array is stored as an int64 tensor."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"torch": torch.get_rng_state(), "numpy": (name, torch.from_numpy(keys.astype(np.int64)), int(pos),
                                                       int(has_gauss), float(gauss)),
            "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(s: dict) -> None:
    torch.set_rng_state(s["torch"])
    name, keys, *rest = s["numpy"]
    keys = keys.numpy() if isinstance(keys, torch.Tensor) else np.asarray(keys)
    np.random.set_state((name, keys.astype(np.uint32), *rest))
    random.setstate(s["python"])
    if s.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gather_objects(obj: Any) -> list[Any]:
    """`obj` of every rank, in rank order (`[obj]` at world size 1)."""
    rank, world = _world()
    if world == 1:
        return [obj]
    out: list = [None] * world
    dist.all_gather_object(out, obj)
    return out


def agree(local: BaseException | None, what: str) -> None:
    """Every rank learns whether any rank failed `what`; then all raise the same error (the failing
    rank its own exception, the others a ValueError / RankFailure with the same message), so no rank
    is left waiting in a later collective."""
    known = None if local is None else (user_message(local) or (1, f"{type(local).__name__}: {local}"))
    failures = [(r, m) for r, m in enumerate(gather_objects(known)) if m is not None]
    if not failures:
        return
    if local is not None:
        raise local
    r, (code, text) = failures[0]
    if code == 2:
        raise ValueError(text)
    raise RankFailure(f"rank {r} failed while {what}: {text}")


def run_fingerprint(cfg, hf_config, world_size: int, *, expert_layout: str) -> dict:
    """What must stay the same for a checkpoint to resume this run (stored in meta.json). `expert_layout`:
    the layout the learner built (`model.expert_layout` resolved on this machine: `auto` differs between a
    CPU and an sm90 GPU)."""
    def plain(v):
        return list(v) if isinstance(v, (list, tuple)) else v

    return {"algo.name": cfg.algo.name, "algo.routing_replay": cfg.algo.routing_replay, "world_size": world_size,
            "parallel.expert_parallel_size": cfg.parallel.expert_parallel_size, "model.expert_layout": expert_layout,
            "model": {k: plain(getattr(hf_config, k, None)) for k in GEOMETRY_KEYS}}


def step_dirs(run_dir: Path) -> dict[int, Path]:
    """step -> directory of every renamed-into-place checkpoint (complete or not)."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return {}
    out = {}
    for p in root.iterdir():
        m = _STEP_RE.match(p.name)
        if m and p.is_dir():
            out[int(m.group(1))] = p
    return out


def _latest_name(run_dir: Path) -> str | None:
    try:
        return (run_dir / "checkpoints" / "latest").read_text().strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def checkpoint_candidates(run_dir: Path) -> list[Path]:
    """Checkpoints to try when resuming: the one `latest` names, then older ones, newest first.
    Checkpoints newer than `latest` are leftovers of an abandoned attempt and are not tried."""
    dirs = step_dirs(run_dir)
    name = _latest_name(run_dir)
    m = _STEP_RE.match(name or "")
    if m:
        top = int(m.group(1))
        head = [dirs[top]] if top in dirs else []
        return head + [dirs[s] for s in sorted(dirs, reverse=True) if s < top]
    return [dirs[s] for s in sorted(dirs, reverse=True)]


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint `latest` names, if it exists and has its meta.json (no validation of rank files)."""
    cands = checkpoint_candidates(run_dir)
    return cands[0] if cands and (cands[0] / META).is_file() else None


def _rotate(root: Path, current_step: int, keep: int) -> None:
    steps = sorted(s for s in step_dirs(root.parent) if s <= current_step)
    for s in steps[:-keep]:
        if s != current_step:
            shutil.rmtree(root / f"step_{s:06d}", ignore_errors=True)


def _write_rank_file(path: Path, payload: dict) -> int:
    part = path.with_name(f".{path.name}.part")
    try:
        with writing(path, "checkpoint file"):
            with open(part, "wb") as f:  # a file object: a full disk raises OSError(ENOSPC), not a C++ enforce
                torch.save(payload, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(part, path)
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    return path.stat().st_size


def save_checkpoint(run_dir: Path, state: TrainState, learner_state: dict, *, rank: int, keep: int,
                    fingerprint: dict | None = None) -> Path:
    """Write checkpoint `step_{state.step}` (every rank calls this; see the module docstring)."""
    ckpt_root = run_dir / "checkpoints"
    name = f"step_{state.step:06d}"
    final, tmp = ckpt_root / name, ckpt_root / f"{name}.tmp"
    _, world = _world()
    err = None
    if rank == 0:
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            with writing(tmp, "checkpoint directory"):
                tmp.mkdir(parents=True)
        except Exception as e:
            err = e
    agree(err, f"creating {tmp}")
    err, size = None, None
    payload = {"learner": learner_state, "rng": rng_state(), "train_state": asdict(state)}
    try:
        size = _write_rank_file(tmp / f"rank_{rank:05d}.pt", payload)
    except Exception as e:
        err = e
    sizes = gather_objects(size)
    try:
        agree(err, f"writing checkpoint {name}")
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    err = None
    if rank == 0:
        try:
            meta = {"train_state": asdict(state), "world_size": world,
                    "rank_files": {f"rank_{r:05d}.pt": s for r, s in enumerate(sizes)}, "fingerprint": fingerprint}
            with writing(tmp / META, "checkpoint meta"):
                atomic_write_text(tmp / META, json.dumps(meta, indent=1))
            if final.exists():  # the same step saved again: swap, never leave `latest` dangling
                trash = Path(tempfile.mkdtemp(prefix=f".{name}.old-", dir=ckpt_root))
                os.replace(final, trash / name)
                os.replace(tmp, final)
                shutil.rmtree(trash, ignore_errors=True)
            else:
                os.replace(tmp, final)
            with writing(ckpt_root / "latest", "checkpoint pointer"):
                atomic_write_text(ckpt_root / "latest", name + "\n")
            _rotate(ckpt_root, state.step, keep)
        except Exception as e:
            shutil.rmtree(tmp, ignore_errors=True)
            err = e
    agree(err, f"finishing checkpoint {name}")
    return final


# --------------------------------------------------------------------------- resume

def _incompatibility(path: Path, saved: dict | None, current: dict) -> str | None:
    """A message when the checkpoint's fingerprint differs from this run's in a way that cannot resume."""
    if not saved:
        return None  # written before fingerprints: the weight shapes are checked on load
    for key, how in _MUST_MATCH.items():
        if key in saved and saved[key] != current[key]:
            return (f"--resume: checkpoint {str(path)!r} was written with {key}={saved[key]}, this run has "
                    f"{key}={current[key]}; resume with the same value ({how}) or start a new --run-dir")
    old, new = saved.get("model") or {}, current["model"]
    diff = [f"{k} {old[k]} -> {new[k]}" for k in GEOMETRY_KEYS if k in old and old[k] != new[k]]
    if diff:
        return (f"--resume: checkpoint {str(path)!r} holds another model geometry ({', '.join(diff)}); resume "
                f"with the model it was trained from (model.path / model.tiny) or start a new --run-dir")
    return None


class UnsafeCheckpoint(ValueError):
    """A checkpoint file whose pickle names something other than tensors and plain data: loading it
    would run code. Refused outright (never skipped for an older checkpoint)."""


# numpy arrays of plain dtypes: checkpoints written before the RNG state was stored as tensors hold
# numpy's MT19937 key array. Rebuilding one runs no code of the file's choosing.
_NUMPY_SAFE = [np.ndarray, np.dtype, type(np.dtype(np.uint32))]
try:
    _NUMPY_SAFE.append(np._core.multiarray._reconstruct)
except AttributeError:  # numpy < 2
    _NUMPY_SAFE.append(np.core.multiarray._reconstruct)


def safe_load(path: Path) -> Any:
    """`torch.load(path, weights_only=True)` on the CPU, allowing numpy arrays of plain dtypes too.
    Raises `UnsafeCheckpoint` (a ValueError naming the file and what it would have run) when the file
    names any other global (a crafted or foreign pickle); other failures (truncated, corrupt) propagate."""
    import pickle

    try:
        with torch.serialization.safe_globals(_NUMPY_SAFE):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        text = str(e)
        if "GLOBAL" not in text:  # a corrupt pickle stream: an unreadable file, not a foreign one
            raise
        what = next((l.strip() for l in text.splitlines() if "GLOBAL" in l), "")
        what = what.split(" Please")[0][:160]
        raise UnsafeCheckpoint(
            f"--resume: {str(path)!r} is not a checkpoint this program wrote: loading it would run code "
            f"({what or 'a pickled object other than tensors and plain data'}); refused. Remove that checkpoint "
            f"directory if you trust none of it, or start afresh with --overwrite") from None


def _read_candidate(path: Path, rank: int) -> tuple[str | None, dict | None, dict | None]:
    """(problem, meta, payload) for this rank's part of checkpoint `path`; problem None when usable."""
    try:
        meta = json.loads((path / META).read_text())
        assert isinstance(meta, dict) and "train_state" in meta
    except FileNotFoundError:
        return f"{META} is missing (the save did not finish)", None, None
    except (OSError, ValueError, AssertionError) as e:
        return f"{META} is unreadable ({type(e).__name__})", None, None
    f = path / f"rank_{rank:05d}.pt"
    if not f.is_file():
        return f"{f.name} is missing", meta, None
    expected = (meta.get("rank_files") or {}).get(f.name)
    if expected is not None and f.stat().st_size != expected:
        return f"{f.name} is truncated ({f.stat().st_size} of {expected} bytes)", meta, None
    try:
        payload = safe_load(f)
    except UnsafeCheckpoint:
        raise
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return f"{f.name} is unreadable, truncated or corrupt ({first[:120]})", meta, None
    try:
        assert isinstance(payload, dict) and {"learner", "rng", "train_state"} <= set(payload)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return f"{f.name} is unreadable, truncated or corrupt ({first[:120]})", meta, None
    return None, meta, payload


def resume(run_dir: Path, *, learner, fingerprint: dict, params_finite: Callable[[], bool],
           warn: Callable[[str], None], max_step: int | None = None) -> TrainState | None:
    """Load the newest intact checkpoint of `run_dir` into `learner` and the RNGs (every rank).

    Returns its `TrainState`, or None when the run directory has no checkpoint at all, or none at or before
    `max_step` (the first step whose metrics row is missing, `moe_gspo.run.resume_rows`: the run then starts
    again from the initial policy). Raises ValueError for an incompatible run or when no candidate is intact
    (see the module docstring). `params_finite()` (collective) checks the loaded weights; `warn` prints one
    line on rank 0.
    """
    rank, world = _world()
    candidates = checkpoint_candidates(run_dir)
    if candidates and max_step is not None:
        candidates = [p for p in candidates if int(_STEP_RE.match(p.name).group(1)) <= max_step]
        if not candidates:
            return None
    if not candidates:
        dirs = step_dirs(run_dir)
        if not dirs:
            return None
        raise ValueError(f"--resume: {str(run_dir / 'checkpoints' / 'latest')!r} names {_latest_name(run_dir)}, which "
                         f"does not exist, and the other checkpoints ({', '.join(p.name for p in dirs.values())}) are "
                         f"newer than it: leftovers of an earlier run. Move them away, or start afresh with --overwrite")
    rejected = []
    for i, path in enumerate(candidates):
        try:
            problem, meta, payload = _read_candidate(path, rank)
        except UnsafeCheckpoint as e:  # never skipped for an older checkpoint: every rank stops
            problem, meta, payload = None, None, None
            unsafe = str(e)
        else:
            unsafe = None
        unsafe_all = [u for u in gather_objects(unsafe) if u is not None]
        if unsafe_all:
            raise ValueError(unsafe_all[0])
        if meta is not None:
            if meta.get("world_size", world) != world:
                raise ValueError(f"--resume: checkpoint {str(path)!r} was written by {meta['world_size']} processes, "
                                 f"this run has {world}; resume with torchrun --nproc-per-node {meta['world_size']}")
            incompatible = _incompatibility(path, meta.get("fingerprint"), fingerprint)
            if incompatible:
                raise ValueError(incompatible)
        if problem is None:
            try:
                learner.load_state_dict(payload["learner"])
            except (RuntimeError, KeyError, ValueError) as e:
                first = str(e).strip().splitlines()
                problem = (f"rank_{rank:05d}.pt does not fit this model ({' '.join(first[:2])[:200]}); it was "
                           f"written for another model geometry or code version")
        problems = [(r, p) for r, p in enumerate(gather_objects(problem)) if p is not None]
        if not problems and not params_finite():
            problems = [(None, "its weights contain NaN/Inf (bit rot or a diverged run)")]
        if not problems:
            set_rng_state(payload["rng"])
            fields = {f.name for f in dataclasses.fields(TrainState)}
            state = TrainState(**{k: v for k, v in payload["train_state"].items() if k in fields})
            if rejected:
                warn(f"resuming from {path.name} (step {state.step}) instead: {'; '.join(rejected)}")
            return state
        r, why = problems[0]
        rejected.append(f"{path.name} is unusable: {why}" + ("" if r is None or world == 1 else f" (rank {r})"))
        payload = None
    raise ValueError(f"--resume: no intact checkpoint in {str(run_dir / 'checkpoints')!r}: {'; '.join(rejected)}. "
                     f"Start afresh with --overwrite (the old run directory is moved aside) or another --run-dir")
