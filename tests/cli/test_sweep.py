"""`sweep` (feedback/cli/sweep.py): the CSV and heatmap of a grid, and its best line, which names a
point only when it beats the baseline."""

from __future__ import annotations

import re

import pytest

from feedback.cli.sweep import best_line
from tests.cli.helpers import in_process, refused


def test_sweep_writes_csv_and_heatmap(tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text("def f(x): return x + 1\nprint(f(2))\n" * 6)
    out = in_process(
        "sweep",
        "--strategy",
        "deep_cache",
        "--grid",
        "lam=0,0.1",
        "--grid",
        "theta=10,40",
        "--data",
        str(doc),
        "--bootstrap",
        "100",
        "--out-dir",
        str(tmp_path / "sw"),
    )
    assert out.returncode == 0, out.stderr
    rows = (tmp_path / "sw" / "sweep.csv").read_text().splitlines()
    assert len(rows) == 5 and rows[0].startswith("lam,theta,delta_pct")
    html = (tmp_path / "sw" / "sweep.html").read_text()
    assert "heatmap" in html and "ΔPPL" in html
    # "best:" names a point only when it beats the baseline; either way the point comes with its verdict
    assert re.search(
        r"^best: (lam=|none \(no point beats the baseline\); the lowest ΔPPL: lam=).*\((CI|within|no "
        r"better|worse)",
        out.stdout,
        re.M,
    ), out.stdout


def _row(delta, lo, hi):
    return {"lam": 0.05, "gate": 0.9, "delta_pct": delta, "ci95_low": lo, "ci95_high": hi}


def test_the_sweeps_best_line_names_a_point_only_when_it_beats_the_baseline():
    names = ["lam", "gate"]
    assert best_line(_row(-0.5, -0.9, -0.1), names) == (
        "best: lam=0.05, gate=0.9 ΔPPL -0.500% [-0.900, -0.100] (CI excludes 0: a real improvement; "
        "points with strength 0 left out)"
    )
    assert "(within noise: CI spans 0;" in best_line(_row(-0.1, -0.4, 0.2), names)
    # the reported case: ΔPPL +0.214 %, its CI across 0, was printed as the best
    assert best_line(_row(0.214, -0.1, 0.5), names) == (
        "best: none (no point beats the baseline); the lowest ΔPPL: lam=0.05, gate=0.9 ΔPPL +0.214% [-0.100, "
        "+0.500] (no better than the baseline: ΔPPL ≥ 0; CI spans 0; points with strength 0 left out)"
    )
    assert best_line(None, names).startswith("best: none (every point has strength 0")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--grid", "lam", "--max-docs", "1"], "--grid expects NAME=V1"),
        (["--grid", "zeta=1", "--max-docs", "1"], "unknown parameter"),
        (
            ["--grid", "lam=0.1", "--max-tokens", "1"],
            "max tokens per document must be at least 2",
        ),  # 0 or 1 would leave nothing to score
    ],
)
def test_sweep_bad_input(args, message, capsys):
    assert message in refused(capsys, "sweep", "--strategy", "deep_cache", *args)
