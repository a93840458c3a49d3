"""Command line of `python -m moe_gspo.train` (under torchrun): config file, shortcuts, dotted overrides.

Flags and `section.key=value` overrides may be mixed in any order (argparse's intermixed parsing).
A CLI or config error prints one line, `error: ...`, on rank 0 only (every rank parses the same
command line) and exits with status 2 (see `moe_gspo.run.errors`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
import typing
import warnings

from moe_gspo.config import ALGOS, REPLAYS, Config, field_docs, load_config, parse_override


class OnceArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser that prints (help, errors) on rank 0 only, and reports an error as one line
    naming `--help` instead of the usage block; `raise_errors=True` raises ValueError instead."""

    def __init__(self, *args, raise_errors: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.raise_errors = raise_errors

    def _print_message(self, message, file=None):
        if int(os.environ.get("RANK", "0")) == 0:
            super()._print_message(message, file)

    def error(self, message):
        if self.raise_errors:
            raise ValueError(message)
        fail(f"{message} (see {self.prog} --help)")


def fail(message: str) -> None:
    """Print `error: message` once (rank 0; also into torchrun's error file) and exit with status 2.

    Every rank parses the same command line and fails together; the other ranks wait a moment before
    exiting, so that torchrun does not tear rank 0 down before its line is out (seen 1 time in 3)."""
    from moe_gspo.run.errors import EXIT_USER_ERROR, report

    report(message)
    if int(os.environ.get("RANK", "0")) != 0:
        time.sleep(2.0)
    raise SystemExit(EXIT_USER_ERROR)


def parse_mixed(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Flags and positionals (overrides) in any order."""
    return parser.parse_intermixed_args(argv)


def _fields_help() -> str:
    lines = ["config fields (override any with section.key=value):"]
    for sec in dataclasses.fields(Config):
        cls = typing.get_type_hints(Config)[sec.name]
        docs = field_docs(cls)
        lines.append(f"  [{sec.name}] {cls.__doc__.strip().splitlines()[0]}")
        default = cls()
        for f in dataclasses.fields(cls):
            lines.append(f"    {sec.name}.{f.name} (default {getattr(default, f.name)!r}): {docs.get(f.name, '')}")
    return "\n".join(lines)


def build_parser(prog: str, description: str, *, raise_errors: bool = False) -> argparse.ArgumentParser:
    p = OnceArgumentParser(
        prog=prog, description=description, epilog=_fields_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter, raise_errors=raise_errors,
    )
    p.add_argument("--config", default="configs/tiny_cpu.yaml",
                   help="YAML run config (default: configs/tiny_cpu.yaml)")
    p.add_argument("--algo", choices=ALGOS, help="shortcut for algo.name=...")
    p.add_argument("--routing-replay", choices=REPLAYS, help="shortcut for algo.routing_replay=...")
    p.add_argument("--run-dir", default=None,
                   help="output directory (metrics.jsonl, traces, checkpoints); default runs/<algo>-<replay>")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --run-dir from its newest intact checkpoint (same algorithm, "
                        "replay, model and process count; other settings, e.g. train.steps, may change)")
    p.add_argument("--overwrite", action="store_true",
                   help="start afresh although --run-dir holds a run: the old directory is first moved to "
                        "RUN_DIR.prev<k> (nothing is deleted)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value",
                   help="dotted config overrides, e.g. train.steps=20 rollout.dtype=float32")
    return p


TRAIN_PROG = "python -m moe_gspo.train"
TRAIN_DESCRIPTION = ("RL on Qwen3-MoE: GSPO / GSPO-token / GRPO / GMPO / CISPO / SAPO x Routing Replay "
                     "{none, r2, r3}.")


def config_from_args(args: argparse.Namespace) -> Config:
    """The validated config of parsed train arguments; raises ValueError naming the field."""
    overrides = list(args.overrides)
    for flag, key, value in (("--algo", "algo.name", args.algo),
                             ("--routing-replay", "algo.routing_replay", args.routing_replay)):
        if value is None:
            continue
        for o in overrides:
            if o.split("=", 1)[0].strip() == key and str(parse_override(o)[2]) != value:
                raise ValueError(f"{flag} {value} contradicts the override {o}; give one of them")
        overrides.append(f"{key}={value}")
    cfg = load_config(args.config, overrides)
    if args.resume and args.overwrite:
        raise ValueError("--resume continues the run in --run-dir and --overwrite moves it aside to start "
                         "afresh; give one of them")
    if args.run_dir is None:
        args.run_dir = f"runs/{cfg.algo.name}-{cfg.algo.routing_replay}"
    return cfg


def check_train_args(argv: list[str]) -> Config:
    """Validate a train command line without printing or exiting (the ablation runner's dry run)."""
    parser = build_parser(TRAIN_PROG, TRAIN_DESCRIPTION, raise_errors=True)
    return config_from_args(parse_mixed(parser, argv))


def parse_train_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, Config]:
    """Parse the CLI; CLI and config errors exit with status 2 and one line naming the field."""
    parser = build_parser(TRAIN_PROG, TRAIN_DESCRIPTION)
    args = parse_mixed(parser, argv)
    try:
        with warnings.catch_warnings():
            if int(os.environ.get("RANK", "0")) != 0:  # every rank loads the same config: warn once, on rank 0
                warnings.simplefilter("ignore", UserWarning)
            cfg = config_from_args(args)
    except ValueError as e:
        fail(str(e))
    return args, cfg
