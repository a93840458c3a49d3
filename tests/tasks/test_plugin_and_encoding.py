"""task.reward plug-ins, task.chat_template encoding, the <unk> warning and the JSONL held-out split
(issue 32, deliverables 3-5)."""

from __future__ import annotations

import json
import textwrap

import pytest

from moe_gspo.config import TaskConfig
from moe_gspo.tasks import Prompt, make_task
from moe_gspo.tasks.encoding import check_chat_template, encode_prompts, unknown_token_report
from moe_gspo.tasks.jsonl import JsonlTask
from moe_gspo.tasks.plugin import PluginRewardTask, load_reward_function
from moe_gspo.tokenizer import load_tiny_tokenizer

P = Prompt(text="2+3=", answer="5", where="data.jsonl:7")


def _write(tmp_path, body: str, name: str = "my_reward.py"):
    f = tmp_path / name
    f.write_text(textwrap.dedent(body))
    return f


def test_a_reward_from_a_file_replaces_the_tasks_and_gets_prompt_response_answer(tmp_path):
    f = _write(tmp_path, """
        seen = []
        def reward(prompt, response, answer):
            seen.append((prompt, response, answer))
            return len(response) / 10 if response.strip() != answer else True
    """)
    task = make_task(TaskConfig(name="copy", reward=f"{f}:reward"))
    assert isinstance(task, PluginRewardTask)
    p = task.prompts(0, 1, seed=0)[0]
    assert p == make_task(TaskConfig(name="copy")).prompts(0, 1, seed=0)[0]  # the task's own prompts
    assert task.reward("abc", p) == pytest.approx(0.3)
    assert task.reward(p.answer, p) == 1.0  # a bool counts as a number
    assert task.task.__class__.__name__ == "SyntheticTask"
    assert task.fn.__globals__["seen"] == [(p.text, "abc", p.answer), (p.text, p.answer, p.answer)]


def test_a_reward_from_a_module(tmp_path, monkeypatch):
    _write(tmp_path, "def score(prompt, response, answer):\n    return 2.5\n", name="pkg_rewards_x.py")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_reward_function("pkg_rewards_x:score")(prompt="", response="", answer="") == 2.5


@pytest.mark.parametrize("body, spec_tail, msg", [
    ("def reward(prompt, response, answer):\n    return 1\n", ":nope", r"has no 'nope'; its functions: reward"),
    ("reward = 3\n", ":reward", r"'reward' is a int, not a function"),
    ("import not_a_module_xyz\n", ":reward", r"cannot import .*ModuleNotFoundError.*not_a_module_xyz"),
])
def test_a_reward_that_cannot_be_loaded_is_one_error_naming_the_field(tmp_path, body, spec_tail, msg):
    f = _write(tmp_path, body)
    with pytest.raises(ValueError, match=r"task.reward='.*my_reward.py" + spec_tail + "'" + r".*" + msg):
        load_reward_function(f"{f}{spec_tail}")
    with pytest.raises(ValueError, match=r"task.reward='missing.py:f': file 'missing.py' does not exist"):
        load_reward_function("missing.py:f")


@pytest.mark.parametrize("ret, msg", [("'0.5'", r"returned '0.5' \(str\)"), ("None", r"returned None \(NoneType\)"),
                                      ("float('nan')", r"returned nan \(float\)"), ("[1]", r"returned \[1\] \(list\)")])
def test_a_reward_that_returns_a_non_number_names_the_prompt(tmp_path, ret, msg):
    f = _write(tmp_path, f"def reward(prompt, response, answer):\n    return {ret}\n")
    task = PluginRewardTask(make_task(TaskConfig(name="copy")), f"{f}:reward")
    with pytest.raises(ValueError, match=msg + r" for the prompt data.jsonl:7; it must return a finite number"):
        task.reward("x", P)


def test_a_reward_that_raises_names_the_exception_and_the_users_line(tmp_path):
    f = _write(tmp_path, "def reward(prompt, response, answer):\n    x = 1\n    return 1 / 0\n")
    task = PluginRewardTask(make_task(TaskConfig(name="copy")), f"{f}:reward")
    with pytest.raises(ValueError, match=r"raised ZeroDivisionError: division by zero \(at .*my_reward.py:3\) on the "
                                         r"prompt data.jsonl:7"):
        task.reward("x", P)


CHAT = ("{% for m in messages %}{{ '<bos>' + m['role'][0] + ':' + m['content'] + '<eos>' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'a:' }}{% endif %}")


def test_chat_template_encoding_matches_the_template_text():
    tok = load_tiny_tokenizer()
    raw = encode_prompts(tok, ["12=", "3="])
    assert raw == [tok("12=", add_special_tokens=False)["input_ids"], tok("3=", add_special_tokens=False)["input_ids"]]
    with pytest.raises(ValueError, match="task.chat_template=tokenizer, but the tokenizer 'x' has no chat template"):
        check_chat_template(tok, "tokenizer", tokenizer_name="'x'")
    tok.chat_template = CHAT
    ids = encode_prompts(tok, ["12="], chat_template="tokenizer")
    expected = [tok.bos_token_id, *tok("u:12=", add_special_tokens=False)["input_ids"], tok.eos_token_id,
                *tok("a:", add_special_tokens=False)["input_ids"]]
    assert ids == [expected]
    with_system = encode_prompts(tok, ["12="], chat_template="tokenizer", system_prompt="be 1")
    assert with_system[0][:6] == [tok.bos_token_id, *tok("s:be 1", add_special_tokens=False)["input_ids"][:5]]
    assert with_system[0][-len(expected):] == expected


def test_unknown_characters_are_reported_with_file_and_line():
    tok = load_tiny_tokenizer()
    prompts = [Prompt(text="What is 2+3?", answer="5", where="q.jsonl:1"), Prompt(text="what is 2+3?", answer="5",
                                                                                   where="q.jsonl:2"),
               Prompt(text="Ünïcode", answer="5", where="q.jsonl:3")]
    report = unknown_token_report(tok, prompts, encode_prompts(tok, [p.text for p in prompts]))
    assert report.startswith("2 prompt(s) contain text the tokenizer maps to <unk>: q.jsonl:1 (characters 'W'); "
                             "q.jsonl:3 (characters 'Üï')")
    assert "q.jsonl:2" not in report
    assert unknown_token_report(tok, prompts[1:2], encode_prompts(tok, [prompts[1].text])) is None


def test_jsonl_holdout_is_disjoint_fixed_and_checked(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text("".join(json.dumps({"prompt": f"{i}+0=", "answer": str(i)}) + "\n" for i in range(20)))
    t = JsonlTask(f, holdout=5)
    held = t.eval_prompts(None)
    assert len(held) == 5 and len(t.items) == 15
    assert not {p.text for p in held} & {p.text for p in t.items}
    assert {p.text for p in t.prompts(0, 60, seed=3)} == {p.text for p in t.items}  # training never sees them
    assert [p.text for p in JsonlTask(f, holdout=5).eval_prompts(2)] == [p.text for p in held[:2]]
    assert len(JsonlTask(f).items) == 20
    with pytest.raises(ValueError, match="eval.holdout=20 leaves no training prompts"):
        JsonlTask(f, holdout=20)
    with pytest.raises(ValueError, match="set eval.holdout=N or eval.path"):
        JsonlTask(f).eval_prompts(None)
