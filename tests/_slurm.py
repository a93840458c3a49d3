"""A real single-node SLURM on localhost for the tests of `executor: slurm` (Debian's slurm-wlm and munge:
`apt-get install -y slurm-wlm munge`, which `.ci/run` does).

`local_slurm()` starts munged (a key and socket of its own), slurmctld and slurmd in the foreground as
children of this process, with a minimal slurm.conf in a temporary directory (the settings of
/work/shared/README.md, "Sweeps on a cluster": root daemons, no accounting database, linuxproc process
tracking, one node with this machine's cores, one partition), waits until the node is idle, and yields the
environment the SLURM commands need (SLURM_CONF). At the end it cancels the jobs still there and stops the
three daemons by their pids. Nothing outside its directory is touched.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "scontrol", "sinfo", "srun")


def missing_reason() -> str | None:
    """Why no local SLURM can run here (None when it can)."""
    missing = [b for b in BINARIES if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]
    if missing:
        return (f"SLURM is not installed here ({', '.join(missing)} missing): apt-get install -y slurm-wlm munge "
                "(.ci/run does it)")
    if os.geteuid() != 0:
        return "the local SLURM runs its daemons as root (SlurmUser=root); these tests need root"
    return None


def _binary(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _conf(d: Path) -> str:
    host = socket.gethostname().split(".")[0]
    mem_mib = int(next(l for l in Path("/proc/meminfo").read_text().splitlines()
                       if l.startswith("MemTotal")).split()[1]) // 1024
    return "\n".join([
        "ClusterName=moegspotest", f"SlurmctldHost={host}", "AuthType=auth/munge",
        f"AuthInfo=socket={d}/munge.sock", "SlurmUser=root", "SlurmdUser=root",
        f"SlurmctldPort={_free_port()}", f"SlurmdPort={_free_port()}",
        f"StateSaveLocation={d}/state", f"SlurmdSpoolDir={d}/spool",
        f"SlurmctldPidFile={d}/slurmctld.pid", f"SlurmdPidFile={d}/slurmd.pid",
        f"SlurmctldLogFile={d}/slurmctld.log", f"SlurmdLogFile={d}/slurmd.log",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core", "ReturnToService=2", "JobAcctGatherType=jobacct_gather/none",
        "MpiDefault=none",
        f"NodeName={host} CPUs={os.cpu_count()} RealMemory={int(mem_mib * 0.9)} State=UNKNOWN",
        f"PartitionName=debug Nodes={host} Default=YES State=UP MaxTime=INFINITE", ""])


def _tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


@contextlib.contextmanager
def local_slurm(timeout_s: float = 60.0) -> Iterator[dict[str, str]]:
    """Start a single-node SLURM; yields {"SLURM_CONF": path}. Raises RuntimeError (with the daemons' logs)
    when the node does not come up."""
    d = Path(tempfile.mkdtemp(prefix="slurm", dir="/tmp"))  # short: the munge socket path must fit 108 bytes
    (d / "state").mkdir()
    (d / "spool").mkdir()
    key = d / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    conf = d / "slurm.conf"
    conf.write_text(_conf(d))
    env = {"SLURM_CONF": str(conf)}
    full_env = dict(os.environ, **env)
    procs: list[subprocess.Popen] = []

    def start(name: str, *args: str) -> None:
        log = open(d / f"{name}.out", "wb")
        procs.append(subprocess.Popen([_binary(name), *args], stdout=log, stderr=subprocess.STDOUT, env=full_env,
                                      start_new_session=True))
        log.close()

    try:
        start("munged", "-F", "--force", f"--socket={d}/munge.sock", f"--key-file={key}",
              f"--pid-file={d}/munged.pid", f"--log-file={d}/munged.log", f"--seed-file={d}/munged.seed")
        deadline = time.monotonic() + timeout_s
        while not (d / "munge.sock").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        start("slurmctld", "-D", "-f", str(conf))
        start("slurmd", "-D", "-f", str(conf))
        state = ""
        while time.monotonic() < deadline:
            r = subprocess.run([_binary("sinfo"), "--noheader", "--format=%t"], capture_output=True, text=True,
                               env=full_env, timeout=30)
            state = r.stdout.strip()
            if state == "idle":
                break
            if any(p.poll() is not None for p in procs):
                break
            time.sleep(0.5)
        if state != "idle":
            logs = "\n".join(f"--- {n}\n{_tail(d / n)}" for n in ("munged.out", "munged.log", "slurmctld.out",
                                                                   "slurmctld.log", "slurmd.out", "slurmd.log"))
            raise RuntimeError(f"the local SLURM did not come up (sinfo says {state!r}):\n{logs}")
        yield env
    finally:
        if procs:
            subprocess.run([_binary("scancel"), "--user", "root"], env=full_env, capture_output=True, timeout=60)
            end = time.monotonic() + 30
            while time.monotonic() < end:  # let cancelled jobs' steps end before their slurmd stops
                r = subprocess.run([_binary("squeue"), "--noheader"], env=full_env, capture_output=True, text=True,
                                   timeout=30)
                if r.returncode != 0 or not r.stdout.strip():
                    break
                time.sleep(0.5)
        for p in reversed(procs):  # slurmd, slurmctld, munged: by pid
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(timeout=10)
        shutil.rmtree(d, ignore_errors=True)
