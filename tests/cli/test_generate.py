"""`generate` (feedback/cli/generate.py): rows side by side, prompt variants, a saved run's next turn
and branch, and every refused input in one line."""

from __future__ import annotations

import json

import pytest

from feedback.cli import main
from tests.cli.helpers import in_process, refused


def test_generate_json_prints_one_run_result():
    out = in_process(
        "generate",
        "--prompt",
        "What is 2+2?",
        "--max-new-tokens",
        "12",
        "--param",
        "alpha=0.1",
        "--window",
        "4",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["config"]["model"] == "embedded" and data["config"]["dtype"] in ("float32", "bfloat16")
    assert [r["name"] for r in data["rows"]] == ["baseline", "feedback"]
    fb = data["rows"][1]
    assert fb["strategy"] == "residual" and fb["params"]["alpha"] == 0.1
    assert 1 <= len(fb["token_ids"]) <= 12 and fb["stop_reason"] in ("eos", "max_tokens")
    step = fb["steps"][0]
    assert {"token_id", "text", "logprob", "confidence", "entropy", "group_confidence", "top"} <= set(step)
    assert len(step["top"]) == 5 and {"token_id", "text", "prob"} == set(step["top"][0])
    assert {"mean", "tail", "bottom10_group", "lowest_group"} <= set(fb["metrics"]) and "tokens_per_s" in fb


def test_a_stack_is_one_strategy_name_with_its_members_parameters(capsys):
    out = in_process(
        "generate",
        "--prompt",
        "Name a river.",
        "--max-new-tokens",
        "6",
        "--strategy",
        "inner_loop+deep_cache",
        "--param",
        "deep_cache.lam=0.1",
        "--param",
        "inner_loop.mode=euler",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    fb = json.loads(out.stdout)["rows"][1]
    assert fb["strategy"] == "inner_loop+deep_cache" and fb["params"]["deep_cache.lam"] == 0.1
    assert fb["params"]["inner_loop.mode"] == "euler" and fb["metrics"]["extra_layer_passes"] == 22
    err = refused(
        capsys,
        "tune",
        "--strategy",
        "inner_loop+deep_cache",
        "--trials",
        "2",
        "--param",
        "inner_loop.beta=0",
        "--param",
        "deep_cache.lam=0",
    )
    assert "inner_loop.beta=0 and deep_cache.lam=0 switches inner_loop+deep_cache off" in err
    assert "cannot be stacked" in refused(capsys, "ppl", "--strategy", "restate+residual")


def test_generate_text_output_labels_both_rows():
    out = in_process(
        "generate",
        "--prompt",
        "Name a colour.",
        "--max-new-tokens",
        "8",
        "--no-chat-template",
        "--temperature",
        "0.8",
        "--top-p",
        "0.9",
        "--top-k",
        "40",
        "--seed",
        "3",
    )
    assert out.returncode == 0, out.stderr
    assert "=== baseline ===" in out.stdout and "=== feedback [residual alpha=0.05" in out.stdout
    assert "tok/s" in out.stdout and "stop:" in out.stdout


def test_prompt_variants_a_next_turn_and_a_branch(tmp_path, capsys):
    """Three rows with their own prompts and quality metrics, then the saved run's next turn and a
    branch from an alternative token (in-process: the real-process path is tested on its own)."""
    first = tmp_path / "run1.json"
    out = in_process(
        "generate",
        "--row",
        "plain",
        "--row",
        "strong:residual,alpha=0.2",
        "--row",
        "restate:anchor,alpha=0.2",
        "--row-prompt",
        "plain=What is the capital of France?",
        "--row-prompt",
        "strong=What is the capital of France? Answer precisely, in one sentence.",
        "--row-prompt",
        "restate=Question: what is the capital of France? Restate it, then answer.",
        "--reference",
        "The capital of France is Paris.",
        "--key-fact",
        "Paris",
        "--quality",
        "--max-new-tokens",
        "10",
        "--out",
        str(first),
    )
    assert out.returncode == 0, out.stderr
    assert "=== restate [anchor alpha=0.2" in out.stdout and "self PPL" in out.stdout
    assert "reference PPL" in out.stdout and "key-fact recall" in out.stdout
    run1 = json.loads(first.read_text())
    assert [r["name"] for r in run1["rows"]] == ["plain", "strong", "restate"]
    assert run1["config"]["rows"][2]["prompt"].startswith("Question:")
    assert {"self_ppl", "prompt_ppl", "reference_ppl", "distinct_2", "key_fact_recall"} <= set(
        run1["rows"][0]["metrics"]
    )

    assert main(["generate", "--continue", str(first), "--say", "And of Italy?", "--json"]) == 0
    run2 = json.loads(capsys.readouterr().out)
    for row, answer in zip(run2["config"]["rows"], run1["rows"]):
        assert row["messages"][-1] == {"role": "assistant", "content": answer["text"]}
    assert run2["config"]["prompt"] == "And of Italy?" and run2["config"]["quality"] is True

    step = 2
    assert (
        main(
            [
                "generate",
                "--branch",
                str(first),
                "--row",
                "strong",
                "--step",
                str(step),
                "--token",
                " Italy",
                "--max-new-tokens",
                "5",
                "--json",
            ]
        )
        == 0
    )
    run3 = json.loads(capsys.readouterr().out)
    italy = run3["rows"][1]["token_ids"][step]
    for old, new in zip(run1["rows"], run3["rows"]):
        assert new["token_ids"][: step + 1] == old["token_ids"][:step] + [italy]
        assert [s["forced"] for s in new["steps"][: step + 2]] == [True] * (step + 1) + [False]
    assert run3["config"]["max_new_tokens"] == 10  # the saved run's settings carry over


def test_bad_follow_ups_of_a_saved_run(tmp_path, capsys):
    saved = tmp_path / "run.json"
    saved.write_text(
        json.dumps(
            {
                "config": {
                    "prompt": "hi",
                    "max_new_tokens": 4,
                    "chat_template": False,
                    "rows": [{"name": "b"}],
                },
                "rows": [
                    {
                        "name": "b",
                        "strategy": None,
                        "params": {},
                        "token_ids": [1, 2, 3],
                        "text": "abc",
                        "steps": [],
                    }
                ],
            }
        )
    )
    assert "needs the chat template" in refused(capsys, "generate", "--continue", str(saved), "--say", "more")
    assert "--continue takes --say" in refused(capsys, "generate", "--continue", str(saved))
    assert "--branch needs --row NAME" in refused(capsys, "generate", "--branch", str(saved), "--step", "1")
    assert "step 3 is outside row b's answer (steps 0 to 2)" in refused(
        capsys, "generate", "--branch", str(saved), "--row", "b", "--step", "3", "--token", "5"
    )
    assert "outside the vocabulary" in refused(
        capsys, "generate", "--branch", str(saved), "--row", "b", "--step", "1", "--token", "99999999"
    )
    (tmp_path / "bad.json").write_text('{"config": {}}')
    assert "is not a saved run" in refused(
        capsys, "generate", "--continue", str(tmp_path / "bad.json"), "--say", "x"
    )


def test_a_saved_run_whose_answer_the_model_could_not_have_given_is_refused_naming_the_field(
    tmp_path, capsys
):
    """The check every door makes of a saved run: here its answers against the loaded model's
    vocabulary, before anything is decoded."""
    saved = tmp_path / "run.json"
    saved.write_text(
        json.dumps(
            {
                "config": {"prompt": "hi", "max_new_tokens": 4, "rows": [{"name": "b"}]},
                "rows": [
                    {
                        "name": "b",
                        "strategy": None,
                        "params": {},
                        "token_ids": [1, 2**40],
                        "text": "abc",
                        "steps": [],
                    }
                ],
            }
        )
    )
    field = f"{saved}: row 'b': token_ids[1] = 1099511627776 is outside the vocabulary (0–49151)"
    for follow_up in (
        ["--continue", str(saved), "--say", "more"],
        ["--branch", str(saved), "--row", "b", "--step", "0", "--token", "5"],
    ):
        lines = [
            line
            for line in refused(capsys, "generate", *follow_up).splitlines()
            if line.strip() and "Warning" not in line
        ]
        assert len(lines) == 1 and lines[0].endswith(field), lines


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompt", "  "], "prompt is empty"),
        (["--prompt", "hi", "--strategy", "nope"], "unknown strategy 'nope'"),
        (["--prompt", "hi", "--param", "alpha=abc"], "alpha must be float"),
        (["--prompt", "hi", "--param", "alpha=7"], "alpha=7.0 is out of range"),
        (["--prompt", "hi", "--param", "zeta=1"], "unknown parameter(s) zeta"),
        (["--prompt", "hi", "--param", "alpha"], "--param expects KEY=VALUE"),
        (["--prompt", "hi", "--max-new-tokens", "0"], "max_new_tokens must be an integer"),
        (["--prompt", "hi", "--temperature", "nan"], "temperature must be a finite number"),
        (["--prompt", "hi", "--model", "./no/such/folder"], "model path not usable"),
        (["--prompt", "hi", "--model", "missing.gguf"], "GGUF file not found"),
        (["--prompt", "word " * 9000], "exceeds the model context"),
        (
            ["--prompt", "hi", "--load-in-4bit", "--dtype", "bfloat16"],
            "4-bit weights on CPU compute in float32",
        ),
        (["--prompt", "hi", "--load-in-4bit", "--load-in-8bit"], "not allowed with argument"),
        (["--prompt", "hi", "--max-memory", "0=10GiB"], "--max-memory needs --device-map"),
        (
            ["--prompt", "hi", "--device-map", "auto", "--max-memory", "gpu0:10"],
            "--max-memory expects DEVICE=AMOUNT",
        ),
        (["--row", "a", "--row-prompt", "b=hi", "--prompt", "x"], "--row-prompt b: no such row (rows: a)"),
        (["--row", "a:nope"], "unknown strategy 'nope'"),
        (["--row", "a", "--row", "b", "--row-prompt", "a=hi"], "prompt is empty"),
        (["--row", "a", "--row-prompt", "a=  "], "row a: prompt is empty"),
        (
            ["--prompt", "hi", "--row", "a", "--param", "alpha=1"],
            "with --row give parameters as NAME:STRATEGY,K=V",
        ),
        (["--prompt", "hi", "--say", "more"], "--say goes with --continue"),
        (["--prompt", "hi", "--key-fact", " "], "key_facts must be a list"),
        (["--continue", "missing.json", "--say", "x"], "no such file: missing.json"),
        (["--continue", "README.md", "--say", "x"], "README.md is not JSON"),
        (["--continue", "requirements.txt", "--say", "x"], "not JSON"),
        (["--branch", "x.json", "--step", "1"], "no such file"),
    ],
)
def test_bad_input_exits_nonzero_with_one_line(args, message, capsys):
    err = refused(capsys, "generate", *args)
    lines = [line for line in err.splitlines() if line.strip() and "Warning" not in line]
    assert len(lines) == 1 and message in lines[0], err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--param", "alpha=7"], "row feedback: parameter alpha=7.0 is out of range"),
        (["--row", "b", "--row", "f:residual,alpha=x"], "row f: parameter alpha must be float"),
    ],
)
def test_a_bad_strategy_value_is_refused_before_the_model_loads(args, message, capsys, monkeypatch):
    """Checked as a model of any depth would take it (a layer index waits for the model): a refusal
    in a second, not after the load."""
    from feedback.cli import common

    monkeypatch.setattr(common, "load", lambda *a, **k: pytest.fail("the model loaded first"))
    assert message in refused(capsys, "generate", "--prompt", "hi", *args)
