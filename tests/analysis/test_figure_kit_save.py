"""analysis.figure_kit.save_png: the PNG lands through this process's own temp file; a failed save keeps the
previous figure and leaves no temp file."""

from __future__ import annotations

import matplotlib.image as mpimg
import pytest
from matplotlib.figure import Figure

from analysis.figure_kit import save_png


def _fig() -> Figure:
    fig = Figure(figsize=(2, 1), dpi=50)
    fig.subplots().plot([0, 1], [0, 1])
    return fig


def test_save_png_writes_the_figure_and_nothing_else(tmp_path):
    path = save_png(_fig(), tmp_path / "new", "a.png")
    assert path == tmp_path / "new" / "a.png"
    assert mpimg.imread(path).shape[:2] == (50, 100)
    assert [p.name for p in path.parent.iterdir()] == ["a.png"]


def test_a_failed_save_keeps_the_previous_figure_and_no_temp_file(tmp_path):
    before = save_png(_fig(), tmp_path, "a.png").read_bytes()
    fig = _fig()

    def half_then_fail(fname, **kw):
        with open(fname, "wb") as f:
            f.write(b"\x89PNG half")
        raise OSError("disk full")

    fig.savefig = half_then_fail
    with pytest.raises(OSError, match="disk full"):
        save_png(fig, tmp_path, "a.png")
    assert (tmp_path / "a.png").read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["a.png"]
