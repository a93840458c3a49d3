"""Issue 59 item 7: a malformed saved-metrics file (`--save-metrics`' `.jsonl.gz`) given to `analysis.phase`,
`analysis.staleness`, `analysis.claims` or `python -m moe_gspo.probe --phase` is one `error:` line naming the file
(and the line where it applies) and exit 2, not a traceback: cut short, not gzip, bad JSON, the wrong shape, the
wrong types, a run twice. A gzip bomb stops at `analysis.matrix_runs.MAX_SAVED_BYTES` of decompressed data (and
`MAX_SAVED_LINE_BYTES` a line; both made small here)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from analysis import matrix_runs
from analysis.claims import main as claims_main
from analysis.load import ReportInputError
from analysis.matrix_runs import load_saved_records
from analysis.phase import main as phase_main
from analysis.staleness import main as staleness_main

ROWS = [{"step": t, "reward/mean": 0.5, "routing/layer_disagree": [0.1, 0.2]} for t in range(3)]


def _line(run="grpo-none-p0-s1", records=ROWS) -> str:
    return json.dumps({"run": run, "records": records}) + "\n"


def _probe_main(argv):
    from moe_gspo import probe

    return probe.main(["--model", "/nonexistent/model", "--prompts", "/nonexistent/prompts.txt", "--out",
                       str(Path(argv[1]).parent / "drift.json"), "--phase", argv[0]])


TOOLS = {"claims": lambda f: claims_main([f, "--bootstrap-reps", "100"]),
         "phase": lambda f: phase_main([f, "--bootstrap-reps", "100"]),
         "staleness": lambda f: staleness_main([f, "--bootstrap-reps", "100"]),
         "probe": lambda f: _probe_main([f, f])}

GOOD = _line() + _line("grpo-none-p20-s1")
# name -> (file bytes, what the one line must say besides the file's name)
BAD = {
    "truncated": (gzip.compress("".join(_line(f"grpo-none-p{i}-s1") for i in range(40)).encode())[:-30],
                  "is not a complete gzip file"),
    "not_gzip": (GOOD.encode(), "is not a complete gzip file"),
    "bad_json": (gzip.compress((GOOD + '{"run": "x", "records": [\n').encode()), "line 3: not valid JSON"),
    "list_not_object": (gzip.compress((GOOD + "[1, 2]\n").encode()), 'line 3: expected {"run"'),
    "records_a_string": (gzip.compress(json.dumps({"run": "a-s1", "records": "abc"}).encode()), "line 1: expected"),
    "run_a_number": (gzip.compress(json.dumps({"run": 5, "records": []}).encode()), "line 1: expected"),
    "run_a_path": (gzip.compress(_line("../../etc").encode()), "line 1: 'run' must be a run directory's name"),
    "record_a_list": (gzip.compress(_line(records=[[1, 2]]).encode()), "record 0 is a list, expected a JSON object"),
    "step_a_string": (gzip.compress(_line(records=[{"step": "3"}]).encode()), "'step' is a string"),
    "step_too_big": (gzip.compress(_line(records=[{"step": 10**30}]).encode()), "'step' is a number"),
    "value_a_string": (gzip.compress(_line(records=[{"step": 0, "reward/mean": "high"}]).encode()),
                       "step 0: 'reward/mean' is a string"),
    "value_an_object": (gzip.compress(_line(records=[{"step": 0, "routing/layer_disagree": {"a": 1}}]).encode()),
                        "'routing/layer_disagree' is an object"),
    "not_utf8": (gzip.compress(b"\xff\xfe\x00garbage\n"), "line 1: not UTF-8 text"),
    "run_twice": (gzip.compress((GOOD + _line()).encode()), "line 3: run 'grpo-none-p0-s1' is also on line 1"),
}


@pytest.mark.parametrize("tool", sorted(TOOLS))
@pytest.mark.parametrize("case", sorted(BAD))
def test_a_malformed_saved_metrics_file_is_one_line(tool, case, tmp_path, capsys):
    data, says = BAD[case]
    f = tmp_path / "metrics.jsonl.gz"
    f.write_bytes(data)
    assert TOOLS[tool](str(f)) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert str(f) in err[0] and says in err[0], err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl.gz"]  # nothing written


def test_a_cut_file_names_the_last_whole_line(tmp_path):
    f = tmp_path / "m.jsonl.gz"
    whole = gzip.compress("".join(_line(f"grpo-none-p{i}-s1") for i in range(2000)).encode(), compresslevel=0)
    f.write_bytes(whole[: len(whole) // 2])  # stored blocks: the first half of the lines decompress
    with pytest.raises(ReportInputError, match=r"is not a complete gzip file after line \d+ \(EOFError"):
        load_saved_records(f)


def test_a_good_file_still_loads(tmp_path):
    f = tmp_path / "m.jsonl.gz"
    f.write_bytes(gzip.compress((GOOD + "\n").encode()))  # a blank line is no run
    runs = load_saved_records(f)
    assert [r.source.name for r in runs] == ["grpo-none-p0-s1", "grpo-none-p20-s1"] and runs[0].records == ROWS


@pytest.mark.parametrize("content", [b"\0" * (8 << 20), b"\n" * (8 << 20), b"\n \n" * (3 << 20)],
                         ids=["one_line", "blank_lines", "blank_lines_with_spaces"])
def test_a_gzip_bomb_stops_at_the_bound(content, tmp_path, monkeypatch):
    """8-9 MiB of decompressed data (a few KiB on disk) against a 1 MiB bound (and a 2 MiB bound on one line):
    refused after decompressing at most the bound plus one 64 KiB block, not in full."""
    f = tmp_path / "bomb.jsonl.gz"
    f.write_bytes(gzip.compress(content, compresslevel=9))
    assert f.stat().st_size < 64 << 10
    read = []
    real = gzip.GzipFile.read

    def counted(self, size=-1):
        block = real(self, size)
        read.append(len(block))
        return block

    monkeypatch.setattr(gzip.GzipFile, "read", counted)
    bound = 1 << 20
    with pytest.raises(ReportInputError, match=f"decompresses to more than {bound} bytes"):
        load_saved_records(f, max_bytes=bound, max_line_bytes=2 << 20)
    assert bound < sum(read) <= bound + (64 << 10)


def test_one_endless_line_stops_at_the_line_bound(tmp_path):
    f = tmp_path / "bomb.jsonl.gz"
    f.write_bytes(gzip.compress(b"\n\n" + b"x" * (4 << 20)))
    with pytest.raises(ReportInputError, match=r"line 3 is longer than 1000 bytes"):
        load_saved_records(f, max_line_bytes=1000)
    f.write_bytes(gzip.compress(b"\n\n" + b"x" * 2000 + b"\n"))  # a whole line inside one block, too
    with pytest.raises(ReportInputError, match=r"line 3 is longer than 1000 bytes"):
        load_saved_records(f, max_line_bytes=1000)


def test_line_numbers_count_blank_lines(tmp_path):
    f = tmp_path / "m.jsonl.gz"
    f.write_bytes(gzip.compress(("\n  \n" + _line() + "\n" + '{"run": 1}\n').encode()))
    with pytest.raises(ReportInputError, match=r"line 5: expected"):
        load_saved_records(f)


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_a_gzip_bomb_is_one_line_in_each_tool(tool, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(matrix_runs, "MAX_SAVED_BYTES", 1 << 20)  # the documented bound, made small
    f = tmp_path / "bomb.jsonl.gz"
    f.write_bytes(gzip.compress(b"\0" * (4 << 20)))
    assert TOOLS[tool](str(f)) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and f"decompresses to more than {1 << 20} bytes" in err[0], err
