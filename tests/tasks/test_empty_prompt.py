"""Issue 43.10: a whitespace-only prompt trains, but with one warning from rank 0 naming its file and line. An
empty one, which encodes to no token, is an error at start-up (issue 49; tests/faults/test_prompts.py)."""

from __future__ import annotations

import json

import pytest

from moe_gspo.config import Config
from moe_gspo.run.setup import check_prompts_fit
from moe_gspo.tasks import make_task


@pytest.mark.parametrize("rank, printed", [("0", True), ("1", False)])
def test_an_empty_prompt_is_warned_about_once_naming_file_and_line(tmp_path, capsys, monkeypatch, rank, printed):
    f = tmp_path / "data.jsonl"
    f.write_text("\n".join(json.dumps(o) for o in ({"prompt": "2+3=", "answer": "5"}, {"prompt": " ", "answer": "1"},
                                                     {"prompt": "7*6=", "answer": "42"}, {"prompt": "  ", "answer": "0"}))
                 + "\n")
    monkeypatch.setenv("RANK", rank)
    cfg = Config()
    cfg.task.name, cfg.task.path = "jsonl", str(f)
    check_prompts_fit(cfg, make_task(cfg.task))
    warnings = [l for l in capsys.readouterr().err.splitlines() if "empty" in l]
    if printed:
        assert len(warnings) == 1 and warnings[0].startswith("warning: 2 prompt(s) are empty")
        assert f"{f}:2" in warnings[0] and f"{f}:4" in warnings[0]
    else:
        assert warnings == []


def test_no_warning_without_empty_prompts(tmp_path, capsys):
    f = tmp_path / "data.jsonl"
    f.write_text(json.dumps({"prompt": "2+3=", "answer": "5"}) + "\n")
    cfg = Config()
    cfg.task.name, cfg.task.path = "jsonl", str(f)
    check_prompts_fit(cfg, make_task(cfg.task))
    assert "empty" not in capsys.readouterr().err
