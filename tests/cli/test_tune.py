"""`tune` (feedback/cli/tune.py): its summary recommends a trial only when it beats the baseline on
dev and test; refused inputs; a tiny run, resumed."""

from __future__ import annotations

import json
import re

from feedback.cli import main
from feedback.cli.tune import best_lines
from tests.cli.helpers import refused


def test_the_tunes_summary_recommends_a_trial_only_when_it_beats_the_baseline_on_dev_and_test():
    best = {"trial": 7, "params": {"lam": 0.05}, "delta_pct": -0.3, "ci95": [-0.6, -0.05]}
    test = {
        "data": "builtin:test",
        "documents": 40,
        "delta_pct": 0.491,
        "ci95": [0.1, 0.9],
        "ci_method": "documents",
    }
    line, verdict = best_lines(best, test)  # the reported case: confirmed on test with ΔPPL +0.491 %
    assert line.startswith(
        "best on dev: trial 7 (lam=0.05): dev ΔPPL -0.300 % [-0.600, -0.050] (CI excludes 0"
    )
    assert (
        "test (builtin:test, 40 documents) ΔPPL +0.491 %" in line
        and "worse than the baseline: CI above 0)" in line
    )
    assert verdict == (
        "recommendation: none (the best trial is not confirmed on the test text: there it is worse "
        "than the baseline: CI above 0)"
    )
    line, verdict = best_lines(best, test | {"delta_pct": -0.2, "ci95": [-0.5, -0.01]})
    assert verdict == "recommendation: trial 7 (lam=0.05)"
    line, verdict = best_lines(best | {"delta_pct": 0.1, "ci95": [None, None]}, None)  # no bootstrap, no test
    assert line.startswith("lowest dev ΔPPL: trial 7 (lam=0.05): dev ΔPPL +0.100 % (no CI)")
    assert line.endswith("no test evaluation (give --test DATA)")
    assert verdict == "recommendation: none (no trial beats the baseline)"


def test_tune_refuses_bad_input_in_one_line_and_resumes_a_tiny_run(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    for args, message in [
        (["--trials", "0"], "trials must be in [1, 10000]"),
        (["--timeout", "0"], "timeout must be a positive number"),
        ([], "give a budget"),
        (
            [
                "--trials",
                "2",
                "--param",
                "lam=0.1",
                "--param",
                "theta=5",
                "--param",
                "layer=1",
                "--param",
                "window=8",
                "--param",
                "gate=0",
                "--param",
                "max_p=1",
            ],
            "every tunable",
        ),
        (["--trials", "2", "--param", "zeta=1"], "unknown parameter(s) zeta"),
        (["--trials", "2", "--data", str(empty)], "holds no usable text"),
        (["--trials", "2", "--test", "builtin:dev"], "is the tuning data"),
    ]:
        err = refused(capsys, "tune", "--strategy", "deep_cache", *args)
        assert message in err and err.count("\n") == 1, err
    assert "unknown strategy 'nope'" in refused(capsys, "tune", "--strategy", "nope", "--trials", "2")
    data, test, out = tmp_path / "dev.jsonl", tmp_path / "test.txt", tmp_path / "tune"
    data.write_text(
        "".join(
            json.dumps({"text": t}) + "\n"
            for t in (
                "def f(x):\n    return x + 1\nprint(f(2))",
                "The river runs past the old mill and into the sea.",
            )
        )
    )
    test.write_text("A list holds items in order; a dict maps keys to values.")
    args = [
        "tune",
        "--strategy",
        "deep_cache",
        "--data",
        str(data),
        "--test",
        str(test),
        "--bootstrap",
        "50",
        "--max-tokens",
        "24",
        "--out-dir",
        str(out),
    ]
    assert main([*args, "--trials", "2"]) == 0
    printed = capsys.readouterr()
    assert printed.out.startswith("trial  params") and "[trial 1]" in printed.err
    assert re.search(r"^(best on dev|lowest dev ΔPPL): trial", printed.out, re.M) and "95% CI" in printed.out
    assert f"test ({test}, 1 documents)" in printed.out
    assert re.search(r"^recommendation: (trial|none)", printed.out, re.M)
    assert main([*args, "--trials", "3"]) == 0  # resumed: only the third trial runs
    printed = capsys.readouterr()
    assert "[trial 2]" in printed.err and "[trial 0]" not in printed.err
    assert len((out / "trials.jsonl").read_text().splitlines()) == 4 and (out / "tune.html").exists()
    assert json.loads((out / "best.json").read_text())["test"]["documents"] == 1
