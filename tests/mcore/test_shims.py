import torch

from moe_gspo.mcore import shims


def test_shims_idempotent_and_only_what_the_machine_needs():
    first = shims.apply_shims()
    assert shims.apply_shims() == first
    if not torch.cuda.is_available():
        assert {"cuda_current_device", "cpu_rng_tracker", "cuda_rng_state_io"} <= set(first)
        assert torch.cuda.current_device() == "cpu"
    if not shims.have_transformer_engine():
        from megatron.core.transformer.moe import moe_utils
        assert moe_utils.te_general_gemm is None


def test_cpu_rng_tracker_forks_reproducibly_and_restores_the_outer_state():
    if torch.cuda.is_available():
        return
    from megatron.core.tensor_parallel import random as mrandom

    shims.apply_shims()
    tracker = mrandom.get_cuda_rng_tracker()
    tracker.reset()
    tracker.add("a", 123)
    torch.manual_seed(0)
    outer_before = torch.get_rng_state()
    with tracker.fork("a"):
        x1 = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), outer_before)  # outer stream untouched
    with tracker.fork("a"):
        x2 = torch.rand(3)
    assert not torch.equal(x1, x2)  # the forked stream advanced
    tracker.reset()
    tracker.add("a", 123)
    with tracker.fork("a"):
        assert torch.equal(torch.rand(3), x1)  # same seed, same stream
    tracker.reset()
