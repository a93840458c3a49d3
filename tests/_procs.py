"""Finding torchrun's worker processes (they run in sessions of their own, not torchrun's group)."""

from __future__ import annotations

from pathlib import Path


def worker_pids(launcher_pid: int) -> dict[int, int]:
    """RANK -> pid of the torchrun workers whose parent is `launcher_pid`."""
    out = {}
    for child in Path("/proc").iterdir():
        if not child.name.isdigit():
            continue
        try:
            ppid = int((child / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid != launcher_pid:
                continue
            env = dict(kv.split("=", 1) for kv in (child / "environ").read_text().split("\0") if "=" in kv)
        except (OSError, ValueError, IndexError):
            continue
        if "RANK" in env:
            out[int(env["RANK"])] = int(child.name)
    return out


def alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]) != "Z"
    except (OSError, IndexError):
        return False
