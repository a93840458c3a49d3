"""A floor on the host memory one RL step's batch needs, checked before any model is built.

`rollout.samples_per_prompt=1000000` or `rollout.prompts_per_step=1000000` used to reach the allocator
and end after half a minute or more in a raw traceback. `check_batch_fits_host` counts a lower bound of
what such a step must hold at once, from the config alone (the geometry of `moe_gspo.plan.from_config.
resolve_hf_config`, the sequence length of `sequence_length`), and refuses a config whose bound exceeds
this machine's physical memory with one ValueError naming the field and the fix:

- every rank holds the step's whole global batch of `N = prompts_per_step x samples_per_prompt`
  sequences of `T` tokens (`moe_gspo.run.steps.gather_samples`): per token at least the packed batch
  (`PackedBatch`: int64 ids, response mask, fp32 rollout and old-policy log-probs and advantages
  broadcast: 8 + 1 + 4 + 4 = 17 bytes), the rollout routes (`host_routes.rollout_bytes_per_token`) and the
  old-policy pass's kept routes (`host_routes.learner_kept_bytes_per_token`); the ranks of a node
  (`LOCAL_WORLD_SIZE`) each hold one;
- on a CPU machine, the transformers engine also generates its whole share (`N / world`) in one batch,
  with a KV cache of `2 x layers x kv_heads x head_dim` values per token in `rollout.dtype`.
It is a floor, not a plan (activations, weights, logits and Python objects come on top), so it only
stops configs that cannot possibly run; `python -m moe_gspo.plan` counts the GPU side in full.
"""

from __future__ import annotations

import os

PACKED_BYTES_PER_TOKEN = 17
"""int64 token id + response mask byte + fp32 rollout log-prob + fp32 old-policy log-prob."""


def physical_memory_bytes() -> int | None:
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def batch_floor_bytes(cfg, *, world_size: int, local_ranks: int, on_cuda: bool) -> dict[str, float]:
    """The node's host bytes (lower bound) of one step's batch: {"batch": ..., "kv_cache": ...}."""
    from moe_gspo.plan.from_config import resolve_hf_config, sequence_length
    from moe_gspo.plan.host_routes import learner_kept_bytes_per_token, rollout_bytes_per_token
    from moe_gspo.plan.params import Geometry
    from moe_gspo.rollout.engine_spec import engine_spec

    r = cfg.rollout
    geom = Geometry.from_hf(resolve_hf_config(cfg)[0])
    seq_len, _ = sequence_length(cfg)
    tokens = float(r.prompts_per_step) * float(r.samples_per_prompt) * seq_len
    per_token = (PACKED_BYTES_PER_TOKEN + rollout_bytes_per_token(geom, record_routes=r.record_routes)
                 + learner_kept_bytes_per_token(geom))
    out = {"batch": tokens * per_token * max(1, local_ranks), "kv_cache": 0.0}
    if not engine_spec(r.engine).kv_budget and not on_cuda:  # the whole share's KV cache at once
        dtype_bytes = 2 if r.dtype == "bfloat16" else 4
        kv = 2 * geom.num_layers * geom.num_kv_heads * geom.head_dim * dtype_bytes
        out["kv_cache"] = tokens / max(1, world_size) * kv * max(1, local_ranks)
    return out


def check_batch_fits_host(cfg, *, world_size: int | None = None, local_ranks: int | None = None,
                          on_cuda: bool | None = None, host_bytes: int | None = None) -> None:
    """Raise ValueError when one step's batch cannot fit this machine's memory (see the module docstring)."""
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if local_ranks is None:
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    if on_cuda is None:
        import torch

        on_cuda = torch.cuda.is_available()
    host = physical_memory_bytes() if host_bytes is None else host_bytes
    if not host:
        return
    need = batch_floor_bytes(cfg, world_size=world_size, local_ranks=local_ranks, on_cuda=on_cuda)
    total = sum(need.values())
    if total <= host:
        return
    r = cfg.rollout
    n = r.prompts_per_step * r.samples_per_prompt
    field, value = (("rollout.samples_per_prompt", r.samples_per_prompt) if r.samples_per_prompt >= r.prompts_per_step
                    else ("rollout.prompts_per_step", r.prompts_per_step))
    fits = max(1, int(value * host / total))
    parts = f"{need['batch'] / 2**30:.1f} GiB batch" + (f" + {need['kv_cache'] / 2**30:.1f} GiB rollout KV cache"
                                                         if need["kv_cache"] else "")
    raise ValueError(f"{field}={value}: a step of {r.prompts_per_step} prompts x {r.samples_per_prompt} samples = "
                     f"{n} sequences needs at least {total / 2**30:.1f} GiB of host memory on this node ({parts}, "
                     f"{local_ranks} rank(s)), and this machine has {host / 2**30:.1f} GiB; lower {field} "
                     f"(this floor alone allows at most {fits})")
