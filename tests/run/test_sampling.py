"""One step's batch (`moe_gspo.run.sampling`): a single round, DAPO dynamic sampling (groups kept, surplus
dropped, fillers when the round bound is hit, metrics, seeds), and a resumed run with dynamic sampling
drawing exactly what the uninterrupted run drew."""

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from moe_gspo import train
from moe_gspo.algos import group_advantages
from moe_gspo.config_load import load_config
from moe_gspo.mcore.parallel import ParallelInfo
from moe_gspo.rollout.base import RolloutSample
from moe_gspo.run.sampling import collect_batch
from moe_gspo.run.setup import derive_seed
from moe_gspo.run.timing import PhaseTimer
from moe_gspo.tasks import Prompt

ROOT = Path(__file__).resolve().parents[2]
INFO = ParallelInfo(rank=0, world_size=1, local_rank=0, ep_size=1, ep_rank=0, dp_size=1, dp_rank=0,
                    device=torch.device("cpu"), backend="gloo")
G = 4


class _Tokenizer:
    """Prompt text "<i>" <-> token id i; a response [i, j] decodes to "<i>:<j>"."""

    eos_token_id = -1

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [int(text)]}

    def decode(self, ids, skip_special_tokens=False):
        return ":".join(str(i) for i in ids)


class _Engine:
    """Response j of prompt i is [i, j]; records every call's prompts and seed."""

    def __init__(self):
        self.calls = []

    def generate(self, prompts, sampling):
        self.calls.append(([p[0] for p in prompts], sampling.seed))
        return [RolloutSample(prompt_index=k, prompt_ids=np.array(p), response_ids=np.array([p[0], j]),
                              response_logprobs=np.zeros(2, np.float32), finish_reason="stop")
                for k, p in enumerate(prompts) for j in range(sampling.n)]


class _Task:
    """Prompt number i of the stream; its group's rewards differ iff `signal(i)` (then j % 2), else all 0.5."""

    def __init__(self, signal):
        self.signal = signal

    def prompts(self, start, count, seed):
        return [Prompt(text=str(i), answer="") for i in range(start, start + count)]

    def reward(self, response, prompt):
        i, j = map(int, response.split(":"))
        assert str(i) == prompt.text
        return float(j % 2) if self.signal(i) else 0.5


def _collect(signal, *overrides, consumed=100, step=3):
    cfg = load_config(None, ["rollout.prompts_per_step=4", f"rollout.samples_per_prompt={G}", *overrides])
    engine = _Engine()
    policy = SimpleNamespace(tokenizer=_Tokenizer(), engine=engine)
    timer = PhaseTimer()
    out = collect_batch(policy, _Task(signal), cfg, INFO, step, consumed, timer)
    assert {"perf/rollout_s", "perf/score_s"} <= set(timer.take())
    return out, engine.calls, cfg


def _batch_prompts(out):
    assert [s.prompt_index for s in out.samples] == [k for k in range(len(out.prompts)) for _ in range(G)]
    assert [int(s.prompt_ids[0]) for s in out.samples] == [int(p.text) for p in out.prompts for _ in range(G)]
    return [int(p.text) for p in out.prompts]


def test_without_dynamic_sampling_one_round_takes_every_group():
    out, calls, cfg = _collect(lambda i: i % 2 == 0)
    assert _batch_prompts(out) == [100, 101, 102, 103]
    assert calls == [([100, 101, 102, 103], derive_seed(cfg.train.seed, 3, 0))]  # the seed runs always used
    assert out.num_prompts_drawn == 4
    assert out.metrics == {"sampling/num_gen_batches": 1.0, "sampling/num_prompts_drawn": 4.0,
                           "sampling/first_prompt_index": 100.0, "sampling/num_groups_with_signal": 2.0,
                           "sampling/num_filler_groups": 0.0, "sampling/reward_mean_drawn": pytest.approx(0.5)}
    assert out.rewards.tolist() == [0, 1, 0, 1, 0.5, 0.5, 0.5, 0.5] * 2


def test_dynamic_sampling_draws_rounds_until_enough_groups_differ():
    # prompts 100.. with signal where i % 3 == 0: rounds [100-103] -> 102, [104-107] -> 105, [108-111] -> 108, 111
    out, calls, cfg = _collect(lambda i: i % 3 == 0, "algo.dynamic_sampling=true")
    assert _batch_prompts(out) == [102, 105, 108, 111]
    assert [c[0] for c in calls] == [[100, 101, 102, 103], [104, 105, 106, 107], [108, 109, 110, 111]]
    seeds = [c[1] for c in calls]
    assert seeds[0] == derive_seed(cfg.train.seed, 3, 0) and len(set(seeds)) == 3
    assert out.num_prompts_drawn == 12
    m = out.metrics
    assert (m["sampling/num_gen_batches"], m["sampling/num_prompts_drawn"], m["sampling/num_groups_with_signal"],
            m["sampling/num_filler_groups"]) == (3.0, 12.0, 4.0, 0.0)
    # every group of the batch carries signal: no advantage is 0 group-wide
    adv = group_advantages(out.rewards, G).reshape(4, G)
    assert (adv.abs().sum(-1) > 0).all()
    # reward_mean_drawn is over all 48 drawn samples: 4 groups of mean 0.5, 8 of 0.5
    assert m["sampling/reward_mean_drawn"] == pytest.approx(0.5)


def test_dynamic_sampling_drops_the_surplus_of_the_last_round():
    # signal where i % 3 != 0: [100-103] -> 100, 101, 103; [104-107] -> 104, 106, 107: the first four are kept
    out, calls, _ = _collect(lambda i: i % 3 != 0, "algo.dynamic_sampling=true")
    assert _batch_prompts(out) == [100, 101, 103, 104]
    assert out.num_prompts_drawn == 8 and out.metrics["sampling/num_groups_with_signal"] == 6.0


def test_dynamic_sampling_fills_up_with_all_equal_groups_at_the_bound():
    # bound 2 rounds: groups with signal 102, 105; fillers: the earliest all-equal groups, 100 and 101
    out, calls, _ = _collect(lambda i: i % 3 == 0, "algo.dynamic_sampling=true", "algo.max_num_gen_batches=2")
    assert len(calls) == 2
    assert _batch_prompts(out) == [100, 101, 102, 105]
    assert out.metrics["sampling/num_filler_groups"] == 2.0 and out.num_prompts_drawn == 8
    adv = group_advantages(out.rewards, G).reshape(4, G)
    assert torch.equal(adv[:2], torch.zeros(2, G)) and (adv[2:].abs().sum(-1) > 0).all()
    # nothing with signal at all: the batch is the first round's groups, as without dynamic sampling
    out, calls, _ = _collect(lambda i: False, "algo.dynamic_sampling=true", "algo.max_num_gen_batches=3")
    assert len(calls) == 3 and _batch_prompts(out) == [100, 101, 102, 103]
    assert out.metrics["sampling/num_filler_groups"] == 4.0 and out.num_prompts_drawn == 12


def test_the_draw_is_a_pure_function_of_step_and_stream_position():
    a, calls_a, _ = _collect(lambda i: i % 3 == 0, "algo.dynamic_sampling=true", consumed=37, step=5)
    b, calls_b, _ = _collect(lambda i: i % 3 == 0, "algo.dynamic_sampling=true", consumed=37, step=5)
    assert calls_a == calls_b and _batch_prompts(a) == _batch_prompts(b) and torch.equal(a.rewards, b.rewards)


SMALL = ["parallel.expert_parallel_size=1", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=2",
         "rollout.max_new_tokens=3", "logging.wandb_mode=disabled", "logging.progress=false", "train.export_hf=false",
         "logging.trace_every=0", "logging.update_drift_every=0", "train.num_minibatches=2",
         "algo.dynamic_sampling=true", "algo.max_num_gen_batches=3", "train.checkpoint_every=1"]


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_resumed_run_with_dynamic_sampling_draws_what_the_uninterrupted_run_drew(tmp_path):
    base = ["--config", str(ROOT / "configs/tiny_cpu_copy_first.yaml"), "--algo", "grpo", *SMALL]
    assert train.main([*base, "--run-dir", str(tmp_path / "ref"), "train.steps=4"]) == 0
    assert train.main([*base, "--run-dir", str(tmp_path / "cut"), "train.steps=2"]) == 0
    assert train.main([*base, "--run-dir", str(tmp_path / "cut"), "train.steps=4", "--resume"]) == 0
    ref, cut = _rows(tmp_path / "ref"), _rows(tmp_path / "cut")
    assert [r["step"] for r in cut] == [0, 1, 2, 3]
    # the test means something only if some step needed more than one round
    assert any(r["sampling/num_gen_batches"] > 1 for r in ref), [r["sampling/num_gen_batches"] for r in ref]
    first = [r["sampling/first_prompt_index"] for r in ref]
    assert first == [sum(r["sampling/num_prompts_drawn"] for r in ref[:k]) for k in range(4)]
    for a, b in zip(ref, cut):
        for k in a:
            if not k.startswith("perf/"):
                assert a[k] == b[k], (a["step"], k, a[k], b[k])
