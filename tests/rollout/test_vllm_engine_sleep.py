"""The vLLM engine's sleep sequencing and shutdown, against a stand-in for `vllm.LLM` (issue 20).

Sleep mode exists on CUDA only, so these check the engine's own logic with a fake LLM that records
what vLLM would be asked to do; `tests/rollout/test_vllm_gpu.py` runs the real thing on a GPU.
- claim 3: a weight sync wakes the weights only; the KV cache stays asleep until `generate`;
- claim 9: closing one of several in-process engines must not destroy vLLM's model-parallel groups
  (vLLM 0.33's `ExecutorWithExternalLauncher.shutdown()` does).
"""

from __future__ import annotations

import pytest
import torch

from moe_gspo.rollout import vllm_engine
from moe_gspo.rollout.vllm_engine import SLEEP_TAGS, VLLMEngine


class FakeLLM:
    """Records calls; tracks which memory tags are asleep as vLLM's executor does."""

    def __init__(self):
        self.calls: list = []
        self.asleep: set[str] = set()

    def sleep(self, level):
        self.calls.append(("sleep", level))
        self.asleep = set(SLEEP_TAGS)

    def wake_up(self, tags=None):
        assert tags is None or set(tags) <= self.asleep, (tags, self.asleep)  # vLLM warns and does nothing
        self.calls.append(("wake_up", None if tags is None else tuple(tags)))
        self.asleep -= self.asleep if tags is None else set(tags)

    def collective_rpc(self, method, kwargs):
        assert method == "reload_weights"
        self.calls.append(("reload_weights", frozenset(self.asleep)))
        for _ in kwargs["weights_iterator"]:
            pass

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))
        return True

    def generate(self, *args, **kwargs):
        self.calls.append(("generate", frozenset(self.asleep)))
        raise _Generated()


class _Generated(Exception):
    pass


def _engine(sleep_level: int) -> VLLMEngine:
    """A VLLMEngine as its constructor leaves it (started asleep when sleep_level > 0), on a FakeLLM."""
    e = VLLMEngine.__new__(VLLMEngine)
    e.llm, e.sleep_level, e._sleeping = FakeLLM(), sleep_level, set()
    e._expected_names = ["w.a", "w.b"]
    e.dtype, e._cpu, e.max_model_len, e.eos_token_ids = torch.float32, False, 64, [1]

    class _Vllm:
        SamplingParams = dict

    e._vllm = _Vllm
    if sleep_level:
        e._sleep(sleep_level)
    return e


def _weights():
    return [("w.a", torch.zeros(2)), ("w.b", torch.ones(3))]


def test_sync_wakes_the_weights_only_and_generate_wakes_the_kv_cache():
    from moe_gspo.rollout.base import SamplingParams

    e = _engine(sleep_level=2)
    assert e.sleeping_tags == frozenset(SLEEP_TAGS)  # started asleep: nothing next to the learner
    e.update_weights(_weights())  # the first sync
    assert e.llm.calls[1:] == [("wake_up", ("weights",)), ("reload_weights", frozenset({"kv_cache"})),
                               ("reset_prefix_cache",)]
    assert e.sleeping_tags == {"kv_cache"}
    with pytest.raises(_Generated):
        e.generate([[2, 3]], SamplingParams(n=1, max_new_tokens=2))
    assert e.llm.calls[-2:] == [("wake_up", None), ("generate", frozenset())]
    e.sleep()
    e.update_weights(_weights())  # a later sync: from fully asleep, again the weights only
    assert e.llm.calls[-4:] == [("sleep", 2), ("wake_up", ("weights",)), ("reload_weights", frozenset({"kv_cache"})),
                                ("reset_prefix_cache",)]
    e.sleep()  # from partly asleep (weights awake) back to fully asleep
    assert e.llm.calls[-1] == ("sleep", 2) and e.sleeping_tags == frozenset(SLEEP_TAGS)
    e.sleep()  # already asleep: nothing asked of vLLM
    assert e.llm.calls[-1] == ("sleep", 2) and sum(c[0] == "sleep" for c in e.llm.calls) == 3


def test_without_sleep_mode_nothing_sleeps_or_wakes():
    e = _engine(sleep_level=0)
    e.sleep()
    e.update_weights(_weights())
    assert e.llm.calls == [("reload_weights", frozenset()), ("reset_prefix_cache",)]


class _Part:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def shutdown(self):
        self.log.append(self.name)


def test_closing_one_of_two_engines_keeps_vllms_groups(monkeypatch):
    """vLLM 0.33: `ExecutorWithExternalLauncher.shutdown()` = the worker's shutdown + destroy_model_parallel()."""
    log: list[str] = []
    executor = _Part(log, "executor.shutdown (0.33: destroys the model-parallel groups)")
    executor.driver_worker = _Part(log, "worker.shutdown")

    class Core:
        model_executor, scheduler = executor, _Part(log, "scheduler.shutdown")

    class Client:
        engine_core = Core()

        def shutdown(self):
            log.append("client.shutdown")

    monkeypatch.setitem(vllm_engine._LIVE_ENGINES, "count", 2)
    vllm_engine._release(Client(), False, None)
    assert log == ["worker.shutdown", "scheduler.shutdown"] and vllm_engine._LIVE_ENGINES["count"] == 1
