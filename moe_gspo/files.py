"""Writing files safely, the ground floor every layer writes through: atomic writes with the modes a plain
`open()` gives, a full disk reported as a user error naming the file, and output paths checked before any
compute. Imports nothing from `moe_gspo` (docs/architecture.md, layers). Appends cannot be atomic: the
metrics rows (`moe_gspo.run.sinks.append_jsonl_line`, under `writing`) and an ablation arm's train.log
(`moe_gspo.run.arm_runner`) are appended by their own modules.

- Atomic writes (a temporary sibling, then `os.replace`): `atomic_write_text` for text; the routing
  traces (`moe_gspo.routing.trace.save_trace`) and the HF export (`moe_gspo.mcore.checkpoint`) write
  their own temporaries and give them `publish_mode` before the rename.
- File modes: the temporaries' private modes (`tempfile.mkstemp` 0600, `tempfile.mkdtemp` 0700,
  safetensors' `save_file` 0600 too) would stay unreadable to the other users of a shared filesystem,
  next to files at 0644. `publish_mode(tmp)` gives a temporary, before its rename, what `open()`
  (0o666) or `mkdir()` (0o777) would give under this process's umask. `atomic_write_text` and the
  training checkpoints' rank files write through a plain `open()` and need nothing.
- A full disk: `writing(path, what)` turns it into a ValueError naming `path` (exit code 2 at the entry
  points, `moe_gspo.run.errors`); `is_disk_full` recognises it, also when reported as text.
- Output paths: `check_output_dir` / `check_output_file` refuse a path that cannot be written, naming
  the flag, before any compute.
"""

from __future__ import annotations

import errno
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

# ----------------------------------------------------------------------------------------------- file modes


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


# ----------------------------------------------------------------------------------------------- a full disk

_DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_DISK_FULL_TEXT = ("No space left on device", "os error 28", "Disk quota exceeded", "os error 122")


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def is_disk_full(exc: BaseException) -> bool:
    """True when `exc` (or what caused it) is an out-of-space error: `OSError` ENOSPC/EDQUOT, or the
    same reported as text by safetensors / torch's C++ writers."""
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in _DISK_FULL_ERRNOS:
            return True
        if any(t in str(e) for t in _DISK_FULL_TEXT):
            return True
    return False


def disk_full_message(path: str | os.PathLike, what: str, *, outcome: str | None = "the partial file was removed") -> str:
    """The one line of a full disk while writing `path`; `outcome`: what became of the file (None where the
    caller does not know, e.g. an error classified far from its writer: then the line says nothing of it)."""
    where = Path(path)
    probe = where if where.exists() else where.parent
    free = ""
    try:
        import shutil

        free = f" ({shutil.disk_usage(probe).free / 2**20:.1f} MiB free there)"
    except OSError:
        pass
    return (f"disk full while writing {what} {str(where)!r}{free}: No space left on device; free space "
            f"or choose another directory" + (f" ({outcome})" if outcome else ""))


@contextmanager
def writing(path: str | os.PathLike, what: str) -> Iterator[None]:
    """Turn a full disk while writing `path` into a ValueError naming it (the caller removes its
    temporary file)."""
    try:
        yield
    except Exception as e:
        if is_disk_full(e):
            raise ValueError(disk_full_message(path, what)) from e
        raise


# ----------------------------------------------------------------------------------------------- atomic writes


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write through a temporary sibling and rename; on any failure (a full disk: a ValueError
    naming `path`) the temporary file is removed and `path` is unchanged."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with writing(path, "file"):
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# ----------------------------------------------------------------------------------------------- input files


def not_a_file(path: str | os.PathLike) -> str | None:
    """None when `path` is a regular file (symlinks followed); else what it is, for a message: "does not exist",
    "is a directory", "is a named pipe (FIFO), not a file", "is a character device (such as /dev/zero), not a
    file", ... Only `stat`: a FIFO is never opened (opening one waits for a writer)."""
    import stat

    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "does not exist"
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    for test, what in ((stat.S_ISREG, None), (stat.S_ISDIR, "is a directory"),
                       (stat.S_ISFIFO, "is a named pipe (FIFO), not a file"),
                       (stat.S_ISCHR, "is a character device (such as /dev/zero), not a file"),
                       (stat.S_ISBLK, "is a block device, not a file"), (stat.S_ISSOCK, "is a socket, not a file")):
        if test(mode):
            return what
    return "is not a regular file"


# ----------------------------------------------------------------------------------------------- output paths


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
