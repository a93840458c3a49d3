"""`python -m moe_gspo.plan --config CONFIG [--gpus N] [--gpu-mem-gib G] [--json] [section.key=value ...]`

Prints the per-rank GPU memory of every phase of an RL step for a run config (a table, or JSON with
`--json`), whether it fits, and the knob to turn when it does not. Exit status: 0 when it fits, 1 when
it does not, 2 on a bad config or argument. Counted, not measured (see `moe_gspo.plan.memory`).
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings

from moe_gspo.plan.activations import ATTENTIONS


def build_parser() -> argparse.ArgumentParser:
    from moe_gspo.run.cli import OnceArgumentParser, add_config_arguments

    p = OnceArgumentParser(prog="python -m moe_gspo.plan", description=__doc__.split("\n\n")[1],
                           raise_errors=True)
    add_config_arguments(p, default=None, what="YAML run config, e.g. configs/qwen3_30b_a3b.yaml",
                         positional_file=True)
    p.add_argument("--gpus", type=int, default=None,
                   help="GPUs in the run = torchrun world size (default: parallel.expert_parallel_size)")
    p.add_argument("--gpu-mem-gib", type=float, default=80.0, help="memory of one GPU in GiB (default 80)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node, for host memory (default 8)")
    p.add_argument("--host-mem-gib", type=float, default=None,
                   help="host memory per node in GiB; when given, the plan also checks it")
    p.add_argument("--model-config", default=None,
                   help="a config.json (or checkpoint dir, or shipped geometry name) when model.path is not here")
    p.add_argument("--attention", choices=ATTENTIONS, default=None,
                   help="learner attention kernel (default: flash when Transformer Engine is importable, else unfused)")
    p.add_argument("--cuda-runtime-gib", type=float, default=None, help="allowance per process (default 2)")
    p.add_argument("--vllm-runtime-gib", type=float, default=None, help="allowance for an awake vLLM (default 3)")
    p.add_argument("--fragmentation", type=float, default=None, help="allocator fragmentation fraction (default 0.05)")
    p.add_argument("--moe-imbalance", type=float, default=None,
                   help="busiest EP rank's multiple of its balanced token share (default 1.5)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    return p


def main(argv: list[str] | None = None) -> int:
    from moe_gspo.config_load import load_config
    from moe_gspo.plan import Allowances, make_plan
    from moe_gspo.plan.report import render
    from moe_gspo.run.cli import take_config

    try:
        args = build_parser().parse_intermixed_args(argv)  # argparse errors: ValueError, one line below
        take_config(args, default=None, positional_file=True)
        if args.config is None:
            raise ValueError("give the run config: python -m moe_gspo.plan --config FILE (e.g. configs/qwen3_30b_a3b.yaml)")
        al_kw = {k: getattr(args, k) for k in ("cuda_runtime_gib", "vllm_runtime_gib", "fragmentation",
                                                "moe_imbalance") if getattr(args, k) is not None}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg = load_config(args.config, args.overrides)
        gpus = args.gpus if args.gpus is not None else cfg.parallel.expert_parallel_size
        if gpus < 1 or args.gpu_mem_gib <= 0:
            raise ValueError("--gpus and --gpu-mem-gib must be positive")
        result = make_plan(cfg, num_gpus=gpus, gpu_mem_gib=args.gpu_mem_gib, model_config=args.model_config,
                           attention=args.attention, gpus_per_node=args.gpus_per_node,
                           host_mem_gib=args.host_mem_gib, allowances=Allowances(**al_kw))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result.to_json(), indent=1))
    else:
        print(render(result, cfg, config_name=args.config))
    return 0 if result.fits else 1


if __name__ == "__main__":
    sys.exit(main())
