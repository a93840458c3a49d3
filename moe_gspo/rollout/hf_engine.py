"""A transformers rollout engine for Qwen3-MoE that records the experts every token used.

`HFEngine` holds its own copy of the policy (separate from any learner, in the inference dtype,
bfloat16 by default) and samples with a small KV-cache decoding loop instead of `model.generate`,
so that router captures map one-to-one onto token positions:

- one prefill forward over the left-padded prompts (each distinct prompt once; the cache is then
  repeated `n` times) gives the routes of every prompt token;
- each decode forward feeds one sampled token per row and gives that token's routes.

Both forwards go through one decoder interface (`moe_gspo.rollout.hf_decoders.HFDecoder`: `prefill` and
`step`, each giving float32 logits and the fed tokens' routes), so `_generate` is one sampling loop over
either implementation: `moe_gspo.rollout.compact_decode.CompactDecoder` when it supports the model (the
same numbers as the model's own forward, in about a third of the tensor calls; the routes come from it
directly), else `TransformersDecoder`, the model's forward with `HFRouterRecorder` hooks
(`compact_decode=False`). Tensors derived from the weights (fp32 copies, concatenations) are kept in one
`moe_gspo.tensor_cache.TensorCache` per engine, rebuilt when a weight sync changes a weight.

Position ids come from the attention mask (`cumsum - 1`), so left padding does not shift positions
and a padded row computes what it would compute alone. The last sampled token of a row is never fed
back, hence `routes_TLK` has `T = P + R - 1` rows (see `moe_gspo.rollout.base`). Rows that sampled
EOS keep being fed padding until every row is done; their extra outputs are dropped.

Sampling (`moe_gspo.rollout.token_sampler`) draws from `softmax(logits / temperature)`, restricted under
top-k / top-p to the support of `moe_gspo.algos.support.truncated_support`, with one `torch.Generator`
seeded from `SamplingParams.seed` for the whole batch (same seed, weights, prompts and batch give the
same samples); `temperature == 0` means greedy decoding. `response_logprobs` are the log-softmax of the
raw float32 logits (temperature 1) at the sampled tokens, over each token's support when sampling
truncates (the samples then record the supports: same-support log-probs).
"""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path
from typing import Iterable

import numpy as np
import torch
from torch import nn

from moe_gspo.algos.support import DEFAULT_SUPPORT_CAP, support_top_k
from moe_gspo.rollout.base import RolloutEngine, RolloutSample, SamplingParams
from moe_gspo.rollout.compact_decode import CompactDecoder, unsupported_reason
from moe_gspo.rollout.cpu_gemm import fp32_gemms_in, needs_fp32_gemm
from moe_gspo.rollout.fp8 import QUANTIZATIONS, Fp8ActivationQuantizer, Fp8WeightQuantizer
from moe_gspo.rollout.hf_decoders import HFDecoder, TransformersDecoder
from moe_gspo.rollout.hf_router_hooks import HFRouterRecorder, find_routers
from moe_gspo.rollout.router_dtype import parse_router_dtype, use_router_dtype_
from moe_gspo.rollout.routing_dial import RoutingDial
from moe_gspo.rollout.token_sampler import TokenSampler, draw_tokens
from moe_gspo.rollout.weights_sync import load_named_tensors_
from moe_gspo.routing.dial import check_dial, dial_is_on
from moe_gspo.routing.trace import ids_dtype
from moe_gspo.tensor_cache import TensorCache

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32,
           "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16}


def _parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ValueError(f"dtype={dtype} must be a floating-point dtype")
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; use 'bfloat16', 'float32' or 'float16'")
    return _DTYPES[dtype]


def _strip_router_hooks(model: nn.Module) -> None:
    """Drop `HFRouterRecorder` hooks that `copy.deepcopy` carried over from the source model."""
    for module in model.modules():
        for key, hook in list(module._forward_hooks.items()):
            if getattr(hook, "_moe_gspo_router_hook", False):
                del module._forward_hooks[key]


def _load_model(model_or_dir, dtype: torch.dtype, device: torch.device) -> nn.Module:
    from transformers import Qwen3MoeForCausalLM

    if isinstance(model_or_dir, nn.Module):
        if not isinstance(model_or_dir, Qwen3MoeForCausalLM):
            raise ValueError(f"model_or_dir is a {type(model_or_dir).__name__}; HFEngine needs a "
                             "Qwen3MoeForCausalLM instance or a checkpoint directory")
        model = copy.deepcopy(model_or_dir)
        _strip_router_hooks(model)
        model.to(device)
        for param in model.parameters():  # parameters only: rotary buffers keep their float32
            param.grad = None
            param.data = param.data.to(dtype)
        model.config.dtype = dtype  # the config is the copy's own
        rotary = model.model.rotary_emb
        if rotary.inv_freq.dtype != torch.float32:  # source was cast with .to(dtype): rebuild exactly
            model.model.rotary_emb = type(rotary)(config=model.config).to(device)
    else:
        from transformers import AutoConfig, AutoModelForCausalLM

        path = Path(model_or_dir)
        if not (path / "config.json").is_file():
            raise ValueError(f"model_or_dir={str(path)!r} is not a checkpoint directory (no "
                             "config.json); pass a local Hugging Face Qwen3-MoE checkpoint dir")
        model_type = getattr(AutoConfig.from_pretrained(str(path)), "model_type", None)
        if model_type != "qwen3_moe":
            raise ValueError(f"checkpoint {str(path)!r} has model_type={model_type!r}; HFEngine "
                             "supports 'qwen3_moe' only")
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device)
    model.requires_grad_(False)
    return model.eval()


def sample_next_tokens(logits_BV: torch.Tensor, *, temperature: float, top_p: float,
                       generator: torch.Generator | None, top_k: int = 0,
                       support_cap: int = DEFAULT_SUPPORT_CAP) -> torch.Tensor:
    """Sample one token per row from float32 logits: temperature, top-k (or `support_cap` with top-p
    alone), then the top-p nucleus of the renormalised probabilities (`moe_gspo.algos.support`).

    `temperature == 0` returns the argmax. The nucleus keeps the smallest set of most likely tokens
    whose mass reaches `top_p` (always at least one token).
    """
    k = support_top_k(temperature=temperature, top_p=top_p, top_k=top_k, cap=support_cap)
    return draw_tokens(logits_BV, temperature=temperature, top_p=top_p, k=k, generator=generator)[0]


def _check_sampling(sampling: SamplingParams) -> None:
    if sampling.n < 1:
        raise ValueError(f"sampling.n={sampling.n} must be >= 1")
    if sampling.max_new_tokens < 1:
        raise ValueError(f"sampling.max_new_tokens={sampling.max_new_tokens} must be >= 1")
    if sampling.temperature < 0:
        raise ValueError(f"sampling.temperature={sampling.temperature} must be >= 0 (0 = greedy)")
    if not 0.0 < sampling.top_p <= 1.0:
        raise ValueError(f"sampling.top_p={sampling.top_p} must be in (0, 1]")
    if not 0 <= sampling.top_k <= sampling.support_cap:
        raise ValueError(f"sampling.top_k={sampling.top_k} must be in [0, sampling.support_cap="
                         f"{sampling.support_cap}] (0 = off)")


class HFEngine(RolloutEngine):
    """Rollout engine on a transformers `Qwen3MoeForCausalLM`, with router capture by hooks.

    Args:
        model_or_dir: a `Qwen3MoeForCausalLM` (deep-copied: the engine never shares weights with
            the caller) or a local checkpoint directory.
        dtype: inference dtype ("bfloat16" by default, as inference engines run, or "float32").
        device: "cpu", "cuda", or None for cuda when available.
        record_routes / record_probs: fill `routes_TLK` / `router_probs_TLK` of every sample; with
            record_probs also `router_margin_TL` and `router_entropy_TL` (per token and MoE layer, computed
            on the fly from the router logits, `moe_gspo.routing.router_stats`).
        pad_token_id / eos_token_id: default to the model config (eos may be a list of ids).
        fp32_gemm: compute bf16 GEMMs as fp32 GEMMs of the bf16 values rounded back to bf16, and
            attention in fp32 from the bf16 inputs (`moe_gspo.rollout.cpu_gemm`: the same rounding
            points, faster on CPUs without bf16 kernels; the fp32 copies of the weights are kept
            between generations); None = when that applies (bf16 on such a CPU). Config: rollout.fp32_gemm.
        compact_decode: prefill and decode steps by `moe_gspo.rollout.compact_decode.CompactDecoder`
            (the same numbers as transformers' forward in a fraction of the calls); None = when the
            model is supported, True = required (ValueError if not), False = transformers' forward
            (`hf_decoders.TransformersDecoder`). Config: rollout.compact_decode.
        quantization: None, or "fp8": the engine's linear weights (attention, dense MLP, experts; not
            the router or lm_head) are kept on the float8 e4m3 grid, quantized at start and again after
            every `update_weights` (`moe_gspo.rollout.fp8`: what it emulates of vLLM's FP8 and what not).
        fp8_scale: "channel" (one scale per output channel) or "tensor" (per matrix) for `quantization="fp8"`.
        fp8_router: with `quantization="fp8"`, quantize the MoE routers' gates too (vLLM's online FP8 does).
        fp8_activations: with `quantization="fp8"`, W8A8: also quantize the input of every quantized layer
            with a dynamic per-token e4m3 scale, as vLLM's FP8 kernels on Hopper do (`fp8.Fp8ActivationQuantizer`;
            both decoders apply it). Config: rollout.fp8_activations.
        router_dtype: "fp32" / "fp64" (model.router_dtype): keep the MoE gates' weights in that dtype and route
            in it (`moe_gspo.rollout.router_dtype`; both decoders); None = transformers' router.
        router_noise_std / router_flip_prob: the routing-drift dial (`moe_gspo.routing.dial`; both decoders, bit
            for bit): the routers select their experts from logits with Gaussian noise of this many logit standard
            deviations, and/or swap the k-th chosen expert for the (k+1)-th with this probability per token and
            MoE layer; the gate weights stay the clean ones. Each sample's `extra["dial_changed"]` counts its
            routes the dial changed, `extra["dial_rows"]` the (token, MoE layer) routes counted (the rows of
            positions P-1 ... P+R-2, those `routing/layer_disagree` compares). Config: rollout.router_noise_std,
            rollout.router_flip_prob.
    """

    def __init__(self, model_or_dir, *, dtype: str | torch.dtype = "bfloat16",
                 device: str | torch.device | None = None, record_routes: bool = True,
                 record_probs: bool = True, pad_token_id: int | None = None,
                 eos_token_id: int | list[int] | None = None, fp32_gemm: bool | None = None,
                 compact_decode: bool | None = None, quantization: str | None = None,
                 fp8_scale: str = "channel", fp8_router: bool = True, fp8_activations: bool = False,
                 router_dtype: str | torch.dtype | None = None, router_noise_std: float = 0.0,
                 router_flip_prob: float = 0.0):
        self.dtype = _parse_dtype(dtype)
        if quantization is not None and quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization={quantization!r} is not supported; use None or one of {QUANTIZATIONS}")
        self.quantization = quantization
        self.device = torch.device(device if device is not None
                                   else ("cuda" if torch.cuda.is_available() else "cpu"))
        if fp32_gemm and not (self.device.type == "cpu" and self.dtype == torch.bfloat16):
            raise ValueError(f"fp32_gemm=True (rollout.fp32_gemm=true) computes bf16 CPU GEMMs as fp32 GEMMs; this "
                             f"engine runs {self.dtype} on {self.device.type}: pass fp32_gemm=None (or False)")
        self.fp32_gemm = needs_fp32_gemm(self.device, self.dtype) if fp32_gemm is None else bool(fp32_gemm)
        self._cache = TensorCache()  # tensors derived from the weights, rebuilt as update_weights changes them
        self._model = _load_model(model_or_dir, self.dtype, self.device)
        self.router_dtype = parse_router_dtype(router_dtype)
        if self.router_dtype is not None:  # model.router_dtype: gates kept and routed in it (rollout/router_dtype.py)
            if quantization == "fp8" and fp8_router:
                raise ValueError(f"router_dtype={router_dtype} keeps the gate weights in {self.router_dtype}, but "
                                 "quantization='fp8' with fp8_router=True quantizes them; pass fp8_router=False")
            use_router_dtype_(self._model, self.router_dtype)
        self._fp8: Fp8WeightQuantizer | None = None
        if quantization == "fp8":
            self._fp8 = Fp8WeightQuantizer(self._model, granularity=fp8_scale, router=fp8_router)
            self._fp8.quantize_changed_()
        if fp8_activations and quantization != "fp8":
            raise ValueError(f"fp8_activations=True (rollout.fp8_activations) quantizes the activations of an FP8 "
                             f"rollout; quantization={quantization!r}: pass quantization='fp8'")
        self.fp8_activations = bool(fp8_activations)
        self._fp8_act = Fp8ActivationQuantizer(self._model, router=fp8_router) if fp8_activations else None
        config = self._model.config
        self.vocab_size: int = config.vocab_size
        eos = eos_token_id if eos_token_id is not None else config.eos_token_id
        if eos is None:
            raise ValueError("eos_token_id is not set in the model config; pass eos_token_id=")
        self.eos_token_ids: list[int] = [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
        pad = pad_token_id if pad_token_id is not None else config.pad_token_id
        self.pad_token_id: int = int(pad if pad is not None else self.eos_token_ids[0])
        for name, tok in [("pad_token_id", self.pad_token_id)] + [("eos_token_id", e) for e in self.eos_token_ids]:
            if not 0 <= tok < self.vocab_size:
                raise ValueError(f"{name}={tok} is outside the vocabulary [0, {self.vocab_size})")
        routers = find_routers(self._model)
        if not routers:
            raise ValueError("the model has no MoE layer (every layer is in mlp_only_layers?)")
        self._moe_layer_ids = [layer for layer, _ in routers]
        self._top_k = routers[0][1].top_k
        self._num_experts = routers[0][1].num_experts
        self.record_probs = bool(record_routes and record_probs)
        self.recorder: HFRouterRecorder | None = (
            HFRouterRecorder(self._model, record_probs=self.record_probs, record_stats=self.record_probs)
            if record_routes else None)
        check_dial(router_noise_std, router_flip_prob, top_k=self._top_k, num_experts=self._num_experts)
        self._dial = (RoutingDial(noise_std=router_noise_std, flip_prob=router_flip_prob, device=self.device)
                      if dial_is_on(router_noise_std, router_flip_prob) else None)
        if compact_decode is None:
            compact_decode = unsupported_reason(self._model) is None
        self._decoder: HFDecoder = (
            CompactDecoder(self._model, fp32_gemm=self.fp32_gemm, record_probs=self.record_probs, cache=self._cache,
                           record_stats=self.record_probs, record_routes=record_routes,
                           fp8_activations=self.fp8_activations, fp8_router=fp8_router)
            if compact_decode else
            TransformersDecoder(self._model, self.recorder, num_moe_layers=self.num_moe_layers, top_k=self._top_k))
        if self._dial is not None:  # both decoders route through it (rollout/routing_dial.py)
            if isinstance(self._decoder, CompactDecoder):
                self._decoder.dial = self._dial
            else:
                self._dial.attach(self._model)

    # ----------------------------------------------------------------------------- properties
    @property
    def model(self) -> nn.Module:
        """The engine's own model (do not train it; use `update_weights`)."""
        return self._model

    @property
    def compact_decode(self) -> bool:
        """True when the prefill and decode steps run `CompactDecoder` instead of transformers' forward."""
        return isinstance(self._decoder, CompactDecoder)

    @property
    def routing_dial(self) -> RoutingDial | None:
        """The routing-drift dial, or None when it is off (`router_noise_std` = `router_flip_prob` = 0)."""
        return self._dial

    @property
    def records_routes(self) -> bool:
        return self.recorder is not None

    @property
    def num_moe_layers(self) -> int:
        return len(self._moe_layer_ids)

    @property
    def moe_layer_ids(self) -> list[int]:
        return list(self._moe_layer_ids)

    @property
    def top_k(self) -> int:
        return self._top_k

    @property
    def num_experts(self) -> int:
        return self._num_experts

    @property
    def route_dtype(self) -> np.dtype:
        """uint8 when num_experts <= 256, else uint16."""
        return ids_dtype(self._num_experts)

    # ----------------------------------------------------------------------------- weights
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy learner weights in (any dtype/device; cast to the engine's dtype).

        Accepts the in-memory fused names and the on-disk per-expert names (see `weights_sync`).
        Unknown names or shape mismatches raise `ValueError` and leave the weights unchanged; a stream
        with `specs` (`Learner.hf_weight_stream()`) is checked from its specs, then copied tensor by tensor.
        With `quantization="fp8"` the weights written are quantized again (the others keep their grid values).
        """
        try:
            load_named_tensors_(self._model, named_tensors)
        finally:  # a stream that failed midway has written its earlier tensors
            if self._fp8 is not None:
                self._fp8.quantize_changed_()

    # ----------------------------------------------------------------------------- generation
    def _check_prompts(self, prompts: list[list[int]]) -> None:
        if len(prompts) == 0:
            raise ValueError("prompts is empty; pass at least one prompt (a list of token ids)")
        for i, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"prompts[{i}] is empty; every prompt needs at least one token")
            bad = [t for t in prompt if not 0 <= int(t) < self.vocab_size]
            if bad:
                raise ValueError(f"prompts[{i}] has token ids {bad[:5]} outside [0, {self.vocab_size})")

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[RolloutSample]:
        """Sample `sampling.n` responses per prompt, all prompts in one batch; groups contiguous."""
        _check_sampling(sampling)
        sampler = TokenSampler(sampling, pad_token_id=self.pad_token_id, device=self.device)
        scope = fp32_gemms_in(self._model, self._cache) if self.fp32_gemm else contextlib.nullcontext()
        with torch.inference_mode(), scope:
            try:
                samples = self._generate(prompts, sampling, sampler)
            finally:
                self._decoder.end()
        sampler.attach_supports(samples)  # same-support log-probs: each token's support (top-p / top-k)
        return samples

    def _generate(self, prompts: list[list[int]], sampling: SamplingParams, sampler: TokenSampler
                  ) -> list[RolloutSample]:
        """One loop over the decoder: the prefill, then sample a token per row and feed it back."""
        self._check_prompts(prompts)
        n, device, decoder = sampling.n, self.device, self._decoder
        num_prompts = len(prompts)
        batch = num_prompts * n
        max_len = max(len(p) for p in prompts)
        input_ids = torch.full((num_prompts, max_len), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((num_prompts, max_len), dtype=torch.long)
        for i, prompt in enumerate(prompts):
            input_ids[i, max_len - len(prompt):] = torch.as_tensor(prompt, dtype=torch.long)
            mask[i, max_len - len(prompt):] = 1
        input_ids, mask = input_ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)

        eos_ids = torch.tensor(self.eos_token_ids, device=device)
        if self.recorder is not None:
            self.recorder.clear()
        dial = self._dial
        if dial is not None:
            dial.begin(sampling.seed)
        # each distinct prompt once; the decoder repeats its state for the n samples
        out = decoder.prefill(input_ids, mask, positions, n, sampling.max_new_tokens)
        dialled_B = None  # per row: the dial's changed routes on the rows routing/layer_disagree compares
        if dial is not None:  # the prompt's last token (position P-1), shared by its n samples
            changed = dial.pop_changed().view(num_prompts, max_len, -1)[:, -1]
            dialled_B = changed.sum(-1).repeat_interleave(n, dim=0)
        prefill_routes = (out.ids_NTLK, out.probs_NTLK, out.stats_NTL2) if out.ids_NTLK is not None else None
        next_pos_B = positions[:, -1].repeat_interleave(n, dim=0) + 1
        tokens, logprobs, decode_ids, decode_probs, decode_stats = [], [], [], [], []
        finished_B = torch.zeros(batch, dtype=torch.bool, device=device)
        for step in range(sampling.max_new_tokens):
            tok_B, logp_B = sampler.step(out.logits_BV, finished_B)
            tokens.append(tok_B)
            logprobs.append(logp_B)
            finished_B = finished_B | torch.isin(tok_B, eos_ids)
            if step == sampling.max_new_tokens - 1 or bool(finished_B.all()):
                break
            out = decoder.step(tok_B, next_pos_B)
            next_pos_B = next_pos_B + 1
            if dial is not None:  # the fed tokens that stay in their samples: those of unfinished rows
                dialled_B += (dial.pop_changed() & ~finished_B[:, None]).sum(-1)
            if out.ids_NTLK is not None:
                decode_ids.append(out.ids_NTLK[:, 0])
                decode_probs.append(out.probs_NTLK[:, 0] if out.probs_NTLK is not None else None)
                decode_stats.append(out.stats_NTL2[:, 0] if out.stats_NTL2 is not None else None)

        samples = self._collect(prompts, n, max_len, torch.stack(tokens, 1), torch.stack(logprobs, 1),
                                eos_ids, prefill_routes, decode_ids, decode_probs, decode_stats)
        if dialled_B is not None:
            for s, changed in zip(samples, dialled_B.tolist()):
                s.extra["dial_changed"] = int(changed)
                s.extra["dial_rows"] = len(s.response_ids) * self.num_moe_layers
        return samples

    def _collect(self, prompts, n, max_len, tokens_BS, logprobs_BS, eos_ids, prefill_routes,
                 decode_ids, decode_probs, decode_stats) -> list[RolloutSample]:
        """Unpad and split the batch into `RolloutSample`s (one device->host transfer per field)."""
        is_eos_BS = torch.isin(tokens_BS, eos_ids)
        has_eos_B = is_eos_BS.any(dim=1)
        first_eos_B = is_eos_BS.int().argmax(dim=1)
        resp_len_B = torch.where(has_eos_B, first_eos_B + 1, tokens_BS.shape[1]).cpu().numpy()
        has_eos_B = has_eos_B.cpu().numpy()
        tokens_np = tokens_BS.cpu().numpy().astype(np.int64)
        logprobs_np = logprobs_BS.float().cpu().numpy().astype(np.float32)

        routes = probs = stats = None
        if prefill_routes is not None:
            pre_ids, pre_probs, pre_stats = prefill_routes
            routes = (pre_ids.cpu().numpy().astype(self.route_dtype),
                      torch.stack(decode_ids, 1).cpu().numpy().astype(self.route_dtype)
                      if decode_ids else None)
            if pre_probs is not None:
                probs = (pre_probs.cpu().numpy().astype(np.float16),
                         torch.stack(decode_probs, 1).cpu().numpy().astype(np.float16)
                         if decode_probs else None)
            if pre_stats is not None:
                stats = (pre_stats.cpu().numpy().astype(np.float16),
                         torch.stack(decode_stats, 1).cpu().numpy().astype(np.float16) if decode_stats else None)

        def rows(parts, prompt_i, b, num_prompt, resp_len):
            prefill, decode = parts
            pieces = [prefill[prompt_i, max_len - num_prompt:]]
            if resp_len > 1:
                pieces.append(decode[b, :resp_len - 1])
            return np.concatenate(pieces, axis=0)

        samples = []
        for b in range(len(prompts) * n):
            i = b // n
            resp_len = int(resp_len_B[b])
            sample = RolloutSample(
                prompt_index=i,
                prompt_ids=np.asarray(prompts[i], dtype=np.int64),
                response_ids=tokens_np[b, :resp_len].copy(),
                response_logprobs=logprobs_np[b, :resp_len].copy(),
                finish_reason="stop" if has_eos_B[b] else "length",
            )
            if routes is not None:
                sample.routes_TLK = rows(routes, i, b, len(prompts[i]), resp_len)
            if probs is not None:
                sample.router_probs_TLK = rows(probs, i, b, len(prompts[i]), resp_len)
            if stats is not None:
                stats_TL2 = rows(stats, i, b, len(prompts[i]), resp_len)
                sample.router_margin_TL = np.ascontiguousarray(stats_TL2[..., 0])
                sample.router_entropy_TL = np.ascontiguousarray(stats_TL2[..., 1])
            samples.append(sample)
        return samples

    def close(self) -> None:
        """Remove the router hooks (the engine keeps working, without routes)."""
        if self.recorder is not None:
            self.recorder.remove()
            self.recorder = None
        self._decoder.record_routes = False
