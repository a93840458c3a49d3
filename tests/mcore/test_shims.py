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


def _fake_te(root, *, pytorch_body: str):
    pkg = root / "transformer_engine"
    (pkg / "pytorch").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "pytorch" / "__init__.py").write_text(pytorch_body)


def test_transformer_engine_counts_only_when_it_imports(tmp_path, monkeypatch):
    """Issue 20, claim 10: a TE wheel built for another torch is *found* (find_spec) but does not
    import; Megatron then takes the local spec, so must we."""
    import importlib.util
    import sys

    def forget_te():
        for name in [m for m in sys.modules if m == "transformer_engine" or m.startswith("transformer_engine.")]:
            del sys.modules[name]

    saved = {m: mod for m, mod in sys.modules.items() if m.startswith("transformer_engine")}
    broken, working = tmp_path / "broken", tmp_path / "working"
    _fake_te(broken, pytorch_body="raise ImportError('transformer_engine_torch.so: undefined symbol: _ZN3c10')")
    _fake_te(working, pytorch_body="")
    try:
        forget_te()
        monkeypatch.syspath_prepend(str(broken))
        assert importlib.util.find_spec("transformer_engine") is not None  # what the old check looked at
        assert shims.have_transformer_engine() is False
        forget_te()
        monkeypatch.syspath_prepend(str(working))
        assert shims.have_transformer_engine() is True
    finally:
        forget_te()  # no fake TE left for the tests after this one
        sys.modules.update(saved)
        importlib.invalidate_caches()


def test_untie_adam_steps_gives_each_state_its_own_counter():
    from types import SimpleNamespace

    shared = torch.tensor(3.0)
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(3)]
    opt = torch.optim.Adam(params)
    for p in params:
        opt.state[p] = {"step": shared, "exp_avg": torch.zeros(2)}
    assert shims.untie_adam_steps_after_load(SimpleNamespace(optimizer=opt)) == 2
    steps = [opt.state[p]["step"] for p in params]
    assert len({id(s) for s in steps}) == 3 and all(float(s) == 3.0 for s in steps)
    steps[0] += 1  # torch's Adam increments in place: the others must not move
    assert [float(s) for s in steps] == [4.0, 3.0, 3.0]
    assert shims.untie_adam_steps_after_load(SimpleNamespace(optimizer=opt)) == 0


def _unimportable_te(root) -> str:
    """A `transformer_engine` package that is installed (found on the path) but raises ImportError."""
    pkg = root / "transformer_engine"
    pkg.mkdir()
    (pkg / "__init__.py").write_text('raise ImportError("libtransformer_engine.so: undefined symbol: _ZN3c10")\n')
    return str(root)


def test_an_unimportable_transformer_engine_counts_as_absent_before_megatron_imports(tmp_path):
    import os
    import subprocess
    import sys

    code = ("import moe_gspo.mcore\n"  # the package import runs the guard
            "import megatron.core.tensor_parallel, megatron.core.models.gpt.gpt_layer_specs\n"
            "from moe_gspo.mcore import shims\n"
            "assert not shims.have_transformer_engine()\n"
            "print(shims.transformer_engine_warning())\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([_unimportable_te(tmp_path), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Transformer Engine is installed but does not import (ImportError: libtransformer_engine.so" in out.stdout
    # without the guard, Megatron's own import of it fails (it catches ModuleNotFoundError only)
    bare = subprocess.run([sys.executable, "-c", "import megatron.core.tensor_parallel"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert bare.returncode != 0 and "libtransformer_engine.so" in bare.stderr



def test_deferred_compile_compiles_once_on_the_first_call_with_the_same_options(monkeypatch):
    calls = []

    def fake_compile(fn, **options):
        calls.append((fn.__name__, options))
        return lambda *a, **k: ("compiled", fn(*a, **k))

    monkeypatch.setattr(torch, "compile", fake_compile)
    defer = shims.DeferredCompile()

    @defer
    def plain(x):
        return x + 1

    @defer(dynamic=True)
    def with_options(x):
        return x * 2

    assert calls == [] and plain.__name__ == "plain"  # decorating compiles nothing
    assert plain(1) == ("compiled", 2) and plain(2) == ("compiled", 3)
    assert with_options(3) == ("compiled", 6)
    assert calls == [("plain", {}), ("with_options", {"dynamic": True})]  # once each, options kept


def test_expert_bias_shim_skips_the_fused_update_only_when_expert_bias_is_off():
    from megatron.core.transformer.moe.router import TopKRouter

    shims.apply_shims()

    class Off:
        enable_expert_bias = False

    class On:
        enable_expert_bias = True
        local_tokens_per_expert = torch.zeros(3)

    routing_map = torch.tensor([[True, False, True], [True, True, False]])
    assert TopKRouter._apply_expert_bias(Off(), routing_map) is None
    on = On()
    with torch.enable_grad():
        TopKRouter._apply_expert_bias(on, routing_map)  # the fused (compiled) body still runs
    assert on.local_tokens_per_expert.tolist() == [2.0, 1.0, 1.0]


def test_megatron_imports_without_the_inductor_and_torch_compile_is_restored():
    import subprocess
    import sys

    code = ("import sys, torch\n"
            "real = torch.compile\n"
            "from moe_gspo.mcore.shims import apply_shims, import_megatron_core\n"
            "import_megatron_core(); apply_shims()\n"
            "from megatron.core.jit import jit_fuser\n"
            "from megatron.core.transformer.moe.router import TopKRouter\n"
            "assert torch.compile is real and getattr(jit_fuser(lambda: 0), 'deferred_compile', False)\n"
            "print('torch._inductor.compile_fx' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"  # an eager `import megatron.core` imports it (docs/results.md)
