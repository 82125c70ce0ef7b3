"""plot draws both throughput conventions (issue 12 item 5), from real results files."""
import pytest

from qpn.benchmarks import metrics as M
from qpn.benchmarks.results import Column, ResultsWriter

pytestmark = pytest.mark.fast
matplotlib = pytest.importorskip("matplotlib")

COLS = [Column("cell", "cell"), Column("tok_s_round", M.THROUGHPUT_ROUND_LABEL, 2),
        Column("tok_s_one_token", M.THROUGHPUT_ONE_TOKEN_LABEL, 2)]


def _cells(tmp_path, name, k, rows):
    w = ResultsWriter(str(tmp_path / name), "cells", {"K (speculation depth)": f"{k}",
                                                      "figures": "CPU figures"}, COLS)
    for r in rows:
        w.add_row(r)
    return w.csv_path


def test_cells_chart_has_both_conventions_with_the_files_figures(tmp_path):
    from qpn.benchmarks.plot import make_figure, plot

    a = _cells(tmp_path, "k3", 3, [{"cell": "json", "tok_s_round": 10.0, "tok_s_one_token": 12.5},
                                   {"cell": "prose", "tok_s_round": 20.0, "tok_s_one_token": 22.0}])
    b = _cells(tmp_path, "k0", 0, [{"cell": "json", "tok_s_round": None, "tok_s_one_token": 7.0},
                                   {"cell": "prose", "tok_s_round": None, "tok_s_one_token": 8.0}])
    fig = make_figure([a, b])
    axes = [ax for ax in fig.axes if ax.patches]
    assert len(axes) == 2
    titles = [ax.get_title() for ax in axes]
    assert M.THROUGHPUT_ROUND_LABEL in titles[0] and M.THROUGHPUT_ONE_TOKEN_LABEL in titles[1]
    heights = [sorted(round(p.get_height(), 2) for p in ax.patches) for ax in axes]
    assert heights[0] == [0.0, 0.0, 10.0, 20.0]  # K=0 has no round figure: drawn empty
    assert heights[1] == [7.0, 8.0, 12.5, 22.0]
    legend = " ".join(t.get_text() for t in axes[0].get_legend().get_texts())
    assert "2 cell(s) without a figure" in legend
    out = plot([a, b], str(tmp_path / "c.png"))
    assert open(out, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
