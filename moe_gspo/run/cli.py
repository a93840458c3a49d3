"""Command lines of the entry points: one convention, shared helpers.

Every entry point that reads a run config takes it as `--config FILE` and accepts dotted overrides
`section.key=value` anywhere among its flags (argparse's intermixed parsing): `moe_gspo.train`,
`moe_gspo.probe`, `moe_gspo.plan`, `moe_gspo.ablate` (whose `--config` is the ablation spec). `plan`
and `ablate` still take the file as their first positional argument, as they did before; `train`,
whose positionals are overrides only, answers a positional `.yaml` with "did you mean --config FILE".

A CLI or config error prints one line, `error: ...`, on rank 0 only (every rank parses the same
command line) and exits with status 2 (see `moe_gspo.run.errors`). `--help` lists every config field
with its value in the config in use (`--config FILE` plus the overrides given), not the dataclass
default (`config_fields_help`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import typing
import warnings
from typing import Callable

from moe_gspo.algos.registry import PLUGIN_FORM, algo_names, get_algo
from moe_gspo.config import REPLAYS, AlgoConfig, Config
from moe_gspo.config_load import field_docs, load_config, parse_override

OVERRIDES_HELP = "dotted config overrides, e.g. train.steps=20 rollout.dtype=float32"
TRAIN_DEFAULT_CONFIG = "configs/tiny_cpu.yaml"


class OnceArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser that prints (help, errors) on rank 0 only, and reports an error as one line
    naming `--help` instead of the usage block; `raise_errors=True` raises ValueError instead."""

    def __init__(self, *args, raise_errors: bool = False, **kwargs):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)
        self.raise_errors = raise_errors

    def _print_message(self, message, file=None):
        if int(os.environ.get("RANK", "0")) == 0:
            super()._print_message(message, file)

    def error(self, message):
        message = f"{message} (see {self.prog} --help)"
        if self.raise_errors:
            raise ValueError(message)
        fail(message)


def fail(message: str) -> None:
    """Print `error: message` once (rank 0; also into torchrun's error file) and exit with status 2.

    Every rank parses the same command line and fails together; the other ranks wait a moment before
    exiting, so that torchrun does not tear rank 0 down before its line is out (seen 1 time in 3)."""
    from moe_gspo.run.errors import EXIT_USER_ERROR, report

    report(message, exitcode=EXIT_USER_ERROR)
    if int(os.environ.get("RANK", "0")) != 0:
        time.sleep(2.0)
    raise SystemExit(EXIT_USER_ERROR)


def parse_mixed(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Flags and positionals (overrides) in any order."""
    return parser.parse_intermixed_args(argv)


# --------------------------------------------------------------------------- --config and overrides

def add_config_arguments(p: argparse.ArgumentParser, *, default: str | None, what: str = "YAML run config",
                         positional_file: bool = False) -> None:
    """`--config FILE` and the positional `section.key=value` overrides (see `take_config`).
    `positional_file`: the file may also come as the first positional argument (plan, ablate)."""
    default_text = f"default: {default}" if default else "default: none"
    alt = "; or as the first positional argument" if positional_file else ""
    p.add_argument("--config", default=None, metavar="FILE", help=f"{what} ({default_text}{alt})")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help=OVERRIDES_HELP)


def _looks_like_file(text: str) -> bool:
    return text.endswith((".yaml", ".yml", ".json")) or os.path.isfile(text)


def take_config(args: argparse.Namespace, *, default: str | None, positional_file: bool = False) -> None:
    """Resolve `args.config` (the flag, else the first positional when `positional_file`, else
    `default`) and check that every other positional is a `section.key=value` override; raises
    ValueError with a "did you mean --config FILE" for a stray file path."""
    overrides = list(args.overrides)
    if positional_file and args.config is None and overrides and "=" not in overrides[0]:
        args.config = overrides.pop(0)
    for o in overrides:
        if "=" in o:
            continue
        if _looks_like_file(o):
            if args.config is not None:
                raise ValueError(f"{o!r}: give one config file (--config is {args.config}); the other positional "
                                 "arguments are section.key=value overrides")
            raise ValueError(f"{o!r} is not a section.key=value override; did you mean --config {o}?")
        raise ValueError(f"override {o!r} must look like section.key=value (e.g. train.lr=1e-3)")
    args.overrides = overrides
    if args.config is None:
        args.config = default


def shortcut_overrides(overrides: list[str], shortcuts: list[tuple[str, str, object]]) -> list[str]:
    """`overrides` plus `key=value` for each given (flag, key, value) shortcut (value None = not
    given); a shortcut that contradicts an explicit override of the same key raises ValueError."""
    out = list(overrides)
    for flag, key, value in shortcuts:
        if value is None:
            continue
        for o in overrides:
            if o.split("=", 1)[0].strip() == key and parse_override(o)[2] != parse_override(f"{key}={value}")[2]:
                raise ValueError(f"{flag} {value} contradicts the override {o}; give one of them")
        out.append(f"{key}={value}")
    return out


# --------------------------------------------------------------------------- --help with effective values

def _fmt(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value) if isinstance(value, (str, int, float)) else repr(value)


def config_fields_help(cfg: Config, source: str, *, keys: Callable[[str], bool] | None = None,
                       note: str = "") -> str:
    """Every config field (or those whose `section.key` passes `keys`) with its value in `cfg` and
    its documentation; a value that differs from the built-in default names that default."""
    lines = [f"config fields: values of {source}{note} (override any with section.key=value):"]
    hints = typing.get_type_hints(Config)
    for sec in dataclasses.fields(Config):
        cls = hints[sec.name]
        docs = field_docs(cls)
        built_in, now = cls(), getattr(cfg, sec.name)
        rows = []
        for f in dataclasses.fields(cls):
            key = f"{sec.name}.{f.name}"
            if keys is not None and not keys(key):
                continue
            value, default = getattr(now, f.name), getattr(built_in, f.name)
            differs = "" if value == default else f" (built-in default {_fmt(default)})"
            rows.append(f"    {key} = {_fmt(value)}{differs}: {docs.get(f.name, '')}")
            if isinstance(now, AlgoConfig) and f.name == "options":
                rows += _algo_option_rows(now)
            if key == "rollout.engine":
                rows += _engine_rows()
        if rows:
            lines += [f"  [{sec.name}] {cls.__doc__.strip().splitlines()[0]}", *rows]
    return "\n".join(lines)


def _algo_option_rows(algo: AlgoConfig) -> list[str]:
    """One `--help` row per option of the chosen algorithm (`AlgoSpec.options`), with its value in `algo`."""
    spec = algo.spec()
    values = algo.algo_options()
    return [f"      algo.options.{o.name} = {_fmt(values[o.name])} ({spec.name}'s option): {o.help_text()}"
            for o in spec.options]


def _engine_rows() -> list[str]:
    """One `--help` row per rollout engine of the registry (`moe_gspo.rollout.engine_spec.ENGINE_SPECS`, read when
    the help is printed), with its `EngineSpec.doc`."""
    from moe_gspo.rollout import engine_spec

    return [f"      rollout.engine={spec.name}: {spec.doc}" for spec in engine_spec.ENGINE_SPECS.values()]


def help_requested(argv: list[str]) -> bool:
    return any(a in ("-h", "--help") for a in argv)


def help_config(load: Callable[[], tuple[Config, str]], fallback: Callable[[], Config] = Config,
                fallback_source: str = "the built-in defaults") -> tuple[Config, str, str]:
    """(config, source, note) for a help text: `load()` (the config the command line would run with),
    or, when it does not load, `fallback()` with a note saying why."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg, source = load()
        return cfg, source, ""
    except (ValueError, SystemExit) as e:
        return fallback(), fallback_source, f" (the command line's config does not load: {e})"


# --------------------------------------------------------------------------- train

def algorithms_help() -> str:
    """The `--help` section listing every registered algorithm (`AlgoSpec.help_line`) and the plug-in form."""
    lines = [f"  {get_algo(n).help_line()}" for n in algo_names()]
    return "\n".join(["algorithms (--algo NAME, algo.name=NAME):", *lines,
                      f"  a loss of your own: --algo / algo.name={PLUGIN_FORM}"])


def build_parser(prog: str, description: str, *, raise_errors: bool = False,
                 add_help: bool = True) -> argparse.ArgumentParser:
    p = OnceArgumentParser(prog=prog, description=description, raise_errors=raise_errors, add_help=add_help)
    add_config_arguments(p, default=TRAIN_DEFAULT_CONFIG)
    p.add_argument("--algo", metavar="NAME",  # checked with the config (algo.name): a plug-in is welcome too
                   help="shortcut for algo.name=NAME: " + ", ".join(algo_names()) + " (listed below), or a loss of "
                        "your own, file.py:SPEC / package.module:SPEC")
    p.add_argument("--routing-replay", choices=REPLAYS, help="shortcut for algo.routing_replay=...")
    p.add_argument("--run-dir", default=None,
                   help="output directory (metrics.jsonl, traces, checkpoints); default runs/<algo>-<replay>")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --run-dir from its newest intact checkpoint (same algorithm, "
                        "replay, model and process count; the same dial, train.seed and algo.options unless "
                        "--allow-config-change; other settings, e.g. train.steps, may change)")
    p.add_argument("--allow-config-change", action="store_true",
                   help="with --resume: continue although the command changes a key that defines the experiment "
                        "(the routing-drift dial, train.seed, algo.options); the new config is kept beside the old "
                        "one as RUN_DIR/config.resume-N.yaml")
    p.add_argument("--overwrite", action="store_true",
                   help="start afresh although --run-dir holds a run: the old directory is first moved to "
                        "RUN_DIR.prev<k> (nothing is deleted)")
    return p


TRAIN_PROG = "python -m moe_gspo.train"
TRAIN_DESCRIPTION = ("RL on Qwen3-MoE: GSPO / GSPO-token / GRPO / GMPO / CISPO / SAPO x Routing Replay "
                     "{none, r2, r3}.")


def config_from_args(args: argparse.Namespace) -> Config:
    """The validated config of parsed train arguments; raises ValueError naming the field."""
    take_config(args, default=TRAIN_DEFAULT_CONFIG)
    overrides = shortcut_overrides(args.overrides, [("--algo", "algo.name", args.algo),
                                                    ("--routing-replay", "algo.routing_replay", args.routing_replay)])
    cfg = load_config(args.config, overrides)
    if args.resume and args.overwrite:
        raise ValueError("--resume continues the run in --run-dir and --overwrite moves it aside to start "
                         "afresh; give one of them")
    if args.run_dir is None:
        args.run_dir = f"runs/{cfg.algo.spec().name}-{cfg.algo.routing_replay}"  # a plug-in: its spec's name
    return cfg


def check_train_args(argv: list[str]) -> Config:
    """Validate a train command line without printing or exiting (the ablation runner's dry run)."""
    parser = build_parser(TRAIN_PROG, TRAIN_DESCRIPTION, raise_errors=True)
    return config_from_args(parse_mixed(parser, argv))


def _source(args: argparse.Namespace) -> str:
    extra = [*args.overrides] + [f"--{k.replace('_', '-')} {getattr(args, k)}" for k in ("algo", "routing_replay")
                                 if getattr(args, k, None) is not None]
    return str(args.config) + (f" with {' '.join(extra)}" if extra else "")


def _train_help(argv: list[str]) -> str:
    def load():
        pre = build_parser(TRAIN_PROG, TRAIN_DESCRIPTION, raise_errors=True, add_help=False)
        args, _ = pre.parse_known_intermixed_args([a for a in argv if a not in ("-h", "--help")])
        cfg = config_from_args(args)
        return cfg, _source(args)

    cfg, source, note = help_config(load)
    return config_fields_help(cfg, source, note=note)


def parse_train_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, Config]:
    """Parse the CLI; CLI and config errors exit with status 2 and one line naming the field."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(TRAIN_PROG, TRAIN_DESCRIPTION)
    if help_requested(argv):
        parser.epilog = algorithms_help() + "\n\n" + _train_help(argv)
    args = parse_mixed(parser, argv)
    try:
        with warnings.catch_warnings():
            if int(os.environ.get("RANK", "0")) != 0:  # every rank loads the same config: warn once, on rank 0
                warnings.simplefilter("ignore", UserWarning)
            cfg = config_from_args(args)
    except ValueError as e:
        fail(str(e))
    return args, cfg
