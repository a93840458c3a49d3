"""File modes of atomically written files: the mode a plain `open()` / `mkdir()` would have given.

The atomic writers (a temporary sibling, then `os.replace`) create their temporaries with private
modes: `tempfile.mkstemp` 0600, `tempfile.mkdtemp` 0700, and safetensors' `save_file` 0600 too. Renamed
into the run directory they would stay unreadable to the other users of a shared filesystem, next to
files at 0644. `publish_mode(tmp)` gives a temporary, before its rename, what `open()` (0o666) or
`mkdir()` (0o777) would give under this process's umask. Used by `moe_gspo.routing.trace.save_trace`
and `moe_gspo.mcore.checkpoint.save_hf_checkpoint`; `moe_gspo.run.sinks.atomic_write_text` and the
training checkpoints' rank files write through a plain `open()` and need nothing.
"""

from __future__ import annotations

import os
from pathlib import Path


def current_umask() -> int:
    """This process's umask, read without changing it where Linux says it (`/proc/self/status`); else
    set and restored at once (`os.umask` has no read-only form)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def default_mode(*, directory: bool = False) -> int:
    """The mode `open(path, "w")` (or `mkdir`, with `directory`) gives a new file here: 0o666 (0o777)
    less the umask."""
    return (0o777 if directory else 0o666) & ~current_umask()


def publish_mode(path: str | os.PathLike, *, recursive: bool = False) -> None:
    """Give `path` (with `recursive`: a directory and everything under it) the mode of `default_mode`.

    Best effort: a filesystem that refuses `chmod` (some network mounts with fixed modes) leaves the
    modes it imposes; the write itself has succeeded."""
    path = Path(path)
    file_mode, dir_mode = default_mode(), default_mode(directory=True)
    todo = [path]
    if recursive and path.is_dir():
        todo += sorted(path.rglob("*"))
    for p in todo:
        if p.is_symlink():
            continue
        try:
            os.chmod(p, dir_mode if p.is_dir() else file_mode)
        except (OSError, NotImplementedError):
            pass
