"""Issue 49, defects 2, 3, 4 and 9: the sizes a config asks for are checked before any worker starts, in one
line naming the field: the nested `model.tiny` mapping like every other section (known keys, types, bounds),
YAML alias expansion capped, `eval.num_prompts` bounded, the model's parameters and activations counted into
the host-memory floor. Through `moe_gspo.launch` (its check before torchrun's agent, which is replaced here:
nothing may start) and the config loader."""

from __future__ import annotations

import time

import pytest
import torch.distributed.run as torchrun

from moe_gspo import launch
from moe_gspo.config_load import load_config
from moe_gspo.config_sizes import check_tiny
from moe_gspo.plan.batch_bound import check_batch_fits_host
from moe_gspo.yaml_limits import expanded_values, load_capped


def _bomb(levels: int = 9, width: int = 9) -> str:
    """`levels` lists of `width` aliases of the list before: width**levels values in a few hundred bytes."""
    names = [f"l{i}" for i in range(levels)]
    lines = [f"{names[0]}: &{names[0]} [{', '.join(['lol'] * width)}]"]
    lines += [f"{n}: &{n} [{', '.join([f'*{p}'] * width)}]" for p, n in zip(names, names[1:])]
    return "\n".join(lines)


def _launch(monkeypatch, capsys, *train_args: str) -> tuple[int, list[str], list]:
    started = []
    monkeypatch.setattr(torchrun, "run", lambda args: started.append(args))
    t0 = time.time()
    code = launch.main(["--standalone", "--nproc-per-node", "2", "-m", "moe_gspo.train", *train_args])
    assert time.time() - t0 < 60
    return code, capsys.readouterr().err.strip().splitlines(), started


@pytest.mark.parametrize("override, msg", [
    ("model.tiny={hidden_sise: 128}", "error: unknown key model.tiny.hidden_sise: did you mean hidden_size?"),
    ("model.tiny={hidden_size:128}", "error: model.tiny has the key 'hidden_size:128': YAML needs a space after the "
                                     "colon ({hidden_size: 128})"),
    ("eval.num_prompts=1000000000", "error: eval.num_prompts=1000000000 is more than 100000"),
    ("eval.samples_per_prompt=100000", "error: eval.samples_per_prompt=100000 is more than 1024: the eval set is held "
                                       "in memory for the whole run and generated in full at every evaluation"),
    ("eval.holdout=1000000000", "error: eval.holdout=1000000000 is more than 100000"),
    ("eval.max_new_tokens=1000000000", "error: eval.max_new_tokens=1000000000 is more than 1048576: longer than any "
                                       "model's context"),
    ("model.tiny={vocab_size: 10000000000}", "error: model.tiny.vocab_size=10000000000 must be in [1, 2147483647]"),
    ("model.tiny={hidden_size: 1048576}", "error: model.tiny={'hidden_size': 1048576}: the model's weights, gradients "
                                          "and optimizer state on 2 rank(s) needs at least"),
])
def test_the_launcher_refuses_a_size_in_one_line_before_any_worker(monkeypatch, capsys, override, msg):
    code, err, started = _launch(monkeypatch, capsys, override)
    assert (code, started, len(err)) == (2, [], 1), err
    assert err[0].startswith(msg), err


def test_an_alias_bomb_inside_model_tiny_is_refused_at_once(monkeypatch, capsys, tmp_path):
    """9 levels of 9 aliases (387 million values) passed the launcher; the worker ran past 3 GB and 240 s."""
    cfg = tmp_path / "bomb.yaml"
    cfg.write_text("model:\n  tiny:\n" + "".join(f"    {l}\n" for l in _bomb().splitlines()))
    code, err, started = _launch(monkeypatch, capsys, "--config", str(cfg))
    assert (code, started, len(err)) == (2, [], 1), err
    assert err[0] == (f"error: config file {str(cfg)!r}: its YAML aliases (*name) expand to more than 100000 values "
                      "(a config holds a few hundred); write the values out, or drop the aliases")
    with pytest.raises(ValueError, match="^override 'model.tiny=.*expand to more than 100000 values"):
        load_config(None, ["model.tiny={" + ", ".join(_bomb().splitlines()) + "}"])


def test_alias_expansion_is_counted_without_building_anything():
    import yaml

    node = yaml.SafeLoader(_bomb(levels=4, width=10)).get_single_node()
    lists = [11, 111, 1111, 11111]  # level i: the list itself + 10 copies of level i-1
    assert expanded_values(node, limit=10**9) == 1 + 4 + sum(lists)  # the mapping, its 4 keys, its 4 values
    assert expanded_values(node, limit=1000) == 1001
    assert load_capped("a: &a [1, 2]\nb: *a\n", what="x") == {"a": [1, 2], "b": [1, 2]}
    with pytest.raises(ValueError, match="^x: its YAML aliases"):
        load_capped("a: &a [1, *a]\n", what="x")  # a list that contains itself


@pytest.mark.parametrize("tiny, msg", [
    ({"mlp_only_layers": [[1, 2]]}, "model.tiny.mlp_only_layers[]=[1, 2] must be an integer"),
    ({"mlp_only_layers": [3]}, "model.tiny.mlp_only_layers[]=3 must be in [0, 2]"),
    ({"num_experts_per_tok": 9}, "model.tiny.num_experts_per_tok=9 must be at most num_experts=8"),
    ({"num_key_value_heads": 3}, "model.tiny.num_attention_heads=4 must be a multiple of num_key_value_heads=3"),
    ({"head_dim": 33}, "model.tiny.head_dim=33 must be even"),
    ({"rms_norm_eps": 0}, "model.tiny.rms_norm_eps=0 must be a number > 0"),
    ({"tie_word_embeddings": "yes"}, "model.tiny.tie_word_embeddings='yes' must be true or false"),
    ({"rope_parameters": {"rope_type": "yarn"}}, "model.tiny.rope_parameters.rope_type='yarn': only default RoPE"),
    ({"vocab_size": 40, "eos_token_id": 40}, "model.tiny.eos_token_id=40 must be in [0, 39]"),
    ({1: 2}, "model.tiny has the key 1; its keys are field names"),
])
def test_the_tiny_mapping_is_checked_like_a_section(tiny, msg):
    with pytest.raises(ValueError) as e:
        check_tiny(tiny)
    assert str(e.value).startswith(msg), str(e.value)


def test_the_shipped_tiny_mappings_pass():
    for name in ("tiny_cpu", "tiny_cpu_fine", "tiny_cpu_copy_first"):
        check_tiny(load_config(name).model.tiny)
    check_tiny({"hidden_size": 48, "moe_intermediate_size": 24, "initializer_range": 0.02,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})


def test_the_memory_floor_counts_the_model_and_the_activations():
    """`vocab_size: 1e10` ended in a raw allocation traceback, `hidden_size: 1048576` in the OOM killer."""
    cfg = load_config(None, ["model.tiny={vocab_size: 200000000}"])
    with pytest.raises(ValueError, match=r"^model.tiny=\{'vocab_size': 200000000\}: the model's weights, gradients and "
                                         r"optimizer state on 1 rank\(s\) needs at least [\d.]+ GiB .* \+ [\d.]+ GiB "
                                         r"activations, 1 rank\(s\)\), and this machine has 16.0 GiB available; "
                                         r"shrink model.tiny"):
        check_batch_fits_host(cfg, world_size=1, local_ranks=1, on_cuda=False, host_bytes=16 << 30)
    cfg = load_config(None, ["rollout.prompts_per_step=64", "train.num_minibatches=1",
                             "model.tiny={vocab_size: 2000000}"])
    with pytest.raises(ValueError, match=r"^train.micro_batch_size=0: one micro-batch's activations .* set "
                                         r"train.micro_batch_size to fewer sequences"):
        check_batch_fits_host(cfg, world_size=1, local_ranks=1, on_cuda=False, host_bytes=16 << 30)


@pytest.mark.parametrize("overrides, msg", [
    (["eval.num_prompts=100000", "eval.samples_per_prompt=100000"], "eval.samples_per_prompt=100000 is more than 1024"),
    (["eval.num_prompts=100000", "eval.samples_per_prompt=11"], "eval.samples_per_prompt=11 x eval.num_prompts=100000 "
     "= 1100000 responses per evaluation is more than 1000000; lower eval.samples_per_prompt or eval.num_prompts"),
])
def test_eval_generations_are_bounded_at_config_time(overrides, msg):
    """Issue 59: `eval.num_prompts=100000 eval.samples_per_prompt=100000` was SIGKILLed after 129 s with an empty
    metrics.jsonl; every size of the eval section is bounded like eval.num_prompts."""
    with pytest.raises(ValueError) as e:
        load_config(None, [*overrides, "eval.greedy=false"])
    assert str(e.value).startswith(msg), str(e.value)
    # the bounds themselves pass: 1024 samples of a synthetic task's 64 prompts, 10 of 100,000 prompts
    load_config(None, ["eval.samples_per_prompt=1024", "eval.greedy=false", "eval.max_new_tokens=1048576"])
    load_config(None, ["eval.num_prompts=100000", "eval.samples_per_prompt=10", "eval.greedy=false"])
