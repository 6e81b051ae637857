"""Batch runner: every task once in the output, even across a SIGKILL and a resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from feedback.errors import FeedbackError
from feedback.serve.batch import finished_ids, merge, part_files, read_tasks, run_batch

ROOT = Path(__file__).resolve().parents[2]


def _write_tasks(path: Path, n: int) -> None:
    lines = [
        json.dumps({"id": f"t{i}", "prompt": f"Count to {i + 2}.", "max_new_tokens": 6}) for i in range(n)
    ]
    path.write_text("\n".join(lines) + "\n")


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_bad_lines_failures_and_resume(tiny_lm, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(
        "\n".join(
            [
                json.dumps({"id": "a", "prompt": "hi", "max_new_tokens": 3}),
                "{broken",
                json.dumps({"prompt": "  "}),
                json.dumps(
                    {"id": "boom", "prompt": "hi", "max_new_tokens": 0}
                ),  # invalid config: fails every attempt
                json.dumps(
                    {
                        "id": "p",
                        "prompt": "some text to score here",
                        "mode": "ppl",
                        "strategy": "deep_cache",
                        "bootstrap": 0,
                    }
                ),
            ]
        )
        + "\n"
    )
    warnings: list[str] = []
    summary = run_batch(tiny_lm, inp, out, retries=2, warn=warnings.append)
    assert summary == summary | {"tasks": 5, "ok": 2, "error": 1, "invalid": 2, "skipped": 0}
    rows = {r["id"]: r for r in _lines(out)}
    assert rows["a"]["status"] == "ok" and rows["a"]["result"]["rows"][0]["token_ids"]
    assert rows["line2"]["status"] == "invalid" and "not valid JSON" in rows["line2"]["error"]
    assert rows["line3"]["status"] == "invalid" and "prompt" in rows["line3"]["error"]
    assert (
        rows["boom"]["status"] == "error"
        and rows["boom"]["attempts"] == 3
        and "max_new_tokens" in rows["boom"]["error"]
    )
    assert rows["p"]["result"]["mode"] == "parallel" and rows["p"]["peak_rss_mb"] > 0
    assert [w.split(":")[1] for w in warnings] == ["2", "3"]
    again = run_batch(tiny_lm, inp, out)
    assert again["skipped"] == 5 and len(_lines(out)) == 5


def test_duplicate_ids_and_unknown_fields_are_invalid_lines(tiny_lm, tmp_path, monkeypatch):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(
        "\n".join(
            [
                json.dumps({"id": "a", "prompt": "hi", "max_new_tokens": 2}),
                json.dumps({"id": "a", "prompt": "again", "max_new_tokens": 2}),
                json.dumps({"id": "b", "prompt": "hi", "max_new_tokens": 2, "temprature": 0.7}),
                json.dumps(
                    {"id": "c", "prompt": "some text to score here", "mode": "ppl", "max_new_tokens": 2}
                ),
            ]
        )
        + "\n"
    )
    summary = run_batch(tiny_lm, inp, out, warn=lambda _: None)
    assert summary == summary | {"tasks": 4, "ok": 1, "invalid": 3}
    rows = _lines(out)
    assert [r["id"] for r in rows] == ["a", "line2", "line3", "line4"] and rows[0]["status"] == "ok"
    assert "duplicate id 'a' (first on line 1)" in rows[1]["error"]
    assert "unknown field(s) temprature for mode compare" in rows[2]["error"]
    assert "unknown field(s) max_new_tokens for mode ppl" in rows[3]["error"]
    lenient = run_batch(tiny_lm, inp, tmp_path / "lenient.jsonl", lenient=True, warn=lambda _: None)
    assert lenient == lenient | {"ok": 3, "invalid": 1}  # the duplicate is still refused
    # a budget set for the batch runner turns an over-budget task into an error line, not a crash
    from feedback.core.budget import Budget

    tight = run_batch(
        tiny_lm,
        inp,
        tmp_path / "tight.jsonl",
        lenient=True,
        warn=lambda _: None,
        budget=Budget(decoded_tokens=1, scored_tokens=None, memory_mb=None),
    )
    errors = [r for r in _lines(tmp_path / "tight.jsonl") if r["status"] == "error"]
    assert tight["error"] == 2 and all("FEEDBACK_BUDGET_DECODED_TOKENS" in r["error"] for r in errors)


def test_tasks_with_rows_of_their_own_prompts_and_conversations(tiny_lm, tmp_path):
    from feedback.core.engine import run_to_end
    from feedback.core.records import RowSpec, RunConfig

    history = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]
    rows = [
        {"name": "plain", "prompt": "Name a fruit."},
        {
            "name": "strong",
            "strategy": "residual",
            "params": {"alpha": 0.3},
            "prompt": "Name one fruit. One word.",
        },
        {"name": "chat", "messages": history, "prompt": "And a fruit?"},
        {
            "name": "stacked",
            "strategy": "inner_loop+deep_cache",
            "params": {"deep_cache.lam": 0.3},
            "prompt": "Name a red fruit.",
        },
    ]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(
        "\n".join(
            [
                json.dumps(
                    {"id": "v", "rows": rows, "max_new_tokens": 4, "key_facts": ["apple"], "quality": True}
                ),
                json.dumps(
                    {
                        "id": "shared",
                        "prompt": "Say hi.",
                        "max_new_tokens": 3,
                        "rows": [{"name": "a"}, {"name": "b", "system_prompt": "Be terse."}],
                    }
                ),
                json.dumps({"id": "noprompt", "rows": [{"name": "a"}, {"name": "b", "prompt": "x"}]}),
                json.dumps({"id": "typo", "rows": [{"name": "a", "prompmt": "x"}], "prompt": "hi"}),
                json.dumps(
                    {
                        "id": "role",
                        "rows": [{"name": "a", "messages": [{"role": "robot", "content": "x"}]}],
                        "prompt": "hi",
                        "max_new_tokens": 2,
                    }
                ),
            ]
        )
        + "\n"
    )
    summary = run_batch(tiny_lm, inp, out, retries=0, warn=lambda _: None)
    assert summary == summary | {"ok": 2, "invalid": 2, "error": 1}
    got = {r["id"]: r for r in _lines(out)}
    direct = run_to_end(
        tiny_lm,
        RunConfig(
            prompt="",
            model=tiny_lm.name,
            max_new_tokens=4,
            key_facts=["apple"],
            quality=True,
            rows=[RowSpec(**r) for r in rows],
        ),
    )
    result = got["v"]["result"]
    assert [r["token_ids"] for r in result["rows"]] == [r.token_ids for r in direct.rows]
    assert result["config"]["rows"][2]["messages"] == history
    assert (
        result["rows"][3]["params"]["deep_cache.lam"] == 0.3
        and result["rows"][3]["metrics"]["extra_layer_passes"]
    )
    assert {"self_ppl", "key_fact_recall", "distinct_1"} <= set(result["rows"][0]["metrics"])
    assert got["shared"]["status"] == "ok" and got["shared"]["result"]["config"]["rows"][1]["system_prompt"]
    assert (
        "needs a non-empty string field 'prompt'" in got["line3"]["error"]
    )  # invalid lines are named by line
    assert "rows[0] has unknown field(s) prompmt" in got["line4"]["error"]
    assert "row a: messages[0].role must be one of" in got["role"]["error"]


def test_torn_last_line_is_cut_before_resuming(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "a", "status": "ok"}\n{"id": "b", "sta')
    assert finished_ids(out) == {"a"} and out.read_text() == '{"id": "a", "status": "ok"}\n'


def test_read_tasks_rejects_missing_input(tmp_path):
    with pytest.raises(Exception, match="no such input file"):
        list(read_tasks(tmp_path / "nope.jsonl"))


def test_sigkill_mid_run_then_resume_gives_one_line_per_task(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    n = 12
    _write_tasks(inp, n)
    cmd = [sys.executable, "-m", "feedback", "batch", str(inp), str(out)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 240
    while time.time() < deadline and (not out.exists() or len(out.read_text().splitlines()) < 3):
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    partial = out.read_text().splitlines()
    assert 3 <= len(partial) < n  # killed part-way, finished lines kept
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    ids = [r["id"] for r in _lines(out)]
    assert sorted(ids) == sorted(f"t{i}" for i in range(n)) and len(ids) == n
    assert "already done" in done.stdout


def test_shards_split_the_tasks_resume_across_process_counts_and_merge_in_order(tiny_lm, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_tasks(inp, 5)
    first = run_batch(tiny_lm, inp, out, shard=(0, 2))
    assert first["tasks"] == 3 and first["output"] == str(out) + ".part0" and not out.exists()
    assert [r["id"] for r in _lines(out.with_name("out.jsonl.part0"))] == ["t0", "t2", "t4"]
    # A rerun with another process count skips what any part already holds.
    rest = run_batch(tiny_lm, inp, out)
    assert rest["skipped"] == 3 and rest["ok"] == 2 and [r["id"] for r in _lines(out)] == ["t1", "t3"]
    assert merge(out) == {"records": 5, "parts": 1, "duplicates": 0, "output": str(out)}
    assert [r["id"] for r in _lines(out)] == [f"t{i}" for i in range(5)] and not part_files(out)
    assert merge(out)["parts"] == 0 and len(_lines(out)) == 5  # nothing left to merge: output untouched


def test_merge_prefers_a_success_and_drops_torn_lines(tmp_path):
    out = tmp_path / "o.jsonl"
    out.with_name("o.jsonl.part0").write_text(
        '{"id": "b", "line": 2, "status": "error"}\n{"id": "a", "line": 1, "status": "ok"}\n'
    )
    out.with_name("o.jsonl.part1").write_text('{"id": "b", "line": 2, "status": "ok"}\n{"id": "c", "li')
    out.with_name("o.jsonl.partial").write_text("not a part file")
    assert merge(out)["duplicates"] == 1
    assert [(r["id"], r["status"]) for r in _lines(out)] == [("a", "ok"), ("b", "ok")]
    assert out.with_name("o.jsonl.partial").exists()
    with pytest.raises(FeedbackError, match="neither"):
        merge(tmp_path / "missing.jsonl")


def _accelerate(args: list[str], inp: Path, out: Path) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        *args,
        "-m",
        "feedback",
        "batch",
        str(inp),
        str(out),
    ]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_accelerate_launch_two_processes_shards_then_merge_joins_in_order(tmp_path):
    # accelerate 1.15 starts N CPU processes through torchrun with --multi_gpu (gloo on a CPU-only machine);
    # with --cpu it starts one process unless an MPI hostfile is given (accelerate issue #2741).
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_tasks(inp, 6)
    run = _accelerate(
        [
            "--multi_gpu",
            "--num_processes",
            "2",
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "--main_process_port",
            "0",
        ],
        inp,
        out,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    parts = part_files(out)
    assert [p.name for p in parts] == ["out.jsonl.part0", "out.jsonl.part1"]
    assert [r["id"] for r in _lines(parts[0])] == ["t0", "t2", "t4"]
    assert [r["id"] for r in _lines(parts[1])] == ["t1", "t3", "t5"]
    assert "[rank 1/2]" in run.stdout
    # resuming across process counts is tested in-process above; the merge command in a process below
    assert merge(out) == {"records": 6, "parts": 2, "duplicates": 0, "output": str(out)}
    rows = _lines(out)
    assert [r["id"] for r in rows] == [f"t{i}" for i in range(6)] and all(r["status"] == "ok" for r in rows)


def test_accelerate_launch_cpu_then_merge_gives_every_task_once(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_tasks(inp, 4)
    run = _accelerate(
        [
            "--cpu",
            "--num_processes",
            "2",
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
        ],
        inp,
        out,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    merged = subprocess.run(
        [sys.executable, "-m", "feedback", "merge", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert merged.returncode == 0, merged.stderr
    assert [r["id"] for r in _lines(out)] == [f"t{i}" for i in range(4)] and not part_files(out)
