"""`python -m moe_gspo.probe --model DIR --prompts FILE --out drift.json`: how far apart are the
inference and training routers of a checkpoint, without training?

Samples responses with the rollout engine (`--engine hf|vllm`, in `--dtype`), recomputes the same
tokens with the Megatron learner (fp32 on CPU, bf16 on CUDA, EP = world size under torchrun), and
writes JSON with per-layer routing disagreement, the any-layer flip fraction (rows that produce
response log-probs; prompt rows under `routing_prompt/*`), the train-inference mismatch metrics
(k1/k3 KL, extreme-token fractions), the token-ratio vs sequence-ratio variance of learner/rollout
ratios, and each routing subset's share of that variance (flipped vs agreed tokens; NaN -> null
when a subset is empty).
Keys are the training loop's metrics.jsonl names with their meaning there: the learner/rollout ratio statistics
are `mismatch_ratio/*` (`ratio/*` is the new/old policy ratio inside an update, which a probe does not have;
probe files written before issue 43 called them `ratio/*`, which `analysis.load.probe_value` still reads).

Settings come as in `moe_gspo.train`: an optional `--config FILE` (a run config; the probe uses the
fields listed by `--help`), then `section.key=value` overrides, e.g. `rollout.engine=vllm
rollout.max_model_len=4096 rollout.kv_cache_gib=2 model.tokenizer=DIR`; `--model`, `--engine`, `--dtype`,
`--quantization`, `--max-new-tokens`, `--temperature` and `--seed` are shortcuts for model.path,
rollout.engine, rollout.dtype, rollout.quantization, rollout.max_new_tokens, rollout.temperature and train.seed. Every prompt plus
rollout.max_new_tokens must fit the engine's context (checked before any model is loaded).

The routing-drift dial (`rollout.router_flip_prob`, `rollout.router_noise_std`; hf engine) is honoured, from the
command line or from `--config` (a dialled run's config.yaml probes with its dial, and the probe says so before it
loads anything): its settings and realised rate are written as `routing/dial_*` (the names of metrics.jsonl) and
printed apart from the rest of the drift, the dial's injected flips counted inside the engine; the natural drift
(the learner against the undialled routes) is not measured under the dial, only bounded below by total − injected
(`analysis.dial_report`): probe without the dial to measure it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import warnings
from pathlib import Path

import torch

from moe_gspo.rollout.engine_spec import ENGINE_NAMES, engine_spec


def read_prompt_file(path: str | Path) -> list[tuple[str, str]]:
    """(`file:line`, prompt) of a text file (one prompt per line) or JSONL with a `prompt` field;
    blank lines skipped."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--prompts {str(p)!r} does not exist; give a text file (one prompt per line) or JSONL")
    from moe_gspo.tasks.jsonl import iter_prompt_objects, iter_text_lines

    if p.suffix == ".jsonl":
        prompts = [(f"{p}:{n}", obj["prompt"]) for n, obj in iter_prompt_objects(p)]
    else:
        prompts = [(f"{p}:{n}", line.rstrip("\r\n")) for n, line in iter_text_lines(p) if line.strip()]
    if not prompts:
        raise ValueError(f"--prompts {str(p)!r} holds no prompts; put one prompt per line (or, in a .jsonl file, "
                         'one {"prompt": "..."} object per line)')
    return prompts


def read_prompts(path: str | Path) -> list[str]:
    """The prompts of `read_prompt_file`."""
    return [text for _, text in read_prompt_file(path)]


PROG = "python -m moe_gspo.probe"
PROBE_DEFAULTS = {"rollout": {"max_new_tokens": 32}}
"""The probe's config without --config: the built-in defaults, except 32-token responses."""
PROBE_KEYS = ("model.path", "model.tokenizer", "model.params_dtype", "model.vocab_pad_multiple",
              "parallel.collective_timeout_s", "rollout.engine", "rollout.dtype", "rollout.quantization",
              "rollout.fp8_scale", "rollout.fp8_router", "rollout.fp8_activations", "rollout.temperature",
              "rollout.top_p", "rollout.max_new_tokens", "rollout.gpu_memory_utilization", "rollout.max_model_len",
              "rollout.kv_cache_gib", "rollout.router_flip_prob", "rollout.router_noise_std", "train.seed",
              "logging.progress")
"""The config fields the probe uses; an override of any other is refused (it would have no effect)."""
OVERRIDES_HELP = ("dotted overrides of the config fields listed below (others are refused), e.g. "
                  "rollout.max_new_tokens=64 rollout.dtype=float32")
"""The probe's own help for its overrides: the shared `moe_gspo.run.cli.OVERRIDES_HELP` names train fields."""


def build_parser(*, add_help: bool = True):
    from analysis.phase_gate import CRITICAL_FRAC_RULE
    from moe_gspo.run.cli import OnceArgumentParser, add_config_arguments

    p = OnceArgumentParser(prog=PROG, description=__doc__, add_help=add_help)
    add_config_arguments(p, default=None, what="YAML run config whose fields listed below the probe uses (it "
                                               "ignores the others); without it the built-in defaults, 32-token "
                                               "responses")
    next(a for a in p._actions if a.dest == "overrides").help = OVERRIDES_HELP
    p.add_argument("--model", default=None, help="local Hugging Face Qwen3-MoE checkpoint directory (model.path)")
    p.add_argument("--prompts", required=True, help="text file (one prompt per line) or .jsonl with 'prompt'")
    p.add_argument("--out", required=True, help="output JSON path")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default=None, help="rollout.dtype")
    p.add_argument("--engine", choices=ENGINE_NAMES, default=None, help="rollout.engine")
    p.add_argument("--quantization", choices=["fp8"], default=None,
                   help="rollout.quantization: fp8 rollout weights (moe_gspo/rollout/fp8.py)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="rollout.max_new_tokens")
    p.add_argument("--temperature", type=float, default=None, help="rollout.temperature")
    p.add_argument("--seed", type=int, default=None, help="train.seed (the sampling seed)")
    p.add_argument("--samples-per-prompt", type=int, default=4, help="responses per prompt (default 4)")
    p.add_argument("--localize", action="store_true",
                   help="divergence localiser (moe_gspo/routing/localize.py): compare the rollout engine's and the "
                        "learner's per-layer tensors of the same tokens; adds localize/* keys and a depth figure "
                        "(one process only)")
    p.add_argument("--localize-tol", type=float, default=None,
                   help="relative tolerance of --localize (max |delta| / max |learner tensor|): default 1e-5 for "
                        "fp32 rollouts, 1e-2 for bf16")
    p.add_argument("--localize-out", default=None,
                   help="also write the --localize result alone to this JSON file (figure beside it)")
    g = p.add_argument_group("gate (exit 1 with one line per violated threshold; analysis/phase_gate.py)")
    g.add_argument("--phase", default=None, metavar="DIR",
                   help="a phase-diagram matrix (analysis.phase: its out_dir or --save-metrics file): say where this "
                        "checkpoint's per-layer flip rate falls, as a fraction of each method's critical mismatch")
    g.add_argument("--phase-method", default="grpo-none", help="the method --max-critical-frac scales (default grpo-none)")
    g.add_argument("--max-k3", type=float, default=None, help="fail when mismatch/k3_kl exceeds this")
    g.add_argument("--max-flip", type=float, default=None,
                   help="fail when the per-layer flip rate (mean over MoE layers of routing/layer_disagree) exceeds this")
    g.add_argument("--max-critical-frac", type=float, default=None, metavar="F",
                   help="(needs --phase) " + CRITICAL_FRAC_RULE.replace("%", "%%"))
    return p


def probe_config(args: argparse.Namespace, *, need_model: bool = True):
    """The validated config of the probe's command line; raises ValueError naming the field."""
    from moe_gspo.config_load import config_from_dict
    from moe_gspo.run.cli import shortcut_overrides, take_config

    take_config(args, default=None)
    for o in args.overrides:
        key = o.split("=", 1)[0].strip()
        if key not in PROBE_KEYS:
            raise ValueError(f"override {o!r}: the probe does not use {key}; it uses {', '.join(PROBE_KEYS)} "
                             "(and --samples-per-prompt)")
    overrides = shortcut_overrides(args.overrides, [
        ("--model", "model.path", args.model), ("--engine", "rollout.engine", args.engine),
        ("--dtype", "rollout.dtype", args.dtype), ("--quantization", "rollout.quantization", args.quantization),
        ("--max-new-tokens", "rollout.max_new_tokens", args.max_new_tokens),
        ("--temperature", "rollout.temperature", args.temperature), ("--seed", "train.seed", args.seed)])
    cfg = config_from_dict(_probe_fields(args.config) if args.config else PROBE_DEFAULTS, overrides)
    if cfg.model.path is None and need_model:
        raise ValueError("give the checkpoint to probe: --model DIR (or model.path in --config)")
    if args.samples_per_prompt < 1:
        raise ValueError("--samples-per-prompt must be >= 1")
    if getattr(args, "localize", False):
        from moe_gspo.probe_localize import check_localize_args

        check_localize_args(args)
    # the probe compares routes, with one engine per process that never sleeps
    cfg.rollout = dataclasses.replace(cfg.rollout, record_routes=True, tensor_parallel_size=1, sleep_level=0)
    return cfg


def _probe_fields(path: str) -> dict:
    """The `PROBE_KEYS` fields of a run config file (the rest, e.g. the task, is not the probe's)."""
    from moe_gspo.config_load import load_yaml_file, resolve_config_path

    path = resolve_config_path(path)  # a file, or a shipped config by name from anywhere
    data = load_yaml_file(path, what="config file") or {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {str(path)!r} must hold a mapping of sections, got {type(data).__name__}")
    return {sec: {k: v for k, v in body.items() if f"{sec}.{k}" in PROBE_KEYS}
            for sec, body in data.items() if isinstance(body, dict)}


def _help(argv: list[str]) -> str:
    from moe_gspo.config_load import config_from_dict
    from moe_gspo.run.cli import config_fields_help, help_config

    def load():
        args, _ = build_parser(add_help=False).parse_known_intermixed_args(
            [a for a in argv if a not in ("-h", "--help")] + ["--prompts", "-", "--out", "-"])
        cfg = probe_config(args, need_model=False)
        return cfg, (args.config or "the probe's defaults") + (f" with {' '.join(args.overrides)}" if args.overrides else "")

    cfg, source, note = help_config(load, fallback=lambda: config_from_dict(PROBE_DEFAULTS),
                                    fallback_source="the probe's defaults")
    return config_fields_help(cfg, source, keys=lambda k: k in PROBE_KEYS, note=note)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from moe_gspo.run.cli import help_requested

    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    if help_requested(argv):
        parser.epilog = _help(argv)
    return parser.parse_intermixed_args(argv)


def probe(args: argparse.Namespace, cfg=None) -> dict:
    from moe_gspo.config import AlgoConfig
    from moe_gspo.learner.batch import PackedBatch
    from moe_gspo.learner.learner import Learner
    from moe_gspo.mcore.checkpoint import load_hf_config, load_megatron_from_hf_dir
    from moe_gspo.mcore.model import moe_layer_ids
    from moe_gspo.mcore.parallel import init_distributed
    from moe_gspo.rollout.base import SamplingParams
    from moe_gspo.routing.drift_metrics import rollout_vs_learner
    from moe_gspo.files import check_output_file
    from moe_gspo.run.setup import build_engine, check_tokenizer_fits, derive_seed, learner_dtype, quiet_progress_bars
    from moe_gspo.run.steps import dial_metrics, gather_samples
    from moe_gspo.tasks import Prompt
    from moe_gspo.tasks.encoding import check_chat_template, encode_prompts
    from moe_gspo.tasks.lengths import check_prompt_lengths

    cfg = probe_config(args) if cfg is None else cfg
    r, model_dir = cfg.rollout, cfg.model.path
    check_output_file(args.out, "--out")  # before any compute
    hf_config = load_hf_config(model_dir, field="--model")  # clear errors: missing dir, not a Qwen3-MoE
    engine_spec(r.engine).check_machine(r, hf_config, model=f"--model {model_dir}")  # this machine's vLLM, what its kernels run
    prompt_lines = read_prompt_file(args.prompts)
    tok = _tokenizer(cfg)
    check_tokenizer_fits(tok, hf_config, tokenizer_dir=cfg.model.tokenizer or model_dir, model=model_dir)
    enc = dict(chat_template=cfg.task.chat_template, system_prompt=cfg.task.system_prompt)  # as training encodes
    check_chat_template(tok, cfg.task.chat_template, tokenizer_name=repr(cfg.model.tokenizer or model_dir))
    check_prompt_lengths([Prompt(text=t, answer="", where=w) for w, t in prompt_lines], tok, hf_config, r,
                         max_new_tokens_flag="--max-new-tokens (rollout.max_new_tokens)", **enc)
    prompts = [t for _, t in prompt_lines]
    quiet_progress_bars(cfg)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    info = init_distributed(ep_size=world, num_experts=hf_config.num_experts, seed=cfg.train.seed,
                            timeout_s=cfg.parallel.collective_timeout_s)
    if len(prompts) < info.dp_size:
        raise ValueError(f"--prompts has {len(prompts)} prompts, fewer than the {info.dp_size} processes; add prompts")
    bounds = [len(prompts) * k // info.dp_size for k in range(info.dp_size + 1)]
    mine = prompts[bounds[info.dp_rank]:bounds[info.dp_rank + 1]]
    model, _ = load_megatron_from_hf_dir(model_dir, ep_size=info.ep_size, params_dtype=learner_dtype(cfg),
                                         enable_routing_replay=False, token_dispatcher="allgather",
                                         vocab_pad_multiple=cfg.model.vocab_pad_multiple, field="--model")
    learner = Learner(model, hf_config, parallel=info, algo=AlgoConfig(), train=None)  # inference only
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    engine = build_engine(cfg, model_dir, tok)
    ids = encode_prompts(tok, mine, **enc)
    try:
        local = engine.generate(ids, SamplingParams(n=args.samples_per_prompt, temperature=r.temperature, top_p=r.top_p,
                                                    max_new_tokens=r.max_new_tokens,
                                                    seed=derive_seed(cfg.train.seed, info.dp_rank)))
    finally:
        engine.close()  # before the process group goes (vLLM's own teardown would take it down)
    samples = gather_samples(local, info, prompt_offset=bounds[info.dp_rank])
    batch = PackedBatch.from_samples(samples, torch.zeros(len(samples)), pad_id)
    res = learner.compute_logprobs(batch, record_routes=True)
    m = rollout_vs_learner(rollout_logp_BS=batch.rollout_logp_BS, learner_logp_BS=res.logp_BS,
                           response_mask_BS=batch.response_mask_BS, rollout_routes=batch.rollout_routes,
                           learner_routes=res.routes, num_experts=hf_config.num_experts,
                           group_ids=[smp.prompt_index for smp in samples])
    learner_routes = res.routes
    if getattr(args, "localize", False):  # the divergence localiser (issue 41): same tokens, layer by layer
        from moe_gspo.probe_localize import probe_localize_keys

        m.update(probe_localize_keys(args, engine, r, model, samples, res.logp_BS, hf_config, info))
    m["num_tokens"] = int(batch.response_mask_BS.sum())
    m["num_routed_tokens"] = int(sum(min(len(a), len(b)) for a, b in zip(batch.rollout_routes, learner_routes)))
    m["num_sequences"] = len(samples)
    m.update(dial_metrics(samples, r))  # routing/dial_* when the routing-drift dial is on (its injected flips)
    out = {"model": str(model_dir), "engine": r.engine, "dtype": r.dtype, "quantization": r.quantization,
           "fp8_scale": r.fp8_scale, "fp8_activations": r.fp8_activations,
           "learner_dtype": str(learner_dtype(cfg)).replace("torch.", ""), "world_size": info.world_size,
           "layer_ids": moe_layer_ids(hf_config)}
    for k, v in sorted(m.items()):
        out[k] = v
    return out


def _tokenizer(cfg):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(cfg.model.tokenizer or cfg.model.path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def _num(v) -> str:
    return "n/a" if v is None or (isinstance(v, float) and v != v) else f"{v:.3f}"


def dial_note(cfg, args: argparse.Namespace) -> str | None:
    """The line that says the routing-drift dial is on, and where it came from; None when it is off."""
    r = cfg.rollout
    if not (r.router_flip_prob > 0 or r.router_noise_std > 0):
        return None
    on_cli = any(o.split("=", 1)[0].strip() in ("rollout.router_flip_prob", "rollout.router_noise_std")
                 for o in args.overrides)
    where = "the command line" if on_cli or not args.config else f"--config {args.config}"
    return (f"note: the routing-drift dial is on (rollout.router_flip_prob={r.router_flip_prob:g}, "
            f"rollout.router_noise_std={r.router_noise_std:g}, from {where}): the rollout engine's routes are "
            "perturbed on purpose, and the flips below count that injected drift; add rollout.router_flip_prob=0 "
            "rollout.router_noise_std=0 to measure the checkpoint's natural drift alone")


def dial_lines(res: dict) -> list[str]:
    """The summary's block on the routing-drift dial (`analysis.dial_report`): settings, injected, total and the
    natural drift's lower bound; [] without the dial."""
    from analysis.dial_report import probe_dial

    d = probe_dial(res)
    if d is None:
        return []
    return [f"routing-drift dial ON ({d.settings}): its injected drift, apart from the rest",
            f"  injected: routes the dial changed        {_num(d.injected)} of the rollout's (token, MoE layer) routes "
            "(routing/dial_flip_frac)",
            f"  total: routes rollout vs learner differ {_num(d.total)} (mean over MoE layers of routing/layer_disagree)",
            f"  natural (learner vs undialled routes)   not measured under the dial; at least "
            f"{_num(d.natural_lower_bound)} (total - injected); probe without the dial to measure it"]


def summary_text(res: dict) -> str:
    from moe_gspo.rollout.fp8 import rollout_precision

    precision = rollout_precision(res["dtype"], res.get("quantization"), res.get("fp8_scale"), res["engine"],
                                  bool(res.get("fp8_activations")))
    dial = dial_lines(res)
    lines = [f"probe of {res['model']}  (rollout: {res['engine']} engine in {precision}; learner: Megatron-core in "
             f"{res.get('learner_dtype', '?')}; {res['num_sequences']} sequences, {res['num_tokens']} response tokens)",
             *dial,
             "routing disagreement rollout vs learner (fraction of tokens whose top-k set differs"
             + ("; the dial's injected drift included):" if dial else "):")]
    for lid, v in zip(res["layer_ids"], res["routing/layer_disagree"]):
        lines.append(f"  layer {lid:3d}: {v:.4f}")
    lines += [f"any-layer flip fraction     {res['routing/any_layer_flip']:.4f}",
              f"k1 KL / k3 KL               {res['mismatch/k1_kl']:.3e} / {res['mismatch/k3_kl']:.3e}",
              f"|dlogp| mean / max          {res['mismatch/logp_abs_diff_mean']:.3e} / {res['mismatch/logp_abs_diff_max']:.3e}",
              f"extreme tokens >ln2 / >ln5  {res['mismatch/extreme_frac_ln2']:.4f} / {res['mismatch/extreme_frac_ln5']:.4f}",
              f"ratio var token / seq       {res['mismatch_ratio/token_var']:.3e} / {res['mismatch_ratio/seq_var']:.3e}",
              f"share of token-ratio variance on flipped / agreed tokens  "
              f"{_num(res['mismatch_ratio/token_var_share_flipped'])} / {_num(res['mismatch_ratio/token_var_share_agreed'])}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Exit codes as `moe_gspo.train` (0 done, 2 a user error printed once, 3 a rank failure)."""
    from moe_gspo.run.errors import run_entry  # the rest is imported inside it (a signal there is one line)

    out_path: list[str] = []

    def body() -> int:
        from moe_gspo.files import atomic_write_text
        from moe_gspo.run.activity import exit_with_launcher
        from moe_gspo.run.setup import quiet_known_warnings
        from moe_gspo.run.sinks import _jsonable

        quiet_known_warnings()
        exit_with_launcher()  # kill -9 of torchrun must not leave this worker writing
        args = parse_args(argv)
        out_path.append(args.out)
        from analysis.phase_gate import (
            Thresholds, check_thresholds, gate_notes, load_fits, phase_keys, phase_lines, violations,
        )

        gate = Thresholds(max_k3=args.max_k3, max_flip=args.max_flip, max_critical_frac=args.max_critical_frac,
                          phase_method=args.phase_method)
        check_thresholds(gate, have_phase=args.phase is not None)
        fits = load_fits(args.phase, gate) if args.phase else None  # before any compute: a bad --phase is one line

        with warnings.catch_warnings():
            if int(os.environ.get("RANK", "0")) != 0:  # every rank loads the same config: warn once, on rank 0
                warnings.simplefilter("ignore", UserWarning)
            cfg = probe_config(args)
        note = dial_note(cfg, args)
        if note and int(os.environ.get("RANK", "0")) == 0:
            print(note, flush=True)  # before any model loads: a dialled config does not pass for a plain one
        res = probe(args, cfg)
        if fits is not None:
            res.update(phase_keys(res, fits))
        failed = violations(res, gate, fits)
        res["gate/violations"] = failed
        if int(os.environ.get("RANK", "0")) == 0:
            out = Path(args.out)
            out.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(out, json.dumps({k: _jsonable(v) for k, v in res.items()}, indent=1))  # NaN -> null
            print(summary_text(res))
            if "localize/first_divergence" in res:
                from moe_gspo.probe_localize import write_localize_outputs

                write_localize_outputs(res, out, args.localize_out)
            print(f"wrote {out}")
            if fits is not None:
                print("\n".join(phase_lines(res, fits) + gate_notes(gate, fits)))
            for line in failed:
                print(line, file=sys.stderr)
        return 1 if failed else 0

    def how_to_resume() -> str:
        return f"nothing was written to {out_path[0]}; rerun the same command" if out_path else "rerun the same command"

    try:
        return run_entry(body, how_to_resume=how_to_resume)
    finally:
        parallel = sys.modules.get("moe_gspo.mcore.parallel")
        if parallel is not None:
            parallel.destroy_distributed()


if __name__ == "__main__":
    sys.exit(main())
