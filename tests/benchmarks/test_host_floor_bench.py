"""benchmarks.host_floor_bench: its shapes exercise the attention term of the host-memory floor (issue 59), and a
bad shape name is one argparse line. The measurement itself (minutes of training runs) is not run here."""

from __future__ import annotations

import pytest

from benchmarks import host_floor_bench


def test_every_shape_needs_gibibytes_and_mostly_for_the_attention():
    for name, overrides in host_floor_bench.SHAPES.items():
        parts = host_floor_bench.floor_bytes(overrides)
        total = sum(parts.values())
        assert 2 * 2**30 < total < 6 * 2**30, (name, total)  # past the ~0.6 GiB the floor leaves out, and cheap
        assert parts["attention"] > 0.6 * total, (name, parts)


def test_an_unknown_shape_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        host_floor_bench.main(["--shapes", "heads1500_kv1,nope"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        f"unknown shape(s) nope; known: {', '.join(host_floor_bench.SHAPES)}")
