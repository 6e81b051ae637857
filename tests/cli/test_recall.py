"""`recall` (feedback/cli/recall.py): refused inputs, and one prompt's JSON and heatmaps."""

from __future__ import annotations

import json

import pytest

from tests.cli.helpers import in_process, refused


@pytest.mark.parametrize(
    "args, message",
    [
        (["--lengths", "256,9000"], "lengths: 9,000 tokens is beyond the model's context of 8,192 tokens"),
        (["--lengths", "8192"], "lengths: 8,192 tokens is beyond the model's context"),
        (["--lengths", "32"], "lengths must be at least 64"),
        (["--depths", "0,150"], "depths must be between 0 and 100, got 150"),
        (["--items", "0"], "items must be between 1"),
        (["--param", "lam=0.1"], "--param goes with --strategy"),
        (["--row", "a"], "--row a: give it a strategy"),
        (
            ["--strategy", "deep_cache", "--param", "lam=7"],
            "row deep_cache: parameter lam=7.0 is out of range",
        ),
    ],
)
def test_recall_refuses_bad_input_in_one_line(args, message, capsys):
    """A length beyond the model's context is refused once the model is known, before any text is
    built or run; the rest before the model loads."""
    err = refused(capsys, "recall", *args)
    assert message in err and err.count("\n") == 1, err


def test_recall_json_and_heatmaps_of_one_prompt(tmp_path):
    page = tmp_path / "recall.html"
    out = in_process(
        "recall",
        "--items",
        "1",
        "--lengths",
        "64",
        "--depths",
        "50",
        "--max-new-tokens",
        "2",
        "--html",
        str(page),
        "--json",
    )  # the baseline alone (a strategy row: tests/eval/test_recall.py)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["instances"] == 1 and list(res["rows"]) == ["baseline"] and res["lengths"] == [64]
    item = res["items"][0]
    assert item["kind"] == "number" and item["tokens"] == 64 and item["rows"]["baseline"]["gold_logprob"] < 0
    assert page.read_text().count('class="plotly-graph-div"') == 1
