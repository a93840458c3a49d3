"""benchmarks.bitwise_moe_order (issue 41): Megatron's MoE order in the transformers model makes the fp32
forwards bit-identical on the tiny checkpoint; as shipped they first differ at the first MoE block's output."""

from benchmarks.bitwise_moe_order import compare
from moe_gspo.tiny import make_tiny_checkpoint


def test_megatron_order_moe_makes_fp32_forwards_bit_identical(tmp_path):
    res = compare(make_tiny_checkpoint(tmp_path / "model", seed=1), seq_lens=(9, 17))
    shipped, aligned = res["shipped"], res["megatron_order"]
    assert shipped["first_difference"]["tensor"] == "mlp_out" and shipped["first_difference"]["layer"] == 1
    assert shipped["logits_max_abs"] > 0
    # bitwise is the property under test: with the MoE order aligned both models run the same kernels on the same
    # shapes (checked on AMX, AVX-512 and AVX2-only CPUs and under oneDNN's SSE4.1 kernels)
    assert aligned == {"first_difference": None, "logits_max_abs": 0.0, "logp_max_abs": 0.0}
