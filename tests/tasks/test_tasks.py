import json

import pytest

from moe_gspo.config import TaskConfig
from moe_gspo.tasks import JsonlTask, SyntheticTask, extract_answer, make_task, math_reward
from moe_gspo.tasks.synthetic import positional_credit


def test_synthetic_stream_is_a_pure_function_of_seed_and_index():
    t = SyntheticTask("copy_first", prompt_len=5, num_symbols=4)
    a = t.prompts(0, 6, seed=3)
    assert t.prompts(2, 4, seed=3) == a[2:]  # resume mid-stream
    assert t.prompts(0, 6, seed=4) != a
    for p in a:
        assert len(p.text) == 6 and p.text.endswith(":") and p.answer == p.text[0]
        assert set(p.text[:-1]) <= set("0123")


@pytest.mark.parametrize("name,check", [
    ("reverse", lambda p: p.answer == p.text[:-1][::-1]),
    ("add", lambda p: int(p.answer) == sum(int(x) for x in p.text[:-1].split("+"))),
])
def test_synthetic_answers(name, check):
    for p in SyntheticTask(name, prompt_len=4).prompts(0, 20, seed=0):
        assert check(p), p


def test_positional_credit_values():
    assert positional_credit("12", "12") == 1.0
    assert positional_credit(" 12 ", "12") == 1.0
    assert positional_credit("13", "12") == pytest.approx(0.25)  # 1 of 2 positions, half credit
    assert positional_credit("1234", "12") == pytest.approx(0.5 * 2 / 4)
    assert positional_credit("", "12") == 0.0


def test_bad_synthetic_config():
    with pytest.raises(ValueError, match="task.name"):
        SyntheticTask("bogus")
    with pytest.raises(ValueError, match="num_symbols"):
        SyntheticTask("add", num_symbols=20)


@pytest.mark.parametrize("text,expected", [
    ("so the answer is 42", "42"),
    ("work...\n#### 1,234", "1,234"),
    ("thus \\boxed{\\frac{3}{4}} done", "\\frac{3}{4}"),
    ("first 7 then 8", "8"),
    ("no numbers here", None),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize("resp,ref,r", [
    ("\\boxed{0.75}", "3/4", 1.0), ("#### 1,234", "1234", 1.0), ("answer is $5$.", "5", 1.0),
    ("\\boxed{6}", "5", 0.0), ("nothing", "5", 0.0),
])
def test_math_reward(resp, ref, r):
    assert math_reward(resp, ref) == r


def test_jsonl_task(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(json.dumps({"prompt": f"q{i}", "answer": i}) for i in range(5)) + "\n\n")
    t = make_task(TaskConfig(name="jsonl", path=str(f)))
    assert isinstance(t, JsonlTask)
    first = t.prompts(0, 5, seed=0)
    assert sorted(p.text for p in first) == [f"q{i}" for i in range(5)]  # one epoch = a permutation
    assert t.prompts(3, 4, seed=0)[:2] == first[3:5]
    assert t.reward("#### 2", first[0]) == float(first[0].answer == "2")


@pytest.mark.parametrize("line,msg", [
    ("{not json", "d.jsonl:2: not valid JSON"),
    ('{"answer": 1}', "d.jsonl:2: needs a string field 'prompt'"),
    ('{"prompt": "x"}', "d.jsonl:2: needs an 'answer'"),
])
def test_jsonl_malformed_line_names_line_number(tmp_path, line, msg):
    f = tmp_path / "d.jsonl"
    f.write_text('{"prompt": "a", "answer": "1"}\n' + line + "\n")
    with pytest.raises(ValueError, match=msg):
        JsonlTask(f)


def test_jsonl_missing_file(tmp_path):
    with pytest.raises(ValueError, match="task.path"):
        JsonlTask(tmp_path / "nope.jsonl")
