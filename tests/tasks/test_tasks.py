import json

import pytest

from moe_gspo.config import TaskConfig
from moe_gspo.config_load import load_config
from moe_gspo.tasks import JsonlTask, SyntheticTask, extract_answer, make_task, math_reward
from moe_gspo.tasks.synthetic import SYNTHETIC_TASKS, positional_credit, sequence_credit


def test_synthetic_stream_is_a_pure_function_of_seed_and_index():
    t = SyntheticTask("copy_first", prompt_len=5, num_symbols=4)
    a = t.prompts(0, 6, seed=3)
    assert t.prompts(2, 4, seed=3) == a[2:]  # resume mid-stream
    assert t.prompts(0, 6, seed=4) != a
    for p in a:
        assert len(p.text) == 6 and p.text.endswith(":") and p.answer == p.text[0]
        assert set(p.text[:-1]) <= set("0123")


def test_fixed_length_streams_are_those_of_earlier_versions():
    # Pinned from the previous implementation (copy_first is the issue-14 peer-comparison work).
    assert [p.text for p in SyntheticTask("copy_first").prompts(0, 4, seed=7)] == ["3910:", "8883:", "6575:", "1618:"]
    assert [p.text for p in SyntheticTask("add").prompts(0, 4, seed=7)] == ["52+35=", "1+49=", "8+86=", "95+56="]
    assert [p.answer for p in SyntheticTask("reverse").prompts(0, 2, seed=7)] == ["7469", "4150"]


def test_padded_variable_length_streams_pinned_and_resumable():
    copy = SyntheticTask("copy", prompt_len=8, prompt_len_max=12, num_symbols=4, pad_prompts=True)
    assert [(p.text, p.answer) for p in copy.prompts(0, 3, seed=0)] == [
        ("003230003303.=", "003230003303"), ("320132300120.=", "320132300120"), ("21130122.....=", "21130122")]
    rev = SyntheticTask("reverse", prompt_len=2, prompt_len_max=4, num_symbols=3, pad_prompts=True)
    assert [(p.text, p.answer) for p in rev.prompts(0, 4, seed=1)] == [
        (".1211?", "1121"), (".2122?", "2212"), ("..112?", "211"), ("..012?", "210")]
    many = copy.prompts(0, 200, seed=5)
    assert copy.prompts(150, 50, seed=5) == many[150:]
    assert {len(p.answer) for p in many} == set(range(8, 13))  # every length of the range occurs
    assert all(len(p.text) == 14 and p.text[len(p.answer)] == "." for p in many)  # fixed width, terminated


@pytest.mark.parametrize("name,check", [
    ("reverse", lambda p: p.answer == p.text[:-1][::-1] and p.text.endswith("?")),
    ("copy", lambda p: p.answer == p.text[:-1] and p.text.endswith("=")),
    ("sort", lambda p: p.answer == "".join(sorted(p.text[:-1])) and p.text.endswith(";")),
    ("add", lambda p: int(p.answer) == sum(int(x) for x in p.text[:-1].split("+"))),
])
def test_synthetic_answers(name, check):
    for p in SyntheticTask(name, prompt_len=4).prompts(0, 20, seed=0):
        assert check(p), p


@pytest.mark.parametrize("name", [n for n in SYNTHETIC_TASKS if n not in ("copy", "reverse")])
def test_pad_prompts_only_for_copy_and_reverse(name):
    with pytest.raises(ValueError, match="pad_prompts"):
        SyntheticTask(name, prompt_len=2, prompt_len_max=4, pad_prompts=True)


@pytest.mark.parametrize("name", SYNTHETIC_TASKS)
def test_prompts_use_only_tokenizer_characters(name):
    from moe_gspo.tokenizer import load_tiny_tokenizer

    tok = load_tiny_tokenizer()
    pad = name in ("copy", "reverse")
    for p in SyntheticTask(name, prompt_len=4, prompt_len_max=6, pad_prompts=pad).prompts(0, 20, seed=0):
        ids = tok(p.text, add_special_tokens=False)["input_ids"]
        assert tok.unk_token_id not in ids and len(ids) == len(p.text), p.text


def test_positional_credit_values():
    assert positional_credit("12", "12") == 1.0
    assert positional_credit(" 12 ", "12") == 1.0
    assert positional_credit("13", "12") == pytest.approx(0.25)  # 1 of 2 positions, half credit
    assert positional_credit("1234", "12") == pytest.approx(0.5 * 2 / 4)
    assert positional_credit("", "12") == 0.0


def test_sequence_credit_values():
    assert sequence_credit("0123", "0123") == 1.0
    assert sequence_credit("0133", "0123") == pytest.approx(4 / 5)  # 3 symbols + right length, of 4 + 1
    assert sequence_credit("0133", "0123", partial=0.5) == pytest.approx(0.4)
    assert sequence_credit("012", "0123") == pytest.approx(3 / 5)  # stopped one early
    assert sequence_credit("01230", "0123") == pytest.approx(4 / 6)  # one symbol too many
    assert sequence_credit(" 0123", "0123") == 0.0  # not stripped: shifted by one, no position right
    assert sequence_credit("0123<pad>", "0123") < 1.0  # special tokens are text to the reward
    assert sequence_credit("", "0123") == 0.0
    assert sequence_credit("3210", "0123", partial=0.0) == 0.0
    # Longer than any answer of the task: it never stopped (truncated), no partial credit.
    assert sequence_credit("01230", "0123", max_len=4) == 0.0
    assert sequence_credit("01230", "0123", max_len=5) == pytest.approx(4 / 6)


def test_task_rewards_and_default_partial_credit():
    t = SyntheticTask("reverse", prompt_len=4)
    p = t.prompts(0, 1, seed=0)[0]
    assert t.reward(p.answer, p) == 1.0
    assert t.reward(p.answer[:-1], p) == pytest.approx(3 / 5)
    assert t.reward(p.answer + "0", p) == 0.0  # 5 symbols: longer than any answer of a 4-symbol task
    assert SyntheticTask("copy_first").reward("3x", SyntheticTask("copy_first").prompts(0, 1, seed=7)[0]) == 0.25
    assert SyntheticTask("copy", partial_credit=0.0).reward("x", p) == 0.0
    assert make_task(TaskConfig(name="copy")).partial_credit == 1.0
    assert make_task(TaskConfig(name="add")).partial_credit == 0.5


@pytest.mark.parametrize("overrides,msg", [
    (["task.name=copy", "task.prompt_len=8", "task.prompt_len_max=6"], "task.prompt_len_max=6 must be >= task.prompt_len=8"),
    (["task.partial_credit=1.5"], "task.partial_credit=1.5 must be in"),
    (["task.name=sort", "task.pad_prompts=true"], "task.pad_prompts=true applies to copy and reverse"),
    (["task.name=add", "task.num_symbols=12"], "task.name=add uses digits only"),
    (["task.name=copy", "task.prompt_len=8", "task.prompt_len_max=12", "rollout.max_new_tokens=10"],
     r"rollout.max_new_tokens=10 is shorter than the longest answer .* set rollout.max_new_tokens >= 13"),
])
def test_bad_task_config_names_the_field(overrides, msg):
    with pytest.raises(ValueError, match=msg):
        load_config(None, overrides)


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
