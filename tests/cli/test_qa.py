"""`qa` (feedback/cli/qa.py): refused inputs, and each row scored on a question file."""

from __future__ import annotations

import json

from feedback.cli import main
from tests.cli.helpers import refused


def test_qa_refuses_bad_input_in_one_line_and_scores_each_row(tmp_path, capsys):
    for args, message in [
        (["--row", "a:nope"], "unknown strategy 'nope'"),
        (["--row", "a", "--row", "a"], "must differ"),
        (["--questions", str(tmp_path / "none.jsonl")], "no such question file"),
        (["--row", "r:restate,max_tokens=-1"], "max_tokens=-1 is out of range"),
    ]:
        err = refused(capsys, "qa", *args)
        assert message in err and err.count("\n") == 1, err
    questions = tmp_path / "q.jsonl"
    questions.write_text(
        json.dumps({"question": "What is the capital of France? One word.", "answer": "Paris"}) + "\n"
    )
    out = tmp_path / "qa.json"
    assert main(["qa", "--questions", str(questions), "--max-new-tokens", "12", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "1 questions, greedy" in printed and "baseline" in printed and "restate" in printed
    saved = json.loads(out.read_text())
    assert set(saved["rows"]) == {"baseline", "restate"} and saved["items"][0]["rows"]["restate"][
        "text"
    ].startswith("Key facts:")
