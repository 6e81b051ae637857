"""`calibrate` (feedback/cli/calibrate.py): refused inputs, the config of the flags, the table and
every trace written."""

from __future__ import annotations

import json

from feedback.cli import build_parser
from feedback.cli.calibrate import calibration_config
from tests.cli.helpers import in_process, refused


def test_calibrate_prints_its_table_writes_every_trace_and_refuses_bad_input(tmp_path, capsys):
    from feedback.eval.calibration import CalibrationConfig

    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"question": "What is 2 + 2?", "answer": 4}) + "\n")
    for args, message in [
        (["--samples", "0"], "samples per question"),
        (["--eta", "0"], "eta"),
        (["--strategy", "nope"], "unknown strategy 'nope'"),
        (["--bins", "1"], "bins"),
        (["--questions", str(tmp_path / "none.jsonl")], "no such question file"),
        (["--questions", str(one)], "at least 2 questions"),
    ]:
        err = refused(capsys, "calibrate", *args)
        assert message in err and err.count("\n") == 1, err
    assert calibration_config(build_parser().parse_args(["calibrate"])) == CalibrationConfig()
    questions = tmp_path / "q.jsonl"
    questions.write_text(one.read_text() + json.dumps({"question": "Name a colour.", "answer": "red"}) + "\n")
    out = tmp_path / "calibration.json"
    run = in_process(
        "calibrate",
        "--questions",
        str(questions),
        "--samples",
        "1",
        "--max-new-tokens",
        "2",
        "--window",
        "2",
        "--eta",
        "90",
        "--out",
        str(out),
    )
    assert run.returncode == 0, run.stderr
    assert "AUROC" in run.stdout and "lowest_group" in run.stdout and "eta 90%" in run.stdout
    # one test trace per row: no interval, and each row says why, with the count
    assert "95% CI" in run.stdout and "too few" in run.stdout
    assert "  baseline: too few traces to judge: 1 test trace (at least 10 needed)" in run.stdout
    saved = json.loads(out.read_text())
    assert len(saved["traces"]) == 4 and set(saved["sides"]) == {"baseline", "feedback"}
