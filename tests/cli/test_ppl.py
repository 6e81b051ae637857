"""`ppl` (feedback/cli/ppl.py): perplexity of a corpus file as JSON and as text, and refused inputs."""

from __future__ import annotations

import json

import pytest

from tests.cli.helpers import in_process, refused


def test_ppl_json_on_a_text_file(tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text("Rivers carry water to the sea. The sea gives it back as rain. " * 4)
    out = in_process(
        "ppl",
        "--data",
        str(doc),
        "--strategy",
        "deep_cache",
        "--param",
        "lam=0.05",
        "--json",
        "--out",
        str(tmp_path / "r.json"),
    )
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["mode"] == "parallel" and data["documents"] == 1 and data["config"]["params"]["lam"] == 0.05
    assert {"baseline_ppl", "feedback_ppl", "delta_pct", "ci95", "wall_seconds", "corpus_fingerprint"} <= set(
        data
    )
    assert json.loads((tmp_path / "r.json").read_text()) == data


def test_ppl_text_output_and_bad_jsonl_lines(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(
        '{"text": "A short line of text for the model."}\n{broken\n{"text": "Another line here."}\n'
    )
    out = in_process(
        "ppl", "--data", str(data), "--strategy", "residual", "--mode", "jacobi", "--passes", "2"
    )
    assert out.returncode == 0, out.stderr
    assert f"{data}:2: skipped, not valid JSON" in out.stderr
    assert "mode jacobi (approximate, 2 passes)" in out.stdout and "95% CI" in out.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["ppl", "--data", "missing.txt"], "no such file or folder"),
        (["ppl", "--data", "builtin:train"], "dev or test"),
        (["ppl", "--strategy", "residual", "--mode", "parallel", "--max-docs", "1"], "recurrent"),
        (["ppl", "--strategy", "anchor", "--param", "alpha=nan", "--max-docs", "1"], "alpha must be finite"),
    ],
)
def test_ppl_bad_input(args, message, capsys):
    assert message in refused(capsys, *args)
