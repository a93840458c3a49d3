"""`moe_gspo.tensor_cache.TensorCache`: a derived value is reused while its sources are unchanged, rebuilt after
an in-place write (version counter), a storage move or a new source object, and built outside inference mode."""

from __future__ import annotations

import torch

from moe_gspo.tensor_cache import TensorCache


class _Counting:
    def __init__(self):
        self.calls = 0

    def __call__(self, *ts):
        self.calls += 1
        return torch.cat([t.float() for t in ts])


def test_reused_until_a_source_changes_in_place():
    a, b = torch.arange(4.0).bfloat16(), torch.ones(2).bfloat16()
    cache, build = TensorCache(), _Counting()
    first = cache("k", [a, b], build)
    assert cache("k", [a, b], build) is first and build.calls == 1  # nothing changed: no rebuild
    a.view(2, 2)[1].add_(10)  # in place through a view: a's version counter moves
    second = cache("k", [a, b], build)
    assert build.calls == 2 and second is not first and float(second[2]) == 12.0
    assert cache("k", [a, b], build) is second and build.calls == 2


def test_rebuilt_for_another_tensor_a_moved_storage_or_another_extra():
    a = torch.nn.Parameter(torch.ones(3), requires_grad=False)
    cache, build = TensorCache(), _Counting()
    cache("k", [a], build)
    cache("k", [torch.ones(3)], build)  # equal values, another tensor object
    assert build.calls == 2
    cache("k", [a], build)
    a.data = torch.full((3,), 2.0)  # new storage (the version counter alone would not say so)
    assert float(cache("k", [a], build)[0]) == 2.0 and build.calls == 4
    cache("k", [a], build, extra=(torch.float16,))
    assert build.calls == 5 and len(cache) == 1  # one entry per key, replaced


def test_keys_are_independent_and_sources_are_held():
    cache = TensorCache()
    x = torch.ones(2)
    held = cache("x", [x], lambda t: t * 2)
    assert cache("y", [x], lambda t: t * 3) is not held and len(cache) == 2
    ref = id(x)
    del x  # the entry holds it: its id cannot be taken by a new tensor while cached
    assert any(id(t) == ref for t in cache._entries["x"][0])
    cache.clear()
    assert len(cache) == 0


def test_values_first_built_in_inference_mode_serve_autograd_later():
    w = torch.randn(3, 3)
    leave, stay = TensorCache(), TensorCache(leave_inference_mode=False)
    with torch.inference_mode():
        out = leave("w", [w], lambda t: t.float() * 1)
        inf = stay("w", [w], lambda t: t.float() * 1)
    assert not out.is_inference() and inf.is_inference()
    x = torch.randn(3, requires_grad=True)
    (out @ x).sum().backward()  # an ordinary tensor: usable in a graph
    assert x.grad is not None and not out.requires_grad
