"""`deepthink` (feedback/cli/deepthink.py): one prompt as JSON and as text, refused inputs, and the
config of the flags."""

from __future__ import annotations

import json

from feedback.cli import build_parser
from feedback.cli.deepthink import deepthink_config
from tests.cli.helpers import in_process, refused


def test_deepthink_cli_json_and_bad_input(tmp_path, capsys):
    out = in_process(
        "deepthink",
        "--prompt",
        "What is 2 + 2? Answer with a number.",
        "--traces",
        "2",
        "--warmup",
        "2",
        "--max-new-tokens",
        "16",
        "--window",
        "4",
        "--eta",
        "90",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    assert set(rep["sides"]) == {"baseline", "feedback"} and rep["config"]["traces"] == 2
    for args, message in [
        (["--prompt", "q", "--traces", "500"], "traces must be in [1, 64]"),
        (["--prompt", "q", "--eta", "0"], "eta"),
        (["--prompt", "q", "--answer-regex", "(x"], "does not compile"),
        ([], "give either --prompt TEXT or --questions FILE.jsonl"),
        (["--questions", "q.jsonl", "--expected", "4"], "--expected goes with --prompt"),
    ]:
        assert message in refused(capsys, "deepthink", *args)
    warn = in_process(
        "deepthink",
        "--prompt",
        "Say hi.",
        "--traces",
        "1",
        "--warmup",
        "1",
        "--max-new-tokens",
        "4",
        "--window",
        "8",
        "--expected",
        "hello",
    )
    assert warn.returncode == 0 and "no early stop can happen" in warn.stderr
    assert "(correct)" in warn.stdout or "(wrong)" in warn.stdout  # every answer marked against --expected


def test_flags_left_out_keep_the_defaults_declared_beside_the_config():
    from feedback.eval.deepthink import DeepThinkConfig

    parse = build_parser().parse_args
    assert deepthink_config(parse(["deepthink", "--prompt", "q"]), "q") == DeepThinkConfig("q")
    assert deepthink_config(parse(["deepthink", "--traces", "3"]), "q") == DeepThinkConfig("q", traces=3)
