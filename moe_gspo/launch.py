"""`python -m moe_gspo.launch [torchrun options] -m moe_gspo.train ...`: torchrun with short failures.

Takes exactly torchrun's arguments and runs torchrun's own launcher. The difference is at the end:
plain `torchrun` exits 1 whenever a worker fails and prints its ChildFailedError block (a traceback
of the launcher plus a ~15-line summary), burying the worker's one-line error. This wrapper prints one
line naming the first failed rank and its exit code, and exits with that code: 2 for a user error,
3 for a rank failure (see `moe_gspo.run.errors`), 128+N for a worker killed by signal N.
"""

from __future__ import annotations

import logging
import signal
import sys


def root_failure(e):
    """(rank, failure) of the root cause: the earliest worker that exited with an error code of its
    own; workers the agent then stopped by signal are consequences (timestamps have 1 s resolution)."""
    exited = {r: f for r, f in e.failures.items() if f.exitcode > 0}
    if not exited:
        return e.get_first_failure()
    rank = min(exited, key=lambda r: (exited[r].timestamp, r))
    return rank, exited[rank]


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(argv if argv is not None else sys.argv[1:])
    # The agent logs every worker it stops ("Sending process N closing signal SIGTERM") and the
    # failure again; the workers' own output and the line below say what matters.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        run(args)
    except ChildFailedError as e:
        rank, failure = root_failure(e)
        code = failure.exitcode
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            print(f"[moe_gspo.launch] rank {rank} was killed by {name}", file=sys.stderr, flush=True)
            return 128 - code
        print(f"[moe_gspo.launch] {e.name} failed with exit code {code} (first on rank {rank}); the error is "
              f"printed above", file=sys.stderr, flush=True)
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
