"""`python -m moe_gspo.probe --model DIR --prompts FILE --out drift.json`: how far apart are the
inference and training routers of a checkpoint, without training?

Samples responses with the rollout engine (`--engine hf|vllm`, in `--dtype`), recomputes the same
tokens with the Megatron learner (fp32 on CPU, bf16 on CUDA, EP = world size under torchrun), and
writes JSON with per-layer routing disagreement, the any-layer flip fraction (rows that produce
response log-probs; prompt rows under `routing_prompt/*`), the train-inference mismatch metrics
(k1/k3 KL, extreme-token fractions), the token-ratio vs sequence-ratio variance of learner/rollout
ratios, and each routing subset's share of that variance (flipped vs agreed tokens; NaN -> null
when a subset is empty).
Keys match the training loop's metrics.jsonl (there `ratio/*` of this file is `mismatch_ratio/*`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch


def read_prompts(path: str | Path) -> list[str]:
    """A text file (one prompt per line) or JSONL with a `prompt` field; blank lines skipped."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--prompts {str(p)!r} does not exist; give a text file (one prompt per line) or JSONL")
    from moe_gspo.tasks.jsonl import iter_prompt_objects

    if p.suffix == ".jsonl":
        prompts = [obj["prompt"] for _, obj in iter_prompt_objects(p)]
    else:
        from moe_gspo.tasks.jsonl import iter_text_lines

        prompts = [line.rstrip("\r\n") for _, line in iter_text_lines(p) if line.strip()]
    if not prompts:
        raise ValueError(f"--prompts {str(p)!r} holds no prompts; put one prompt per line")
    return prompts


def build_parser() -> argparse.ArgumentParser:
    from moe_gspo.run.cli import OnceArgumentParser

    p = OnceArgumentParser(prog="python -m moe_gspo.probe", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="local Hugging Face Qwen3-MoE checkpoint directory")
    p.add_argument("--prompts", required=True, help="text file (one prompt per line) or .jsonl with 'prompt'")
    p.add_argument("--out", required=True, help="output JSON path")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="rollout dtype (default bfloat16)")
    p.add_argument("--engine", choices=["hf", "vllm"], default="hf", help="rollout engine (default hf)")
    p.add_argument("--samples-per-prompt", type=int, default=4, help="responses per prompt (default 4)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="response length cap (default 32)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    return p


def probe(args: argparse.Namespace) -> dict:
    from transformers import AutoTokenizer

    from moe_gspo.config import AlgoConfig, Config, RolloutConfig
    from moe_gspo.learner.batch import PackedBatch
    from moe_gspo.learner.learner import Learner
    from moe_gspo.mcore.checkpoint import load_hf_config, load_megatron_from_hf_dir
    from moe_gspo.mcore.model import moe_layer_ids
    from moe_gspo.mcore.parallel import init_distributed
    from moe_gspo.rollout.base import SamplingParams
    from moe_gspo.run.compare import rollout_vs_learner
    from moe_gspo.run.setup import build_engine, derive_seed
    from moe_gspo.run.steps import gather_samples

    from moe_gspo.run.rundir import check_output_file
    from moe_gspo.run.setup import check_tokenizer_fits

    for name in ("samples_per_prompt", "max_new_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    check_output_file(args.out, "--out")  # before any compute
    hf_config = load_hf_config(args.model, field="--model")  # clear errors: missing dir, not a Qwen3-MoE
    prompts = read_prompts(args.prompts)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    info = init_distributed(ep_size=world, num_experts=hf_config.num_experts, seed=args.seed)
    if len(prompts) < info.dp_size:
        raise ValueError(f"--prompts has {len(prompts)} prompts, fewer than the {info.dp_size} processes; add prompts")
    bounds = [len(prompts) * r // info.dp_size for r in range(info.dp_size + 1)]
    mine = prompts[bounds[info.dp_rank]:bounds[info.dp_rank + 1]]
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    tok = AutoTokenizer.from_pretrained(args.model)
    check_tokenizer_fits(tok, hf_config, tokenizer_dir=args.model, model=args.model)
    model, _ = load_megatron_from_hf_dir(args.model, ep_size=info.ep_size, params_dtype=dtype,
                                         enable_routing_replay=False, token_dispatcher="allgather",
                                         vocab_pad_multiple=1, field="--model")
    learner = Learner(model, hf_config, parallel=info, algo=AlgoConfig(), train=None)  # inference only
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    engine = build_engine(Config(rollout=RolloutConfig(engine=args.engine, dtype=args.dtype)), args.model, tok)
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in mine]
    try:
        local = engine.generate(ids, SamplingParams(n=args.samples_per_prompt, temperature=args.temperature,
                                                    max_new_tokens=args.max_new_tokens,
                                                    seed=derive_seed(args.seed, info.dp_rank)))
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
    m["num_tokens"] = int(batch.response_mask_BS.sum())
    m["num_routed_tokens"] = int(sum(min(len(a), len(b)) for a, b in zip(batch.rollout_routes, learner_routes)))
    m["num_sequences"] = len(samples)
    out = {"model": str(args.model), "engine": args.engine, "dtype": args.dtype, "world_size": info.world_size,
           "layer_ids": moe_layer_ids(hf_config)}
    for k, v in sorted(m.items()):
        out[k.replace("mismatch_ratio/", "ratio/")] = v
    return out


def _num(v) -> str:
    return "n/a" if v is None or (isinstance(v, float) and v != v) else f"{v:.3f}"


def summary_text(res: dict) -> str:
    lines = [f"probe of {res['model']}  (engine {res['engine']}, rollout dtype {res['dtype']}, "
             f"{res['num_sequences']} sequences, {res['num_tokens']} response tokens)",
             "routing disagreement rollout vs learner (fraction of tokens whose top-k set differs):"]
    for lid, v in zip(res["layer_ids"], res["routing/layer_disagree"]):
        lines.append(f"  layer {lid:3d}: {v:.4f}")
    lines += [f"any-layer flip fraction     {res['routing/any_layer_flip']:.4f}",
              f"k1 KL / k3 KL               {res['mismatch/k1_kl']:.3e} / {res['mismatch/k3_kl']:.3e}",
              f"|dlogp| mean / max          {res['mismatch/logp_abs_diff_mean']:.3e} / {res['mismatch/logp_abs_diff_max']:.3e}",
              f"extreme tokens >ln2 / >ln5  {res['mismatch/extreme_frac_ln2']:.4f} / {res['mismatch/extreme_frac_ln5']:.4f}",
              f"ratio var token / seq       {res['ratio/token_var']:.3e} / {res['ratio/seq_var']:.3e}",
              f"share of token-ratio variance on flipped / agreed tokens  "
              f"{_num(res['ratio/token_var_share_flipped'])} / {_num(res['ratio/token_var_share_agreed'])}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Exit codes as `moe_gspo.train` (0 done, 2 a user error printed once, 3 a rank failure)."""
    from moe_gspo.mcore.parallel import destroy_distributed
    from moe_gspo.run.activity import exit_with_launcher
    from moe_gspo.run.errors import run_entry
    from moe_gspo.run.setup import quiet_known_warnings

    quiet_known_warnings()
    exit_with_launcher()  # kill -9 of torchrun must not leave this worker writing
    args = build_parser().parse_intermixed_args(argv)

    def body() -> int:
        from moe_gspo.run.sinks import _jsonable, atomic_write_text

        res = probe(args)
        if int(os.environ.get("RANK", "0")) == 0:
            out = Path(args.out)
            out.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(out, json.dumps({k: _jsonable(v) for k, v in res.items()}, indent=1))  # NaN -> null
            print(summary_text(res))
            print(f"wrote {out}")
        return 0

    try:
        return run_entry(body)
    finally:
        destroy_distributed()


if __name__ == "__main__":
    sys.exit(main())
