"""Exit a finished entry point without the interpreter's teardown (`python -m moe_gspo.train` / `.launch`).

After `main()` has returned its exit code, Python's own exit still tears down every module and object
one by one: with torch, transformers, Megatron-core and W&B loaded (~4,000 modules) that costs about
1.4 s of CPU per process on the 2-core box (docs/results.md, "Start-up, after"), for nothing a run keeps.
`exit_now(code)` does what that exit does that matters, then ends the process with `os._exit(code)`:

- it runs every `atexit` handler (W&B's teardown, `logging.shutdown`, multiprocessing's, coverage's),
  in the usual order, once;
- it flushes Python's standard streams and the C library's (`fflush(NULL)`).

It falls back to the ordinary `sys.exit(code)` whenever the interpreter would wait for something first: a
non-daemon thread still running (Python joins those before its atexit handlers), or a tool that ran the
module and still has work to do after it (cProfile, `coverage run`, pdb). Files the run writes are
closed by the code that wrote them (`moe_gspo.files.atomic_write_text`, the metrics sink's `close`); an
object left open with unflushed buffered data would lose it here, as on a kill.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading


def other_threads_running() -> bool:
    """A non-daemon thread other than this one is alive (the interpreter would join it before exiting)."""
    me = threading.current_thread()
    return any(t is not me and t.is_alive() and not t.daemon for t in threading.enumerate())


def run_by_the_interpreter(frame) -> bool:
    """`frame` (a module's top level) was started by the interpreter itself (`python -m`, a script, `-c`): only
    runpy's frames above it. Under a tool that runs it and then does more (`python -m cProfile -o F -m ...`
    writes its profile, `coverage run` its data, pdb), the process must end the ordinary way."""
    f = frame.f_back
    while f is not None:
        name = f.f_code.co_filename
        if not (name == "<frozen runpy>" or name.endswith(("/runpy.py", "\\runpy.py"))):
            return False
        f = f.f_back
    return True


def _flush_c_stdio() -> None:
    try:
        import ctypes

        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):  # no C library handle here (not Linux/macOS): nothing buffered to lose
        pass


def exit_now(code: int | None) -> None:
    """End the process with `code` (None = 0) after the atexit handlers and a flush of every standard stream,
    without the interpreter's teardown; `sys.exit(code)` instead while another non-daemon thread runs or when
    the calling module was not started by the interpreter itself (`run_by_the_interpreter`)."""
    if other_threads_running() or not run_by_the_interpreter(sys._getframe(1)):
        sys.exit(code)
    atexit._run_exitfuncs()  # the handlers in reverse order of registration, each once; then none are left
    if other_threads_running():  # a handler started one: let the interpreter join it
        sys.exit(code)
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: what the ordinary exit would also lose
            pass
    _flush_c_stdio()
    os._exit(0 if code is None else int(code))
