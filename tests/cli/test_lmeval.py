"""`lmeval` (feedback/cli/lmeval.py): the baseline and a strategy paired on lm-eval tasks of the
tests' own, and refused inputs."""

from __future__ import annotations

import json

import pytest

from feedback.cli import common
from tests.cli.helpers import in_process, refused


def test_lmeval_pairs_the_baseline_and_a_strategy_on_lm_eval_tasks(tmp_path, monkeypatch, tiny_lm, capsys):
    """`lmeval` on lm-eval tasks of the tests' own (tests/data/lmeval), the wiring on the tiny model;
    what it computes is tested in tests/eval/test_lmeval.py."""
    pytest.importorskip("lm_eval")
    monkeypatch.setattr(common, "load", lambda args, **kwargs: tiny_lm)
    out = in_process(
        "lmeval",
        "--tasks",
        "fl_mc_tiny,fl_ppl_tiny",
        "--include-path",
        "tests/data/lmeval",
        "--strategy",
        "residual",
        "--param",
        "alpha=0.2",
        "--passes",
        "2",
        "--limit",
        "3",
        "--bootstrap",
        "100",
        "--out",
        str(tmp_path / "pair.json"),
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "baseline vs residual (alpha=0.2" in lines[0] and "mode jacobi (2 passes)" in lines[0]
    assert lines[1].split()[:3] == ["task", "metric", "n"] and len(lines) == 2 + 5
    saved = json.loads((tmp_path / "pair.json").read_text())
    assert saved["limit"] == 3 and {r["n"] for r in saved["comparison"]} == {3}
    assert saved["feedback_side"]["passes"] == 2 and saved["baseline_side"]["strategy"] is None
    for args, message in (
        (["--strategy", "nope"], "unknown strategy"),
        (["--strategy", "deep_cache", "--param", "lam=2"], "out of range"),
        (["--strategy", "residual", "--mode", "parallel"], "recurrent"),
        (["--strategy", "deep_cache", "--limit", "0"], "--limit must be positive"),
        (["--strategy", "deep_cache", "--include-path", "no/such"], "no such folder"),
    ):
        err = refused(capsys, "lmeval", "--tasks", "fl_mc_tiny", *args)
        assert message in err and len(err.strip().splitlines()) == 1, err
