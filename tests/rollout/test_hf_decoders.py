"""The transformers engine's decoder interface (moe_gspo/rollout/hf_decoders.py): transformers' forward and the
compact decoder, driven through `prefill` / `step` alone, give the same logits, samples and routes."""

from __future__ import annotations

import pytest
import torch

from moe_gspo.rollout.base import SamplingParams
from moe_gspo.rollout.compact_decode import CompactDecoder
from moe_gspo.rollout.hf_decoders import DecodeStep, TransformersDecoder
from moe_gspo.rollout.hf_engine import HFEngine
from moe_gspo.rollout.hf_router_hooks import HFRouterRecorder
from moe_gspo.rollout.token_sampler import TokenSampler
from moe_gspo.tiny import build_tiny_model

PAD = 0
PROMPTS = [[2, 5, 6, 7, 8, 9, 10, 11], [2, 9, 12], [2, 17, 16, 15]]  # left-padded to 8
N, STEPS = 3, 6


def _model():
    """The engine's own bf16 copy of the tiny model (rotary buffers kept in fp32, as the engine keeps them)."""
    return HFEngine(build_tiny_model(seed=1), dtype="bfloat16", device="cpu", record_routes=False).model


def _batch():
    max_len = max(len(p) for p in PROMPTS)
    ids = torch.full((len(PROMPTS), max_len), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(PROMPTS):
        ids[i, max_len - len(p):] = torch.tensor(p)
        mask[i, max_len - len(p):] = 1
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def _decoders(model, *, record_routes=True):
    recorder = HFRouterRecorder(model, record_probs=True, record_stats=True) if record_routes else None
    layers = len(recorder.layer_ids) if recorder is not None else 2
    top_k = model.config.num_experts_per_tok
    return {"transformers": TransformersDecoder(model, recorder, num_moe_layers=layers, top_k=top_k),
            "compact": CompactDecoder(model, fp32_gemm=False, record_routes=record_routes)}


def _run(decoder) -> tuple[list[DecodeStep], list[torch.Tensor], list[torch.Tensor]]:
    """The engine's loop in brief: prefill, then sample (seeded) and feed back STEPS times."""
    ids, mask, positions = _batch()
    sampler = TokenSampler(SamplingParams(n=N, max_new_tokens=STEPS, seed=3), pad_token_id=PAD, device="cpu")
    with torch.inference_mode():
        outs = [decoder.prefill(ids, mask, positions, N, STEPS)]
        next_pos = positions[:, -1].repeat_interleave(N) + 1
        finished = torch.zeros(len(PROMPTS) * N, dtype=torch.bool)
        tokens, logps = [], []
        for _ in range(STEPS - 1):
            tok, logp = sampler.step(outs[-1].logits_BV, finished)
            tokens.append(tok)
            logps.append(logp)
            outs.append(decoder.step(tok, next_pos))
            next_pos = next_pos + 1
        decoder.end()
    return outs, tokens, logps


def test_both_decoders_give_the_same_logits_samples_and_routes_through_the_interface():
    model = _model()
    runs = {name: _run(dec) for name, dec in _decoders(model).items()}
    (ref_outs, ref_tok, ref_logp), (outs, tok, logp) = runs["transformers"], runs["compact"]
    P, T = len(PROMPTS), max(len(p) for p in PROMPTS)
    B, V, K = P * N, model.config.vocab_size, model.config.num_experts_per_tok
    for a, b in zip(ref_tok + ref_logp, tok + logp):
        # tokens and log-probs, bit for bit: both decoders call the same kernels on the same operand shapes (the
        # agreed prefill and step shapes below; the compact q/k/v GEMM's output columns are the same dot products).
        # Checked on CPUs with AMX, with AVX-512 and with AVX2 only, and under oneDNN's SSE4.1 / ATen's default kernels
        assert torch.equal(a, b)
    assert len({tuple(t.tolist()) for t in tok}) > 1  # the samples vary from step to step
    for i, (a, b) in enumerate(zip(ref_outs, outs)):
        rows, tokens = (P, T) if i == 0 else (B, 1)  # the agreed shapes: prefill per prompt, a step per row
        for x in (a, b):
            assert x.logits_BV.shape == (B, V) and x.logits_BV.dtype == torch.float32
            assert x.ids_NTLK.shape == (rows, tokens, 2, K) and x.ids_NTLK.dtype == torch.int16
            assert x.probs_NTLK.shape == (rows, tokens, 2, K) and x.stats_NTL2.shape == (rows, tokens, 2, 2)
        assert torch.equal(a.logits_BV, b.logits_BV)
        assert torch.equal(a.ids_NTLK, b.ids_NTLK)
        assert torch.equal(a.probs_NTLK, b.probs_NTLK)
        assert torch.equal(a.stats_NTL2, b.stats_NTL2)
    # the prefill's logits are each prompt's, repeated for its n samples
    assert torch.equal(outs[0].logits_BV, outs[0].logits_BV[::N].repeat_interleave(N, dim=0))


def test_without_routes_both_decoders_return_logits_only_and_end_releases_the_cache():
    model = _model()
    for name, decoder in _decoders(model, record_routes=False).items():
        outs, _, _ = _run(decoder)
        assert all(o.ids_NTLK is None and o.probs_NTLK is None and o.stats_NTL2 is None for o in outs), name
        with pytest.raises(AssertionError, match="prefill"):  # end() dropped the generation's KV cache
            decoder.step(torch.zeros(len(PROMPTS) * N, dtype=torch.long), torch.zeros(len(PROMPTS) * N, dtype=torch.long))


def test_engine_picks_the_decoder_and_close_stops_the_routes():
    model = build_tiny_model(seed=1)
    sampling = SamplingParams(n=2, max_new_tokens=4, seed=0)
    for compact in (True, False):
        engine = HFEngine(model, dtype="bfloat16", device="cpu", compact_decode=compact)
        assert isinstance(engine._decoder, CompactDecoder if compact else TransformersDecoder)
        assert engine.generate(PROMPTS, sampling)[0].routes_TLK is not None
        engine.close()
        assert not engine.records_routes
        samples = engine.generate(PROMPTS, sampling)
        assert all(s.routes_TLK is None and s.router_probs_TLK is None for s in samples)
