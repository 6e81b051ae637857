"""Batch runner: every task once in the output, even across a SIGKILL and a resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import types
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
    # the CLI runs 4 tasks at once by default: a part holds its lines in the order they finished
    assert sorted(r["id"] for r in _lines(parts[0])) == ["t0", "t2", "t4"]
    assert sorted(r["id"] for r in _lines(parts[1])) == ["t1", "t3", "t5"]
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
    # one process wrote the output itself (no parts to merge), its lines in the order they finished
    assert sorted(r["id"] for r in _lines(out)) == [f"t{i}" for i in range(4)] and not part_files(out)


# ---- parallel tasks (worker threads sharing the model's decode loop) ----


def _compare_tasks(path: Path) -> None:
    """Compare tasks of several shapes: default rows, another strategy, sampled, rows of their own."""
    tasks = [{"id": f"t{i}", "prompt": f"Count to {i + 2}.", "max_new_tokens": 4 + i % 3} for i in range(6)]
    tasks[1] |= {"strategy": "inner_loop"}
    tasks[2] |= {"temperature": 0.8, "seed": 3}
    tasks[4] |= {"rows": [{"name": "a"}, {"name": "b", "prompt": "Name a fruit.", "seed": 1}]}
    path.write_text("\n".join(json.dumps(t) for t in tasks) + "\n")


def _token_ids(path: Path) -> dict[str, list[list[int]]]:
    return {r["id"]: [row["token_ids"] for row in r["result"]["rows"]] for r in _lines(path)}


def test_parallel_compare_tasks_decode_together_and_give_the_tokens_of_one_at_a_time(tiny_lm, tmp_path):
    from feedback.core.sharing import decoder_for

    inp = tmp_path / "in.jsonl"
    _compare_tasks(inp)
    one = run_batch(tiny_lm, inp, tmp_path / "one.jsonl")
    decoder_for(tiny_lm).joins.clear()
    seen: list[int] = []
    three = run_batch(
        tiny_lm, inp, tmp_path / "three.jsonl", parallel=3, progress=lambda n, total, _: seen.append(n)
    )
    assert one == one | {"tasks": 6, "ok": 6} and three == three | {"tasks": 6, "ok": 6, "error": 0}
    assert three["output"] == str(tmp_path / "three.jsonl") and seen == [1, 2, 3, 4, 5, 6]
    # the tasks' runs joined the model's one decode loop beside each other's rows
    assert any(beside > 0 for _, beside in decoder_for(tiny_lm).joins)
    expected = _token_ids(tmp_path / "one.jsonl")
    assert sorted(expected) == [f"t{i}" for i in range(6)] and all(all(r) for r in expected.values())
    assert _token_ids(tmp_path / "three.jsonl") == expected
    rows = _lines(tmp_path / "three.jsonl")
    assert all(r["status"] == "ok" and r["attempts"] == 1 and r["peak_rss_mb"] > 0 for r in rows)
    assert sorted(r["line"] for r in rows) == list(range(1, 7))


def test_parallel_failures_are_retried_and_recorded_while_the_others_go_on(tiny_lm, tmp_path, monkeypatch):
    import feedback.serve.batch as batch

    tries: dict[str, int] = {}
    real = batch.run_task

    def flaky(lm, task, budget=None, stop=None, shared=False):
        tries[task["id"]] = tries.get(task["id"], 0) + 1
        if task["id"] == "flaky" and tries["flaky"] == 1:
            raise RuntimeError("a passing fault")
        assert shared  # parallel tasks go through the shared decode loop
        return real(lm, task, budget, stop, shared)

    monkeypatch.setattr(batch, "run_task", flaky)
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(
        "\n".join(
            [
                json.dumps({"id": "boom", "prompt": "hi", "max_new_tokens": 0}),  # fails every attempt
                json.dumps({"id": "flaky", "prompt": "hi", "max_new_tokens": 3}),
                "{broken",
                json.dumps({"id": "a", "prompt": "Say hi.", "max_new_tokens": 4}),
                json.dumps({"id": "p", "prompt": "some text to score here", "mode": "ppl", "bootstrap": 0}),
                json.dumps(
                    {
                        "id": "d",
                        "mode": "deepthink",
                        "prompt": "What is 2+2?",
                        "traces": 2,
                        "warmup": 2,
                        "max_new_tokens": 5,
                        "window": 4,
                        "k": 5,
                    }
                ),
            ]
        )
        + "\n"
    )
    warnings: list[str] = []
    summary = run_batch(tiny_lm, inp, out, retries=2, parallel=3, warn=warnings.append)
    assert summary == summary | {"tasks": 6, "ok": 4, "error": 1, "invalid": 1, "skipped": 0}
    rows = {r["id"]: r for r in _lines(out)}
    assert len(rows) == 6 and [w.split(": ", 1) for w in warnings] == [[f"{inp}:3", rows["line3"]["error"]]]
    assert rows["line3"]["status"] == "invalid" and "not valid JSON" in rows["line3"]["error"]
    assert rows["boom"] == rows["boom"] | {"status": "error", "attempts": 3} and tries["boom"] == 3
    assert "max_new_tokens" in rows["boom"]["error"]
    assert rows["flaky"] == rows["flaky"] | {"status": "ok", "attempts": 2} and "error" not in rows["flaky"]
    assert rows["flaky"]["result"]["rows"][0]["token_ids"]
    assert rows["p"]["result"]["baseline_ppl"] > 0 and rows["d"]["result"]["sides"]["feedback"]["traces"]
    assert all(rows[k]["attempts"] == 1 and rows[k]["status"] == "ok" for k in ("a", "p", "d"))


def test_parallel_resume_skips_the_done_ids_and_runs_each_other_once(tiny_lm, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _compare_tasks(inp)
    run_batch(tiny_lm, inp, tmp_path / "full.jsonl", parallel=3)
    full = (tmp_path / "full.jsonl").read_text().splitlines()
    done = [json.loads(line)["id"] for line in full[:2]]
    out.write_text(full[0] + "\n" + full[1] + "\n" + full[2][:40])  # two lines, then one torn mid-write
    summary = run_batch(tiny_lm, inp, out, parallel=3)
    assert summary == summary | {"tasks": 6, "skipped": 2, "ok": 4}
    ids = [r["id"] for r in _lines(out)]
    assert ids[:2] == done and sorted(ids) == [f"t{i}" for i in range(6)]
    again = run_batch(tiny_lm, inp, out, parallel=3)
    assert again == again | {"skipped": 6, "ok": 0} and len(_lines(out)) == 6


def test_parallel_interrupt_stops_every_task_and_a_resume_finishes_the_rest(tiny_lm, tmp_path):
    import threading

    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    tasks = [{"id": "quick", "prompt": "hi", "max_new_tokens": 1}] + [
        {"id": f"long{i}", "prompt": "Count on.", "max_new_tokens": 80} for i in range(4)
    ]
    inp.write_text("\n".join(json.dumps(t) for t in tasks) + "\n")

    def interrupt(n, total, _):  # Ctrl-C in the main thread once the first task is written
        if n == 1:
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    t0 = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        run_batch(tiny_lm, inp, out, parallel=3, progress=interrupt)
    assert time.perf_counter() - t0 < 30
    assert not [t for t in threading.enumerate() if t.name.startswith("feedback-lens-batch")]
    partial = _lines(out)  # the tasks stopped part-way are not recorded as done
    assert [r["id"] for r in partial] == ["quick"] and partial[0]["status"] == "ok"
    summary = run_batch(tiny_lm, inp, out, parallel=3)
    assert summary == summary | {"skipped": 1, "ok": 4}
    rows = _lines(out)
    assert sorted(r["id"] for r in rows) == sorted(t["id"] for t in tasks)
    assert all(row["stop_reason"] != "stopped" for r in rows for row in r["result"]["rows"])


def test_an_interrupt_inside_a_workers_start_still_waits_for_that_worker(tiny_lm, tmp_path, monkeypatch):
    # Ctrl-C can land in Thread.start() after the thread is launched and before it has begun
    # (a clean-clone run left worker 1 behind that way). Here worker 1 begins a second late and
    # the interrupt comes while start() waits for it.
    import threading

    real = threading.Thread

    class LateWorker(threading.Thread):
        def _bootstrap(self):
            time.sleep(1.0)
            super()._bootstrap()

        def start(self):
            main = threading.main_thread().ident
            threading.Timer(0.2, signal.pthread_kill, (main, signal.SIGINT)).start()
            super().start()

    def make(*args, name="", **kwargs):
        late = name == "feedback-lens-batch-1"
        return (LateWorker if late else real)(*args, name=name, **kwargs)

    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(
        "\n".join(json.dumps({"id": f"t{i}", "prompt": "Count on.", "max_new_tokens": 40}) for i in range(3))
    )
    from feedback.serve import batch

    monkeypatch.setattr(batch, "threading", types.SimpleNamespace(**(vars(threading) | {"Thread": make})))
    with pytest.raises(KeyboardInterrupt):
        run_batch(tiny_lm, inp, out, parallel=2)
    assert not [t for t in threading.enumerate() if t.name.startswith("feedback-lens-batch")]
    assert not out.exists() or all(r["status"] == "ok" for r in _lines(out))


def test_parallel_is_validated_in_the_library_and_on_the_command_line(tiny_lm, tmp_path, capsys):
    from feedback.cli import build_parser

    _write_tasks(tmp_path / "in.jsonl", 1)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(FeedbackError, match="parallel must be a whole number >= 1"):
            run_batch(tiny_lm, tmp_path / "in.jsonl", tmp_path / "out.jsonl", parallel=bad)
    assert not (tmp_path / "out.jsonl").exists() or not _lines(tmp_path / "out.jsonl")
    parse = build_parser().parse_args
    assert parse(["batch", "in.jsonl", "out.jsonl"]).parallel == 4
    assert parse(["batch", "in.jsonl", "out.jsonl", "--parallel", "1"]).parallel == 1
    assert parse(["batch", "in.jsonl", "out.jsonl", "--parallel", "7"]).parallel == 7
    for bad in ("0", "-2", "two", "1.5"):
        with pytest.raises(SystemExit) as exit_info:
            parse(["batch", "in.jsonl", "out.jsonl", "--parallel", bad])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert "--parallel" in err and "whole number >= 1" in err and repr(bad) in err
