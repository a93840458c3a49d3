"""The activation formula against the bytes autograd really saves in the tiny Megatron model
(fp32, local layer spec = unfused attention, EP=1), with and without full recomputation."""

from __future__ import annotations

import pytest
import torch

from moe_gspo.plan.activations import (MicroBatch, activation_estimate, attention_saved_bytes,
                                       layer_saved_bytes)
from moe_gspo.plan.params import Geometry
from moe_gspo.tiny import tiny_qwen3_moe_config


@pytest.fixture(scope="module")
def dist1():
    from moe_gspo.mcore.parallel import destroy_distributed, init_distributed

    yield init_distributed(ep_size=1, num_experts=8, seed=0)
    destroy_distributed()


def saved_bytes_by_block(model, ids_BS, *, upcast: bool = False) -> dict[str, int]:
    """Bytes of the distinct non-parameter storages autograd saves during a training forward + loss,
    keyed by decoder layer (`decoder.layers.N`) or 'other'. `upcast`: the logits go to the loss as fp32."""
    from moe_gspo.learner.logprobs import token_logprobs
    from moe_gspo.mcore.model import forward_logits

    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    stack: list[str] = []
    hooks = []
    for name, mod in model.named_modules():
        hooks.append(mod.register_forward_pre_hook(lambda m, a, n=name: stack.append(n)))
        hooks.append(mod.register_forward_hook(lambda m, a, o: (stack.pop(), None)[1]))
    seen: dict[int, tuple[int, str]] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in param_ptrs and st.data_ptr() not in seen:
            where = stack[-1] if stack else ""
            key = ".".join(where.split(".")[:3]) if where.startswith("decoder.layers.") else "other"
            seen[st.data_ptr()] = (st.nbytes(), key)
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits = forward_logits(model, ids_BS)
            logp, _ = token_logprobs(logits.float() if upcast else logits, ids_BS)
    finally:
        for h in hooks:
            h.remove()
    out: dict[str, int] = {}
    for nbytes, key in seen.values():
        out[key] = out.get(key, 0) + nbytes
    return out


@pytest.mark.parametrize("recompute", [False, True])
def test_formula_matches_saved_tensors(dist1, recompute):
    from moe_gspo.mcore.model import build_gpt_model

    hf = tiny_qwen3_moe_config()
    geom = Geometry.from_hf(hf)
    # the formula's layer spec: Megatron's local attention and unfused RoPE (its per-layer RoPE tables, `16 s d`;
    # moe_gspo.mcore.fused_rope, the default, keeps one table pair for the whole model)
    model = build_gpt_model(hf, recompute=recompute, sdpa_attention=False, fused_rope=False)
    mb = MicroBatch(num_seqs=2, seq_len=64)
    ids = torch.randint(3, hf.vocab_size, (mb.num_seqs, mb.seq_len))
    measured = saved_bytes_by_block(model, ids)
    est = activation_estimate(geom, mb, act_bytes=4, attention="unfused", recompute=recompute,
                              vocab_padded=hf.vocab_size)
    total = sum(measured.values())
    assert est.stored_bytes == pytest.approx(total, rel=0.01)
    if not recompute:
        # the SDPA attention (model.sdpa_attention, the default without TE; is_causal, no mask) saves no [s, s]
        # scores: the plan's "unfused" count stays an upper bound for it, and its "flash" count is within 1%
        # (measured: 1 KiB below it here, of 3 MiB; with an explicit mask SDPA saved 16 KiB per layer more)
        sdpa = sum(saved_bytes_by_block(build_gpt_model(hf, fused_rope=False), ids).values())
        flash = activation_estimate(geom, mb, act_bytes=4, attention="flash", recompute=False, vocab_padded=hf.vocab_size)
        assert sdpa < est.stored_bytes
        assert sdpa == pytest.approx(flash.stored_bytes, rel=0.01)
    if not recompute:
        # per layer: layer 0 is dense (mlp_only_layers), layers 1-2 MoE; exact for MoE layers at EP=1
        for i, is_moe in enumerate(geom.moe_layers):
            expect = layer_saved_bytes(geom, mb, is_moe=is_moe, act_bytes=4, attention="unfused")
            assert expect == pytest.approx(measured[f"decoder.layers.{i}"], rel=0.01), i
    else:
        assert not any(k.startswith("decoder.layers.") for k in measured)  # only the checkpointed inputs
        assert est.peak_bytes > est.stored_bytes  # the backward re-runs one layer


def test_scaling_properties():
    geom = Geometry.from_hf(tiny_qwen3_moe_config())
    short, long = MicroBatch(num_seqs=1, seq_len=512), MicroBatch(num_seqs=1, seq_len=1024)
    unfused = [attention_saved_bytes(geom, m, act_bytes=2, attention="unfused") for m in (short, long)]
    flash = [attention_saved_bytes(geom, m, act_bytes=2, attention="flash") for m in (short, long)]
    assert unfused[1] / unfused[0] > 3.5          # the s^2 softmax dominates at this width
    assert flash[1] / flash[0] == pytest.approx(2.0, rel=0.01)  # linear in s
    full = activation_estimate(geom, long, act_bytes=2, attention="flash", recompute=False, vocab_padded=64)
    ckpt = activation_estimate(geom, long, act_bytes=2, attention="flash", recompute=True, vocab_padded=64)
    assert ckpt.peak_bytes < full.peak_bytes


def test_bf16_head_keeps_the_bf16_logits_not_an_fp32_copy(dist1):
    """Issue 40: with bf16 logits the loss keeps the logits themselves and O(tokens) floats (the plan's
    `head_saved_bytes` at act_bytes=2), not a 4 N V fp32 copy; the fp32 count is unchanged."""
    from moe_gspo.mcore.model import build_gpt_model
    from moe_gspo.plan.activations import LOGPROB_CHUNK_BYTES, head_peak_bytes, head_saved_bytes

    hf = tiny_qwen3_moe_config()
    geom = Geometry.from_hf(hf)
    mb = MicroBatch(num_seqs=2, seq_len=64)
    N, V = mb.tokens, hf.vocab_size
    model = build_gpt_model(hf, params_dtype=torch.bfloat16)
    ids = torch.randint(3, V, (mb.num_seqs, mb.seq_len))
    new = saved_bytes_by_block(model, ids)["other"]
    old = saved_bytes_by_block(model, ids, upcast=True)["other"]  # the pre-issue-40 path: an fp32 copy
    head2 = head_saved_bytes(geom, mb, act_bytes=2, vocab_padded=V)
    # the head's change, measured: the fp32 copy (4 N V) out, the bf16 logits (2 N V) in (both paths keep
    # the targets and the log-sum-exps); the plan's bf16 term is 2 N V below its pre-issue-40 term, less the
    # 4 N of the entropies kept when asked for
    assert old - new == 4 * N * V - 2 * N * V
    head_old = N * (3 * geom.hidden * 2 + 4) + 4 * N * V + 20 * N
    assert head_old - head2 == 2 * N * V - 4 * N
    head4 = head_saved_bytes(geom, mb, act_bytes=4, vocab_padded=V)
    assert head4 - N * (3 * geom.hidden * 4 + 4) - 20 * N == 4 * N * V
    # Qwen3's vocabulary at 4096 tokens: the kept logits drop from 2.5 GB (fp32) to 1.24 GB (bf16)
    qwen = Geometry(**{**geom.__dict__, "vocab_size": 151936})
    big = MicroBatch(num_seqs=4, seq_len=1024)
    saved_old = big.tokens * (3 * qwen.hidden * 2 + 4) + 4 * big.tokens * 151936 + 20 * big.tokens
    saved_new = head_saved_bytes(qwen, big, act_bytes=2, vocab_padded=151936)
    assert saved_old - saved_new == pytest.approx(2 * 4096 * 151936, rel=0.001)
    peak_new = head_peak_bytes(qwen, big, act_bytes=2, vocab_padded=151936)
    assert peak_new < big.tokens * (3 * qwen.hidden * 2 + 4) + 6 * big.tokens * 151936 \
        and peak_new >= 4 * big.tokens * 151936 + 4 * LOGPROB_CHUNK_BYTES


class _LiveChunks(torch.utils._python_dispatch.TorchDispatchMode):
    """The most fp32 tensors of one chunk's shape alive at once (allocated by an op, not views), the peak
    the CUDA caching allocator would see of `ChunkedTokenLogprobs`' chunk temporaries."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.live, self.peak, self.seen = tuple(shape), 0, 0, set()

    def _gone(self, key: int):
        self.live -= 1
        self.seen.discard(key)  # ids are reused once a tensor is freed

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        import weakref

        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if (isinstance(t, torch.Tensor) and t.dtype == torch.float32 and tuple(t.shape) == self.shape
                    and t._base is None and id(t) not in self.seen):
                self.seen.add(id(t))
                self.live += 1
                self.peak = max(self.peak, self.live)
                weakref.finalize(t, self._gone, id(t))
        return out


@pytest.mark.parametrize("entropy_grad", [False, True])
@pytest.mark.parametrize("num_chunks", [1, 3])
def test_chunked_logprobs_backward_holds_the_planned_chunks(entropy_grad, num_chunks):
    """Issue 48: the plan's chunk count of the bf16 loss head's backward is what `ChunkedTokenLogprobs`'
    backward holds at once: 4 chunk-sized fp32 temporaries for one chunk, 5 when the entropy bonus has a
    gradient or there are several chunks."""
    from moe_gspo.learner.logprobs import token_logprobs
    from moe_gspo.plan.activations import logprob_backward_chunks

    B, S, V = num_chunks, 4, 50
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(B, S, V, generator=gen).to(torch.bfloat16).requires_grad_()
    ids = torch.randint(0, V, (B, S), generator=gen)
    logp, ent = token_logprobs(logits, ids, with_entropy=True, chunk_elements=S * V)  # one sequence a chunk
    loss = logp.sum() + (0.01 * ent.sum() if entropy_grad else 0.0)
    probe = _LiveChunks((S, V))
    with probe:
        loss.backward()
    assert logits.grad is not None
    assert probe.peak == logprob_backward_chunks(entropy_grad=entropy_grad, several_chunks=num_chunks > 1)


def test_the_plan_counts_the_loss_heads_backward_chunks():
    from moe_gspo.config_load import config_from_dict
    from moe_gspo.plan.activations import LOGPROB_CHUNK_BYTES, head_peak_bytes
    from moe_gspo.plan.from_config import setups

    geom = Geometry.from_hf(tiny_qwen3_moe_config(vocab_size=151936))
    mb = MicroBatch(num_seqs=4, seq_len=1024)  # 4096 x 151,936 fp32 logits: far more than one chunk
    one = MicroBatch(num_seqs=1, seq_len=32)  # 32 x 151,936 fp32 logits: within one chunk
    small = 4 * 32 * 151936
    assert head_peak_bytes(geom, one, act_bytes=2, vocab_padded=151936, entropy_grad=True) \
        - head_peak_bytes(geom, one, act_bytes=2, vocab_padded=151936) == small
    assert head_peak_bytes(geom, mb, act_bytes=2, vocab_padded=151936, entropy_grad=True) \
        == head_peak_bytes(geom, mb, act_bytes=2, vocab_padded=151936)  # 5 chunks either way
    assert head_peak_bytes(geom, mb, act_bytes=2, vocab_padded=151936) - 2 * 2 * mb.tokens * 151936 \
        - mb.tokens * (3 * geom.hidden * 2 + 4) - 24 * mb.tokens == 5 * LOGPROB_CHUNK_BYTES
    for coef, want in ((0.0, False), (0.01, True)):
        learner, _ = setups(config_from_dict({"algo": {"entropy_coef": coef}}), num_gpus=1, attention="flash")
        assert learner.entropy_grad is want
