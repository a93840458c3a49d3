"""Command line of `python -m moe_gspo.train` (under torchrun): config file, shortcuts, dotted overrides."""

from __future__ import annotations

import argparse
import dataclasses
import typing

from moe_gspo.config import ALGOS, REPLAYS, Config, field_docs, load_config


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


def build_parser(prog: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, description=description, epilog=_fields_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", default="configs/tiny_cpu.yaml",
                   help="YAML run config (default: configs/tiny_cpu.yaml)")
    p.add_argument("--algo", choices=ALGOS, help="shortcut for algo.name=...")
    p.add_argument("--routing-replay", choices=REPLAYS, help="shortcut for algo.routing_replay=...")
    p.add_argument("--run-dir", default=None,
                   help="output directory (metrics.jsonl, traces, checkpoints); default runs/<algo>-<replay>")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in --run-dir (same config)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value",
                   help="dotted config overrides, e.g. train.steps=20 rollout.dtype=float32")
    return p


def parse_train_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, Config]:
    """Parse the CLI; config errors exit with status 2 and one message naming the field."""
    parser = build_parser("python -m moe_gspo.train",
                          "RL on Qwen3-MoE: GSPO / GSPO-token / GRPO x Routing Replay {none, r2, r3}.")
    args = parser.parse_args(argv)
    overrides = list(args.overrides)
    if args.algo:
        overrides.append(f"algo.name={args.algo}")
    if args.routing_replay:
        overrides.append(f"algo.routing_replay={args.routing_replay}")
    try:
        cfg = load_config(args.config, overrides)
    except ValueError as e:
        parser.error(str(e))
    if args.run_dir is None:
        args.run_dir = f"runs/{cfg.algo.name}-{cfg.algo.routing_replay}"
    return args, cfg
