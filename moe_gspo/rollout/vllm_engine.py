"""A thin vLLM 0.33 rollout engine that returns routed experts (for R3) and sampled-token log-probs.

vLLM needs CUDA and pins its own torch (2.14 for 0.33), so it is an optional extra
(``pip install 'moe-gspo[vllm]'``) and is imported lazily. The engine itself only builds requests
and calls `vllm.LLM`; everything it converts goes through the pure functions below, which the unit
tests exercise with stand-ins shaped like vLLM's objects.

What vLLM 0.33 returns (read from its source, `vllm/outputs.py`, `vllm/v1/engine/output_processor.py`,
`vllm/distributed/aux_output_connector/connector.py`, `vllm/model_executor/layers/fused_moe/
routed_experts_capturer.py`):
- ``LLM(..., enable_return_routed_experts=True)`` fills ``CompletionOutput.routed_experts``, a numpy
  array ``[seq_len, num_layers, top_k]`` of logical expert ids, dtype uint8 when the model has
  <= 256 experts, else uint16. Rows are token positions ``routed_experts_prompt_start ..
  P + R - 2`` of ``prompt + output`` (the scheduler returns rows up to ``num_tokens - 1``: the
  last sampled token is never run through the model), so with the default
  ``SamplingParams.routed_experts_prompt_start = 0``, ``seq_len = P + R - 1``.
- The layer axis has one column per *decoder layer* (``get_total_num_hidden_layers()``), indexed by
  the model layer index; columns of dense layers (e.g. Qwen3-MoE ``mlp_only_layers``) are never
  written. `routed_experts_to_routes` keeps only the MoE layers' columns.
- ``SamplingParams(logprobs=0)`` returns, per generated token, a mapping ``{token_id: Logprob}``
  that holds at least the sampled token (``CompletionOutput.logprobs[t][token_ids[t]].logprob``);
  with the default ``logprobs_mode="raw_logprobs"`` these are log-softmax of the raw logits, before
  temperature / top-p, i.e. the model's own distribution that importance ratios need.
- ``n > 1`` with a ``seed`` gives child j the seed ``seed + j``.
- Weight updates: ``LLM.collective_rpc("reload_weights", kwargs={"weights_iterator": ...,
  "is_checkpoint_format": True})`` runs `GPUModelRunner.reload_weights` on every worker, which
  loads checkpoint-named tensors through the model's own `load_weights` (layer-wise, re-running
  the post-load weight processing). Tensors travel over vLLM's msgpack IPC (no pickling needed).
  All weights go in one call (the layer-wise reload expects whole layers). The prefix cache is
  reset afterwards, since cached KV blocks were computed with the old weights.

Weight names: vLLM's Qwen3-MoE loader is written for the on-disk checkpoint naming
(``model.layers.{l}.mlp.experts.{e}.{gate,up,down}_proj.weight``); vLLM 0.33 also accepts fused
expert tensors, but we send the on-disk per-expert layout, the path every vLLM version supports.
`split_fused_experts` converts transformers-5's in-memory fused layout (``experts.gate_up_proj``
[E, 2I, H] with the gate rows first, then the up rows; ``experts.down_proj`` [E, H, I]).

Simplified / left out: no tensor-parallel weight sharding by us (vLLM's loader shards), no
NCCL/IPC weight-transfer backends (vLLM's `weight_transfer_config`), no router probabilities (vLLM
does not return them), no async engine.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import torch

from moe_gspo.rollout.base import RolloutEngine, RolloutSample, SamplingParams
from moe_gspo.routing.trace import ids_dtype

_INSTALL_HINT = ("VLLMEngine needs vLLM: pip install 'moe-gspo[vllm]' (vLLM 0.33 requires a CUDA GPU "
                 "and pins torch 2.14; install it in its own environment)")

_FUSED_GATE_UP = re.compile(r"^(?P<prefix>.*\.experts)\.gate_up_proj$")
_FUSED_DOWN = re.compile(r"^(?P<prefix>.*\.experts)\.down_proj$")


def _import_vllm():
    try:
        import vllm  # noqa: PLC0415
    except ImportError as e:
        raise ImportError(_INSTALL_HINT) from e
    return vllm


# --------------------------------------------------------------------------------------------------
# pure helpers (unit-tested without vLLM)
def num_experts_from_config(config: dict) -> int:
    """Experts per MoE layer of a Qwen3-MoE `config.json` dict (0 for a dense model).

    Released checkpoints spell it ``num_experts``; transformers 5 writes ``num_local_experts``.
    """
    return int(config.get("num_experts") or config.get("num_local_experts") or 0)


def moe_layer_ids_from_config(config: dict) -> list[int]:
    """Model layer indices of the MoE layers of a Qwen3-MoE `config.json` dict.

    A layer is MoE when the model has experts, ``layer not in mlp_only_layers`` and
    ``(layer + 1) % decoder_sparse_step == 0`` (transformers' rule).
    """
    try:
        num_layers = int(config["num_hidden_layers"])
    except KeyError as e:
        raise ValueError("config has no 'num_hidden_layers'; is this a Qwen3-MoE config.json?") from e
    if num_experts_from_config(config) <= 0:
        return []
    dense = set(config.get("mlp_only_layers") or [])
    step = int(config.get("decoder_sparse_step", 1) or 1)
    return [l for l in range(num_layers) if l not in dense and (l + 1) % step == 0]


def vllm_sampling_kwargs(sampling: SamplingParams, prompt_index: int) -> dict[str, Any]:
    """Keyword arguments for ``vllm.SamplingParams`` for prompt `prompt_index`.

    The seed is ``sampling.seed + prompt_index * n``; vLLM adds the sample index j, so every
    (prompt, sample) pair of one call gets its own seed. ``logprobs=0`` asks for the sampled token's
    log-prob only; ``detokenize=False`` skips text decoding (we only use token ids).
    """
    if sampling.n < 1:
        raise ValueError(f"sampling.n must be >= 1, got {sampling.n}")
    if sampling.max_new_tokens < 1:
        raise ValueError(f"sampling.max_new_tokens must be >= 1, got {sampling.max_new_tokens}")
    return dict(n=int(sampling.n), temperature=float(sampling.temperature), top_p=float(sampling.top_p),
                top_k=0, max_tokens=int(sampling.max_new_tokens),
                seed=int(sampling.seed) + int(prompt_index) * int(sampling.n), logprobs=0,
                detokenize=False)


def routed_experts_to_routes(arr: Any, prompt_len: int, response_len: int, num_experts: int, *,
                             moe_layer_ids: Sequence[int] | None = None) -> np.ndarray:
    """Convert vLLM's ``CompletionOutput.routed_experts`` to a ``routes_TLK`` array (uint8/uint16).

    `arr` is ``[T, num_layers, K]`` integer ids with ``T = P + R - 1`` (vLLM with
    ``routed_experts_prompt_start=0``; ``T = P + R`` is accepted too). When `moe_layer_ids` is given
    and `arr` has more layer columns than MoE layers, the MoE columns are selected (vLLM 0.33 has
    one column per decoder layer); with equally many columns, `arr` is taken as MoE-only.
    """
    a = np.asarray(arr)
    if a.ndim != 3:
        raise ValueError(f"routed_experts must have shape [seq_len, num_layers, top_k], got {a.shape}")
    if a.dtype.kind not in "iu":
        raise ValueError(f"routed_experts must hold integer expert ids, got dtype {a.dtype}")
    total = int(prompt_len) + int(response_len)
    if not total - 1 <= a.shape[0] <= total:
        raise ValueError(
            f"routed_experts has {a.shape[0]} rows, expected prompt_len + response_len - 1 = {total - 1} "
            f"(rows are positions 0..P+R-2); was SamplingParams.routed_experts_prompt_start set to a "
            f"non-zero value, or the prompt/response lengths mixed up?")
    if moe_layer_ids is not None:
        ids = [int(i) for i in moe_layer_ids]
        if a.shape[1] != len(ids):
            if not ids or max(ids) >= a.shape[1] or min(ids) < 0:
                raise ValueError(f"routed_experts has {a.shape[1]} layer columns, which neither equals the "
                                 f"{len(ids)} MoE layers nor covers moe_layer_ids={ids}")
            a = a[:, ids, :]
    if a.size:
        lo, hi = int(a.min()), int(a.max())
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"routed_experts holds expert ids in [{lo}, {hi}], outside [0, {num_experts}); "
                             f"wrong num_experts, or a dense layer's column kept (pass moe_layer_ids)?")
    return np.ascontiguousarray(a.astype(ids_dtype(num_experts), copy=False))


def sampled_logprobs(token_ids: Sequence[int], logprobs: Any) -> np.ndarray:
    """float32 [R]: ``logprobs[t][token_ids[t]].logprob`` for each generated token.

    `logprobs` is ``CompletionOutput.logprobs``: a list (or vLLM ``FlatLogprobs``) with one
    ``{token_id: Logprob}`` mapping per generated token.
    """
    if logprobs is None:
        raise ValueError("CompletionOutput.logprobs is None: request them with SamplingParams(logprobs=0)")
    if len(logprobs) != len(token_ids):
        raise ValueError(f"got {len(logprobs)} logprob entries for {len(token_ids)} generated tokens")
    out = np.empty(len(token_ids), dtype=np.float32)
    for t, tok in enumerate(token_ids):
        entry = logprobs[t]
        tok = int(tok)
        if entry is None or tok not in entry:
            raise ValueError(f"logprobs[{t}] has no entry for the sampled token {tok}")
        out[t] = entry[tok].logprob
    return out


def completion_to_sample(prompt_index: int, prompt_ids: Sequence[int], completion_output: Any, *,
                         num_experts: int | None = None,
                         moe_layer_ids: Sequence[int] | None = None) -> RolloutSample:
    """A `RolloutSample` from one vLLM ``CompletionOutput``.

    Routes are converted when the output carries ``routed_experts`` and `num_experts` is given.
    Aborted or failed completions raise ValueError (they must not be trained on).
    """
    c = completion_output
    reason = c.finish_reason
    if reason is None:
        raise ValueError(f"completion {c.index} of prompt {prompt_index} has not finished")
    if reason in ("abort", "error"):
        raise ValueError(f"completion {c.index} of prompt {prompt_index} finished with {reason!r}; "
                         f"it has no usable response")
    response = np.asarray(list(c.token_ids), dtype=np.int64)
    prompt = np.asarray(list(prompt_ids), dtype=np.int64)
    routes = None
    routed = getattr(c, "routed_experts", None)
    if routed is not None and num_experts is not None:
        try:
            routes = routed_experts_to_routes(routed, len(prompt), len(response), num_experts,
                                              moe_layer_ids=moe_layer_ids)
        except ValueError as e:
            raise ValueError(f"prompt {prompt_index}, completion {c.index}: {e}") from e
    return RolloutSample(prompt_index=int(prompt_index), prompt_ids=prompt, response_ids=response,
                         response_logprobs=sampled_logprobs(response.tolist(), c.logprobs),
                         finish_reason=str(reason), routes_TLK=routes, router_probs_TLK=None,
                         extra={"stop_reason": getattr(c, "stop_reason", None)})


def request_outputs_to_samples(request_outputs: Sequence[Any], prompts: Sequence[Sequence[int]], n: int, *,
                               num_experts: int | None = None,
                               moe_layer_ids: Sequence[int] | None = None) -> list[RolloutSample]:
    """Flatten ``LLM.generate`` results into grouped samples (prompt i's n samples contiguous)."""
    if len(request_outputs) != len(prompts):
        raise ValueError(f"got {len(request_outputs)} request outputs for {len(prompts)} prompts")
    samples = []
    for i, (ro, prompt) in enumerate(zip(request_outputs, prompts)):
        if ro.prompt_token_ids is not None and list(ro.prompt_token_ids) != [int(x) for x in prompt]:
            raise ValueError(f"request output {i} is for a different prompt than prompts[{i}]")
        outs = sorted(ro.outputs, key=lambda c: c.index)
        if len(outs) != n:
            raise ValueError(f"prompt {i} returned {len(outs)} completions, expected n={n}")
        samples.extend(completion_to_sample(i, prompt, c, num_experts=num_experts,
                                            moe_layer_ids=moe_layer_ids) for c in outs)
    return samples


def split_fused_experts(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Rename transformers-5 in-memory Qwen3-MoE weights to the on-disk per-expert layout.

    ``<p>.experts.gate_up_proj`` [E, 2I, H] becomes ``<p>.experts.{e}.gate_proj.weight`` = rows
    ``[:I]`` and ``<p>.experts.{e}.up_proj.weight`` = rows ``[I:]``; ``<p>.experts.down_proj``
    [E, H, I] becomes ``<p>.experts.{e}.down_proj.weight``. Other tensors pass through unchanged.
    Outputs are views of the inputs (no copies).
    """
    for name, t in named_tensors:
        m = _FUSED_GATE_UP.match(name)
        if m:
            if t.dim() != 3 or t.shape[1] % 2:
                raise ValueError(f"{name} must be [E, 2*I, H] (gate rows then up rows), got {tuple(t.shape)}")
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                yield f"{m['prefix']}.{e}.gate_proj.weight", t[e, :inter]
                yield f"{m['prefix']}.{e}.up_proj.weight", t[e, inter:]
            continue
        m = _FUSED_DOWN.match(name)
        if m:
            if t.dim() != 3:
                raise ValueError(f"{name} must be [E, H, I], got {tuple(t.shape)}")
            for e in range(t.shape[0]):
                yield f"{m['prefix']}.{e}.down_proj.weight", t[e]
            continue
        yield name, t


# --------------------------------------------------------------------------------------------------
class VLLMEngine(RolloutEngine):
    """Rollouts with vLLM (GPU), recording routed experts for R3 when `record_routes`."""

    def __init__(self, model_dir: str | Path, *, dtype: str = "bfloat16", seed: int = 0,
                 gpu_memory_utilization: float = 0.5, max_model_len: int | None = None,
                 tensor_parallel_size: int = 1, enforce_eager: bool = False, record_routes: bool = True,
                 **llm_kwargs: Any) -> None:
        """Start `vllm.LLM` on a Hugging Face checkpoint directory; extra kwargs go to `vllm.LLM`."""
        vllm = _import_vllm()
        self._vllm = vllm
        self.model_dir = Path(model_dir)
        cfg_path = self.model_dir / "config.json"
        if not cfg_path.is_file():
            raise ValueError(f"model_dir {self.model_dir} has no config.json; pass a Hugging Face checkpoint folder")
        cfg = json.loads(cfg_path.read_text())
        self.num_experts = num_experts_from_config(cfg)
        self.moe_layer_ids = moe_layer_ids_from_config(cfg)
        self._record_routes = bool(record_routes) and self.num_experts > 0
        kw: dict[str, Any] = dict(model=str(self.model_dir), dtype=dtype, seed=int(seed),
                                  gpu_memory_utilization=float(gpu_memory_utilization),
                                  tensor_parallel_size=int(tensor_parallel_size), enforce_eager=enforce_eager,
                                  enable_return_routed_experts=self._record_routes,
                                  logprobs_mode="raw_logprobs")
        if max_model_len is not None:
            kw["max_model_len"] = int(max_model_len)
        kw.update(llm_kwargs)
        self.llm = vllm.LLM(**kw)

    @property
    def records_routes(self) -> bool:
        return self._record_routes

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[RolloutSample]:
        params = [self._vllm.SamplingParams(**vllm_sampling_kwargs(sampling, i)) for i in range(len(prompts))]
        requests = [{"prompt_token_ids": [int(t) for t in p]} for p in prompts]
        outputs = self.llm.generate(requests, sampling_params=params, use_tqdm=False)
        return request_outputs_to_samples(
            outputs, prompts, sampling.n, num_experts=self.num_experts if self._record_routes else None,
            moe_layer_ids=self.moe_layer_ids)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load transformers-named tensors (fused experts allowed) into every vLLM worker in place."""
        weights = [(name, t.detach().to("cpu").contiguous()) for name, t in split_fused_experts(named_tensors)]
        self.llm.collective_rpc("reload_weights",
                                kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()
