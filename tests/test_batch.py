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

from feedback.batch import finished_ids, read_tasks, run_batch

ROOT = Path(__file__).resolve().parents[1]


def _write_tasks(path: Path, n: int) -> None:
    lines = [json.dumps({"id": f"t{i}", "prompt": f"Count to {i + 2}.", "max_new_tokens": 6}) for i in range(n)]
    path.write_text("\n".join(lines) + "\n")


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_bad_lines_failures_and_resume(tiny_lm, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join([
        json.dumps({"id": "a", "prompt": "hi", "max_new_tokens": 3}),
        "{broken",
        json.dumps({"prompt": "  "}),
        json.dumps({"id": "boom", "prompt": "hi", "max_new_tokens": 0}),  # invalid config: fails every attempt
        json.dumps({"id": "p", "prompt": "some text to score here", "mode": "ppl", "strategy": "deep_cache",
                    "bootstrap": 0}),
    ]) + "\n")
    warnings: list[str] = []
    summary = run_batch(tiny_lm, inp, out, retries=2, warn=warnings.append)
    assert summary == summary | {"tasks": 5, "ok": 2, "error": 1, "invalid": 2, "skipped": 0}
    rows = {r["id"]: r for r in _lines(out)}
    assert rows["a"]["status"] == "ok" and rows["a"]["result"]["rows"][0]["token_ids"]
    assert rows["line2"]["status"] == "invalid" and "not valid JSON" in rows["line2"]["error"]
    assert rows["line3"]["status"] == "invalid" and "prompt" in rows["line3"]["error"]
    assert rows["boom"]["status"] == "error" and rows["boom"]["attempts"] == 3 and "max_new_tokens" in rows["boom"]["error"]
    assert rows["p"]["result"]["mode"] == "parallel" and rows["p"]["peak_rss_mb"] > 0
    assert [w.split(":")[1] for w in warnings] == ["2", "3"]
    again = run_batch(tiny_lm, inp, out)
    assert again["skipped"] == 5 and len(_lines(out)) == 5


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
