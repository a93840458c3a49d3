"""Checks of the sizes a config asks for, at config time (`moe_gspo.config_checks.validate` calls them).

- `check_tiny(model.tiny)`: the tiny model's mapping is checked like every other section: known keys (the
  fields of `moe_gspo.tiny.TINY_DEFAULTS`, and `initializer_range`), their types and their bounds. A typo
  (`{hidden_sise: 128}`) or YAML's `{hidden_size:128}` (no space after the colon: one key `hidden_size:128`)
  used to train the default model silently; a list or mapping where a number belongs (an alias bomb) is
  refused before anything walks it. Whether the model fits the machine is the host-memory floor's question
  (`moe_gspo.plan.batch_bound`, which counts its parameters), asked before any model is built.
- `check_eval_size(eval)`: every size of the eval section bounded (the eval set is built in memory at start-up
  and generated in full at every evaluation: `num_prompts: 1e9` sat for minutes with nothing written, issue 49;
  `num_prompts: 100000, samples_per_prompt: 100000` was SIGKILLed after 129 s with an empty metrics.jsonl,
  issue 59): `eval.num_prompts` and `eval.holdout` at most `MAX_EVAL_PROMPTS`, `eval.samples_per_prompt` at most
  `MAX_EVAL_SAMPLES_PER_PROMPT`, their product (64 prompts for a synthetic task's null) at most
  `MAX_EVAL_GENERATIONS`, `eval.max_new_tokens` at most `MAX_NEW_TOKENS`.

Errors are one ValueError naming the field and the fix; values in messages are shortened (`short`), so that no
message expands a huge value.
"""

from __future__ import annotations

import difflib
import math
import reprlib

from moe_gspo.tiny import TINY_DEFAULTS

MAX_EVAL_PROMPTS = 100_000
"""The most prompts one evaluation may have (`eval.num_prompts`): ~26 MB of prompts held for the run, and that
many generations per evaluation (64 is the synthetic tasks' default)."""
MAX_EVAL_SAMPLES_PER_PROMPT = 1024
"""The most responses per eval prompt (`eval.samples_per_prompt`, the k of pass@k)."""
MAX_EVAL_GENERATIONS = 1_000_000
"""The most responses one evaluation may generate (`eval.num_prompts x eval.samples_per_prompt`)."""
MAX_NEW_TOKENS = 1 << 20
"""The longest response a config may ask for (`eval.max_new_tokens`): beyond any model's context (prompt plus
response are checked against the context itself at start-up, `moe_gspo.tasks.lengths`)."""
MAX_TINY_INT = 2**31 - 1
"""Upper bound of the tiny model's integer fields (sizes and token ids index int32 tensors); the memory floor
refuses much less."""

_POSITIVE = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
             "num_attention_heads", "num_key_value_heads", "head_dim", "num_experts", "num_experts_per_tok",
             "decoder_sparse_step", "max_position_embeddings")
_TOKEN_IDS = ("pad_token_id", "eos_token_id", "bos_token_id")
_BOOLS = ("norm_topk_prob", "tie_word_embeddings")
_FLOATS = ("rms_norm_eps", "initializer_range")
TINY_KEYS = tuple(TINY_DEFAULTS) + ("initializer_range",)
"""The keys `model.tiny` may set."""
_ROPE_KEYS = {"rope_type": ("default",), "rope_theta": None}

_short_repr = reprlib.Repr()
_short_repr.maxlevel, _short_repr.maxlist, _short_repr.maxdict, _short_repr.maxstring = 2, 4, 4, 40


def short(value) -> str:
    """`repr(value)` cut short (a few elements, two levels): safe for any value, however large."""
    return _short_repr.repr(value)


def _int(key: str, value, lo: int, hi: int = MAX_TINY_INT) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"model.tiny.{key}={short(value)} must be an integer")
    if not lo <= value <= hi:
        raise ValueError(f"model.tiny.{key}={value} must be in [{lo}, {hi}]")
    return value


def _unknown_key(key) -> str:
    if not isinstance(key, str):
        return f"model.tiny has the key {short(key)}; its keys are field names: {', '.join(TINY_KEYS)}"
    name, colon, rest = key.partition(":")
    if colon and name.strip() in TINY_KEYS:
        return (f"model.tiny has the key {key!r}: YAML needs a space after the colon ({{{name.strip()}: "
                f"{rest.strip()}}}); write it so")
    close = difflib.get_close_matches(key, TINY_KEYS, n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    return (f"unknown key model.tiny.{key}: {hint}the tiny model's keys are {', '.join(TINY_KEYS)} "
            "(moe_gspo/tiny.py, TINY_DEFAULTS)")


def check_tiny(tiny: dict) -> None:
    """Known keys, types and bounds of `model.tiny` (see the module docstring); ValueError naming the key."""
    for key in tiny:
        if key not in TINY_KEYS:
            raise ValueError(_unknown_key(key))
    merged = {**TINY_DEFAULTS, **tiny}
    for key in _POSITIVE:
        if key in tiny:
            _int(key, tiny[key], 1)
    for key in _BOOLS:
        if key in tiny and not isinstance(tiny[key], bool):
            raise ValueError(f"model.tiny.{key}={short(tiny[key])} must be true or false")
    for key in _FLOATS:
        if key in tiny:
            v = tiny[key]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
                raise ValueError(f"model.tiny.{key}={short(v)} must be a number > 0")
    layers = merged["num_hidden_layers"]
    if "mlp_only_layers" in tiny:
        v = tiny["mlp_only_layers"]
        if not isinstance(v, list):
            raise ValueError(f"model.tiny.mlp_only_layers={short(v)} must be a list of layer indices, e.g. [0]")
        for i in v:
            _int("mlp_only_layers[]", i, 0, layers - 1)
    if "rope_parameters" in tiny:
        v = tiny["rope_parameters"]
        if not isinstance(v, dict) or not set(v) <= set(_ROPE_KEYS):
            raise ValueError(f"model.tiny.rope_parameters={short(v)} must be a mapping with rope_type (default) and "
                             "rope_theta (a number > 0), e.g. {rope_type: default, rope_theta: 10000.0}")
        if v.get("rope_type", "default") != "default":
            raise ValueError(f"model.tiny.rope_parameters.rope_type={short(v['rope_type'])}: only default RoPE is "
                             "supported by the learner")
        theta = v.get("rope_theta", 10000.0)
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not (math.isfinite(theta) and theta > 0):
            raise ValueError(f"model.tiny.rope_parameters.rope_theta={short(theta)} must be a number > 0")
    for key in _TOKEN_IDS:
        if key in tiny or "vocab_size" in tiny:
            _int(key, merged[key], 0, merged["vocab_size"] - 1)
    if merged["head_dim"] % 2:
        raise ValueError(f"model.tiny.head_dim={merged['head_dim']} must be even (RoPE rotates pairs of dimensions)")
    heads, kv = merged["num_attention_heads"], merged["num_key_value_heads"]
    if heads % kv:
        raise ValueError(f"model.tiny.num_attention_heads={heads} must be a multiple of num_key_value_heads={kv} "
                         "(grouped-query attention)")
    if merged["num_experts_per_tok"] > merged["num_experts"]:
        raise ValueError(f"model.tiny.num_experts_per_tok={merged['num_experts_per_tok']} must be at most "
                         f"num_experts={merged['num_experts']}")


def check_eval_size(e, *, synthetic: bool = False) -> None:
    """Every size of the `eval` section `e` bounded (see the module docstring); `synthetic`: the task is a synthetic
    one (eval.num_prompts null = 64 prompts). One ValueError naming the field."""
    held = "the eval set is held in memory for the whole run and generated in full at every evaluation"
    for field, value, most, why in (
            ("num_prompts", e.num_prompts, MAX_EVAL_PROMPTS, held), ("holdout", e.holdout, MAX_EVAL_PROMPTS, held),
            ("samples_per_prompt", e.samples_per_prompt, MAX_EVAL_SAMPLES_PER_PROMPT, held),
            ("max_new_tokens", e.max_new_tokens, MAX_NEW_TOKENS, "longer than any model's context")):
        if value is not None and value > most:
            null = " (null = the whole eval file, or 64 prompts of a synthetic task)" if field == "num_prompts" else ""
            raise ValueError(f"eval.{field}={value} is more than {most}: {why}; lower it{null}")
    prompts = e.num_prompts if e.num_prompts is not None else (64 if synthetic else None)
    if prompts is not None and prompts * e.samples_per_prompt > MAX_EVAL_GENERATIONS:
        raise ValueError(f"eval.samples_per_prompt={e.samples_per_prompt} x eval.num_prompts={prompts} = "
                         f"{prompts * e.samples_per_prompt} responses per evaluation is more than "
                         f"{MAX_EVAL_GENERATIONS}; lower eval.samples_per_prompt or eval.num_prompts")
