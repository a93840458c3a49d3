"""How the entry points (train, probe, ablate) end on an error: one line, printed once, an exit code.

Exit codes:
- 0: done.
- 1: an internal error (a bug): Python's traceback.
- 2: a user error: bad CLI, config, data, checkpoint, output path, or a full disk. The one-line
  message names the field or the file and the fix. Raise `ValueError` for these (style rule 7).
- 3: a rank failure: another process stopped responding within `parallel.collective_timeout_s`, or
  died; the message names the rank and what it was doing (see `Activity`).
- 128 + N: interrupted by signal N (130 for Ctrl-C / SIGINT, 143 for SIGTERM, as a shell reports
  them): one line, `interrupted by SIGINT; <how to resume>`, from rank 0, and no traceback. Under
  torchrun the agent passes its own SIGINT / SIGTERM on to every worker.

Printed once: before `torch.distributed` is initialised every rank holds the same CLI and files, so
only rank 0 prints; afterwards the first rank to fail claims the report through torch.distributed's
store (the torchrun agent's TCPStore, which outlives any worker) and prints, the others stay silent.
Under torchrun each failing worker also writes its line to torchelastic's error file
(`TORCHELASTIC_ERROR_FILE`), so torchrun's failure summary quotes that line instead of a link; plain
`torchrun` itself always exits 1 after a worker fails, with its ChildFailedError summary.
`python -m moe_gspo.launch` takes torchrun's arguments and exits with the worker's code instead.

A full disk is recognised and named by `moe_gspo.files` (`writing`, `is_disk_full`), the ground floor
every layer writes through; this module only turns it into exit code 2.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

from moe_gspo.files import atomic_write_text, disk_full_message, is_disk_full

EXIT_USER_ERROR = 2
EXIT_RANK_FAILURE = 3


class RankFailure(RuntimeError):
    """Another rank stopped responding (collective timeout) or died; exit code 3."""


# gloo ("Timed out waiting 300000ms for recv operation"), the TCPStore ("Socket Timeout", "wait timeout"),
# NCCL's watchdog ("collective operation timeout").
_TIMEOUT_TEXT = ("Timed out waiting", "Socket Timeout", "wait timeout", "collective operation timeout")
_PEER_LOST_TEXT = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused")


def comm_failure_kind(exc: BaseException) -> str | None:
    """"timeout", "peer_lost" or None for an exception raised by a collective."""
    if not isinstance(exc, RuntimeError):
        return None
    text = str(exc)
    if any(t in text for t in _PEER_LOST_TEXT):
        return "peer_lost"
    if any(t in text for t in _TIMEOUT_TEXT):
        return "timeout"
    return None


def user_message(exc: BaseException) -> tuple[int, str] | None:
    """(exit code, one-line message) for a user error or a rank failure; None for a bug."""
    if isinstance(exc, RankFailure):
        return EXIT_RANK_FAILURE, str(exc)
    kind = comm_failure_kind(exc)
    if kind is not None:  # outside `Activity.watch()` (start-up, probe): no activity to name
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        what = "timed out (parallel.collective_timeout_s)" if kind == "timeout" else "lost its connection"
        return EXIT_RANK_FAILURE, (f"rank {os.environ.get('RANK', '0')}: a collective {what} ({first}); another "
                                   f"rank stopped responding or died")
    if isinstance(exc, ValueError):
        return EXIT_USER_ERROR, str(exc)
    if is_disk_full(exc):
        name = getattr(exc, "filename", None)
        return EXIT_USER_ERROR, (disk_full_message(name, "file", outcome=None) if name else  # writer unknown here
                                 f"disk full: {exc}; free space or choose another directory")
    if isinstance(exc, (PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)):
        return EXIT_USER_ERROR, f"{exc.strerror}: {exc.filename!r}; choose another path or fix its permissions"
    return None


def _default_store():
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # private API: printing twice beats not printing
        return None


def claim_report() -> bool:
    """True on the one rank that should print this run's error (see the module docstring)."""
    store = _default_store()
    if store is None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return True  # world of 1, or no store to agree through: print
        return int(os.environ.get("RANK", "0")) == 0  # before init: every rank knows the same
    try:
        return store.add("moe_gspo/error_reports", 1) == 1
    except Exception:
        return True


def _write_torchelastic_error_file(message: str, *, printed: bool, exitcode: int) -> None:
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    info = {"timestamp": str(int(time.time())), "printed": printed, "exitcode": exitcode,
            "rank": int(os.environ.get("RANK", "0"))}
    try:  # whole or not at all: the launcher may read it back while this rank exits
        atomic_write_text(path, json.dumps({"message": {"message": message, "extraInfo": info}}))
    except (OSError, ValueError):  # ValueError: a full disk (files.writing); the line is still printed
        pass


def report(message: str, *, exitcode: int) -> None:
    """Print `error: message` once across ranks (and record it, whether this rank printed it, the exit
    code it will leave with and its rank, for the launcher's summary: `moe_gspo.launch` repeats the line
    on a node where no rank printed it, and reads the record back if its agent loses the rendezvous)."""
    line = f"error: {message}"
    printed = claim_report()
    _write_torchelastic_error_file(line, printed=printed, exitcode=exitcode)
    if printed:
        print(line, file=sys.stderr, flush=True)


EXIT_INTERRUPTED = 128
"""Exit code base of an interrupted run: 128 + the signal number."""


@contextmanager
def interrupts_as_exceptions() -> Iterator[dict]:
    """SIGINT and SIGTERM raise KeyboardInterrupt (SIGTERM's default would end the process without a
    word); the dict yielded records the first signal received under "signum" and the handler installed
    under "handler" (None outside the main thread, where this is a no-op: only it may install handlers)."""
    received: dict = {"signum": None, "handler": None}
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def handler(signum, frame):
        if received["signum"] is None:
            received["signum"] = signum
            raise KeyboardInterrupt
        # a second signal while the first one unwinds: let the unwinding finish

    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    received["handler"] = handler
    try:
        yield received
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def report_interrupt(signum: int, how_to_resume: str) -> int:
    """Print `interrupted by SIG...; how_to_resume` once (rank 0) and return the exit code 128 + signum."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"interrupted by {signal.Signals(signum).name}; {how_to_resume}", file=sys.stderr, flush=True)
    return EXIT_INTERRUPTED + signum


def raised_without_signal(exc: BaseException, received: dict) -> bool:
    """True for a KeyboardInterrupt that no signal caused: code raised it (`raise KeyboardInterrupt` in a
    plug-in, say) while `interrupts_as_exceptions`' handler was still installed and had received nothing.
    (When something replaced the handler, Python's own SIGINT handler may have raised it: a signal.)"""
    handler = received.get("handler")
    return (isinstance(exc, KeyboardInterrupt) and received.get("signum") is None and handler is not None
            and signal.getsignal(signal.SIGINT) is handler)


def _raised_at(exc: BaseException) -> str:
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    return f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""


def run_entry(fn: Callable[[], int | None], *, how_to_resume: Callable[[], str] | None = None) -> int:
    """Run an entry point's body: user errors and rank failures become one printed line and exit
    code 2 / 3; SIGINT / SIGTERM become one line saying how to resume (`how_to_resume()`) and exit
    code 128 + N, whatever the signal broke on its way (a collective whose peer stopped first, say);
    anything else propagates (a bug: traceback, exit 1)."""
    with interrupts_as_exceptions() as received:
        try:
            return fn() or 0
        except BaseException as e:
            if raised_without_signal(e, received):
                message = (f"KeyboardInterrupt raised{_raised_at(e)} without a signal (no SIGINT or SIGTERM reached "
                           "this process): code of the run raised it (a plug-in's, algo.name or task.reward?), so "
                           f"the run stopped; {how_to_resume() if how_to_resume else 'rerun the same command'}")
                report(message, exitcode=EXIT_USER_ERROR)
                return EXIT_USER_ERROR
            signum = received["signum"] or (signal.SIGINT if isinstance(e, KeyboardInterrupt) else None)
            if signum is not None:
                return report_interrupt(signum, how_to_resume() if how_to_resume else "rerun the same command")
            known = user_message(e) if isinstance(e, Exception) else None
            if known is None:
                raise
            code, message = known
            report(message, exitcode=code)
            return code


def warn_once(message: str, *, is_main: bool) -> None:
    """A one-line warning from rank 0 (for conditions every rank has agreed on)."""
    if is_main:
        print(f"warning: {message}", file=sys.stderr, flush=True)
