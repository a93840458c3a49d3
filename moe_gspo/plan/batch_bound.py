"""A floor on the host memory one RL step's batch needs, checked before any model is built.

`rollout.samples_per_prompt=1000000` or `rollout.prompts_per_step=1000000` used to reach the allocator
and end after half a minute or more in a raw traceback. `check_batch_fits_host` counts a lower bound of
what such a step must hold at once, from the config alone (the geometry of `moe_gspo.plan.from_config.
geometry_config`, the sequence length of `sequence_length`), and refuses a config whose bound exceeds
this machine's physical memory with one ValueError naming the field and the fix:

- every rank holds the step's whole global batch of `N = prompts_per_step x samples_per_prompt`
  sequences of `T` tokens (`moe_gspo.run.steps.gather_samples`): per token at least the packed batch
  (`PackedBatch`: int64 ids, response mask, fp32 rollout and old-policy log-probs and advantages
  broadcast: 8 + 1 + 4 + 4 = 17 bytes), the rollout routes (`host_routes.rollout_bytes_per_token`) and the
  old-policy pass's kept routes (`host_routes.learner_kept_bytes_per_token`); the ranks of a node
  (`LOCAL_WORLD_SIZE`) each hold one;
- on a CPU machine, the transformers engine also generates its whole share (`N / world`) in one batch,
  with a KV cache of `2 x layers x kv_heads x head_dim` values per token in `rollout.dtype`.
- the model (issue 49: `model.tiny={hidden_size: 1048576}` ran 174 s into the OOM killer, `vocab_size: 1e10`
  into an allocation traceback), counted from the geometry (`moe_gspo.plan.params.megatron_counts`): on a CPU
  every rank holds its learner's parameters, gradients and two Adam moments (at least 4 x the parameter dtype's
  bytes per parameter, experts split over `parallel.expert_parallel_size`) and its rollout engine's whole copy
  in `rollout.dtype`; the tiny model is built in fp32 on the host first, on a GPU machine too;
- on a CPU, the learner's activations of one micro-batch (`train.micro_batch_size` sequences, or this rank's
  share of a mini-batch): the fp32 logits (`4 V` bytes per token) and every layer's saved input (`L h` values
  per token in the parameter dtype).
- on a CPU, the learner's attention (issue 59: `num_attention_heads: 20000, num_key_value_heads: 1` was counted
  at 4.58 GiB, its weights only, and ran past 7 GiB; 100,000 heads passed): per token and layer, with `a`
  query heads, `g` key/value heads of `d` dimensions, Megatron's `SelfAttention` holds the fused QKV output
  (`(a + 2g) d` values) and, at once inside its query norm and rotary embedding, `ATTENTION_QUERY_COPIES`
  more query-sized tensors (`a d`: the query, its norm's square and product, the rotated halves and their
  sum); the autograd graph of a training micro-batch keeps `ATTENTION_SAVED_COPIES` query-sized tensors of
  every layer (the normed and the rotated query, the attention output) besides the QKV output. The floor
  takes the larger of one no-grad forward over the old-policy pass's batch (`train.micro_batch_size` or
  this rank's whole share) and one training micro-batch's graph over all layers, in the parameter dtype.
It is a floor, not a plan (Python, torch's own memory and allocator slack come on top: ~0.6 GiB for the
default tiny model), so it only stops configs that cannot possibly run; `python -m moe_gspo.plan` counts the
GPU side in full. `python -m benchmarks.host_floor_bench` measures it against the peak RSS of real runs.
It is compared with the memory *available* now (`MemAvailable`), not the machine's total.
"""

from __future__ import annotations

import math
import os

PACKED_BYTES_PER_TOKEN = 17
"""int64 token id + response mask byte + fp32 rollout log-prob + fp32 old-policy log-prob."""
ATTENTION_QUERY_COPIES = 5
"""Query-sized tensors (`heads x head_dim` per token) one attention layer's forward holds at once on a CPU
besides its fused QKV output (see the module docstring)."""
ATTENTION_SAVED_COPIES = 3
"""Query-sized tensors per layer and token the autograd graph keeps besides the fused QKV output."""


def physical_memory_bytes() -> int | None:
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def available_memory_bytes() -> int | None:
    """The memory available to a new process now (`MemAvailable` of /proc/meminfo: free memory plus the page
    cache and slabs the kernel can reclaim); the physical memory where there is no /proc/meminfo."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return physical_memory_bytes()


def attention_floor_bytes(geom, *, infer_tokens: float, train_tokens: float, param_bytes: int) -> float:
    """One rank's attention activations on a CPU (see the module docstring): the larger of one layer's no-grad
    forward over `infer_tokens` and the graph of `train_tokens` over all layers."""
    query = geom.num_heads * geom.head_dim
    qkv = (geom.num_heads + 2 * geom.num_kv_heads) * geom.head_dim
    no_grad = infer_tokens * (qkv + ATTENTION_QUERY_COPIES * query)
    graph = train_tokens * geom.num_layers * (qkv + ATTENTION_SAVED_COPIES * query)
    return max(no_grad, graph) * param_bytes


def batch_floor_bytes(cfg, *, world_size: int, local_ranks: int, on_cuda: bool) -> dict[str, float]:
    """The node's host bytes (lower bound) of one step: {"batch", "kv_cache", "model", "activations", "attention"}."""
    from moe_gspo.plan.from_config import geometry_config, sequence_length
    from moe_gspo.plan.host_routes import learner_kept_bytes_per_token, rollout_bytes_per_token
    from moe_gspo.plan.params import Geometry, megatron_counts
    from moe_gspo.rollout.engine_spec import engine_spec

    r, tr, m = cfg.rollout, cfg.train, cfg.model
    geom = Geometry.from_hf(geometry_config(cfg))
    seq_len, _ = sequence_length(cfg)
    seqs = float(r.prompts_per_step) * float(r.samples_per_prompt)
    tokens = seqs * seq_len
    ranks = max(1, local_ranks)
    per_token = (PACKED_BYTES_PER_TOKEN + rollout_bytes_per_token(geom, record_routes=r.record_routes)
                 + learner_kept_bytes_per_token(geom))
    out = {"batch": tokens * per_token * ranks, "kv_cache": 0.0, "model": 0.0, "activations": 0.0, "attention": 0.0}
    rollout_bytes = 2 if r.dtype == "bfloat16" else 4
    if not engine_spec(r.engine).kv_budget and not on_cuda:  # the whole share's KV cache at once
        kv = 2 * geom.num_layers * geom.num_kv_heads * geom.head_dim * rollout_bytes
        out["kv_cache"] = tokens / max(1, world_size) * kv * ranks
    counts = megatron_counts(geom, vocab_pad_multiple=m.vocab_pad_multiple)
    param_bytes = 2 if m.params_dtype == "bfloat16" or (m.params_dtype == "auto" and on_cuda) else 4
    tiny_build = 4.0 * counts.total if m.path is None else 0.0  # build_tiny_model: fp32, on the host
    if on_cuda:
        out["model"] = tiny_build * ranks
        return out
    ep = max(1, cfg.parallel.expert_parallel_size)
    learner = 4.0 * param_bytes * counts.per_rank(ep)  # parameters, gradients, two Adam moments
    out["model"] = (learner + max(rollout_bytes * float(counts.total), tiny_build)) * ranks
    dp = max(1, world_size // ep)
    mb_seqs = tr.micro_batch_size or math.ceil(seqs / max(1, tr.num_minibatches) / dp)
    v_pad = counts.embedding // max(1, geom.hidden)
    out["activations"] = mb_seqs * seq_len * (4.0 * v_pad + geom.num_layers * geom.hidden * param_bytes) * ranks
    infer_seqs = tr.micro_batch_size or math.ceil(seqs / dp)  # the old-policy pass's micro-batch
    out["attention"] = attention_floor_bytes(geom, infer_tokens=infer_seqs * seq_len, train_tokens=mb_seqs * seq_len,
                                             param_bytes=param_bytes) * ranks
    return out


def _fix(cfg, need: dict[str, float], local_ranks: int) -> tuple[str, str, str]:
    """(what needs the memory, what it is, the fix) for the largest part of `need`."""
    from moe_gspo.tiny import TINY_DEFAULTS

    r, m, tr = cfg.rollout, cfg.model, cfg.train
    part = max(need, key=need.get)
    if part == "model":
        model = (f"model.tiny={m.tiny or {}}" if m.path is None else f"model.path={m.path}")
        fix = ("shrink model.tiny (hidden_size, num_experts, vocab_size, num_hidden_layers, ...)" if m.path is None
               else "run it on GPUs, or on more nodes with parallel.expert_parallel_size > 1")
        return model, f"the model's weights, gradients and optimizer state on {local_ranks} rank(s)", fix
    heads = (m.tiny or {}).get("num_attention_heads") if m.path is None else None
    if part == "attention" and (tr.micro_batch_size or (heads or 0) > TINY_DEFAULTS["num_attention_heads"]):
        what = (f"model.tiny.num_attention_heads={heads}" if heads is not None
                else f"train.micro_batch_size={tr.micro_batch_size}")
        return (what, "the attention's activations (heads x head_dim per token and layer)",
                "use fewer attention heads, or set train.micro_batch_size to fewer sequences")
    if part == "activations":
        return (f"train.micro_batch_size={tr.micro_batch_size}", "one micro-batch's activations (logits and saved "
                "layer inputs)", "set train.micro_batch_size to fewer sequences, or raise train.num_minibatches")
    field, value = (("rollout.samples_per_prompt", r.samples_per_prompt) if r.samples_per_prompt >= r.prompts_per_step
                    else ("rollout.prompts_per_step", r.prompts_per_step))
    step = f"a step of {r.prompts_per_step} prompts x {r.samples_per_prompt} samples"
    if part == "attention":
        step += (" (the attention's activations of the old-policy pass, one forward over the whole batch with "
                 "train.micro_batch_size=0)")
    return f"{field}={value}", step, f"lower {field}"


def check_batch_fits_host(cfg, *, world_size: int | None = None, local_ranks: int | None = None,
                          on_cuda: bool | None = None, host_bytes: int | None = None) -> None:
    """Raise ValueError when one step cannot fit this machine's available memory (see the module docstring);
    `host_bytes`: the memory to compare with (default `available_memory_bytes()`)."""
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if local_ranks is None:
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    if on_cuda is None:
        import torch

        on_cuda = torch.cuda.is_available()
    host = available_memory_bytes() if host_bytes is None else host_bytes
    if not host:
        return
    need = batch_floor_bytes(cfg, world_size=world_size, local_ranks=local_ranks, on_cuda=on_cuda)
    total = sum(need.values())
    if total <= host:
        return
    names = {"batch": "batch", "kv_cache": "rollout KV cache", "model": "model", "activations": "activations",
             "attention": "attention"}
    parts = " + ".join(f"{v / 2**30:.1f} GiB {names[k]}" for k, v in need.items() if v >= 0.05 * 2**30)
    what, needs, fix = _fix(cfg, need, local_ranks)
    if what.startswith("rollout."):
        field, value = what.split("=")
        fix += f" (this floor alone allows at most {max(1, int(int(value) * host / total))})"
    raise ValueError(f"{what}: {needs} needs at least {total / 2**30:.1f} GiB of host memory on this node ({parts}, "
                     f"{local_ranks} rank(s)), and this machine has {host / 2**30:.1f} GiB available; {fix}")
