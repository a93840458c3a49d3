"""`python -m moe_gspo.launch [torchrun options] -m moe_gspo.train ...`: torchrun with short failures.

Takes exactly torchrun's arguments (listed below) and runs torchrun's own launcher. The difference is
at the end: plain `torchrun` exits 1 whenever a worker fails and prints its ChildFailedError block (a
traceback of the launcher plus a ~15-line summary), burying the worker's one-line error. This wrapper
prints one line naming the first failed rank and its exit code, and exits with that code: 2 for a
user error, 3 for a rank failure (see `moe_gspo.run.errors`), 128+N for a worker killed by signal N.
Interrupted itself (Ctrl-C / SIGINT, SIGTERM), it stops the workers as torchrun does (each says how to
resume) and exits with 128+N instead of printing torchrun's SignalException traceback.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys

PROG = "python -m moe_gspo.launch"


def root_failure(e):
    """(rank, failure) of the root cause: the earliest worker that exited with an error code of its
    own; workers the agent then stopped by signal are consequences (timestamps have 1 s resolution)."""
    exited = {r: f for r, f in e.failures.items() if f.exitcode > 0}
    if not exited:
        return e.get_first_failure()
    rank = min(exited, key=lambda r: (exited[r].timestamp, r))
    return rank, exited[rank]


def build_parser() -> argparse.ArgumentParser:
    """torchrun's own argument parser, named and described as this wrapper, one-line errors."""
    from torch.distributed.run import get_args_parser

    from moe_gspo.run.errors import EXIT_USER_ERROR

    parser = get_args_parser()
    parser.prog = PROG
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter

    def error(message: str):
        print(f"error: {message} (see {PROG} --help)", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_USER_ERROR)

    parser.error = error
    return parser


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _reported(failure) -> tuple[str, bool]:
    """(the worker's `error: ...` line or "", whether it printed it), as `moe_gspo.run.errors.report`
    records them in torchelastic's error file."""
    message = failure.message
    if isinstance(message, dict):
        text, printed = message.get("message", ""), message.get("extraInfo", {}).get("printed", False)
        return (text if isinstance(text, str) and text.startswith("error: ") else ""), bool(printed)
    return "", False


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    args = build_parser().parse_args(argv if argv is not None else sys.argv[1:])
    # The agent logs every worker it stops ("Sending process N closing signal SIGTERM") and the
    # failure again; the workers' own output and the line below say what matters.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        run(args)
    except SignalException as e:  # the agent has stopped the workers with the same signal
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        rank, failure = root_failure(e)
        code = failure.exitcode
        if code < 0:
            print(f"[moe_gspo.launch] rank {rank} was killed by {_signal_name(-code)}", file=sys.stderr, flush=True)
            return 128 - code
        where = "the error is printed above"
        line, _ = _reported(failure)
        if line and not any(_reported(f)[1] for f in e.failures.values()):
            where = line  # another node's rank printed it (multi-node): say it here too
        print(f"[moe_gspo.launch] {e.name} failed with exit code {code} (first on rank {rank}); {where}",
              file=sys.stderr, flush=True)
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
