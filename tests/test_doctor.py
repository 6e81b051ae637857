"""`python -m feedback doctor` on CPU, as CI runs it: the steps that apply run (at the CPU plan's small
sizes), every CUDA-only step is skipped with its reason, doctor.json is written and parses, the exit
status is 0 and the table names every step. A step that raises is recorded as failed with its message
and the next step still runs; steps left out or past the time budget are recorded as skipped. The
CUDA-only steps that can run on a CPU (speed, compiled decode) are rehearsed at tiny sizes, so their
code paths are exercised here before a GPU ever runs them.

The whole CPU report runs once, in-process, for the module (~35 s on two cores, most of it the
app's start in its own process); the other tests use the session's embedded model."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from feedback.cli import main
from feedback.core import gemv
from feedback.core.engine import run_to_end
from feedback.core.records import RowSpec, RunConfig
from feedback.doctor import (
    REHEARSAL_PLAN,
    STEP_NAMES,
    STEPS,
    Context,
    Outcome,
    Step,
    run_steps,
    skipped,
    table_row,
)

CUDA_ONLY = {"quantized", "speed", "compiled"}


def _quiet_main(args: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(args)
    return status, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def cpu_report(tmp_path_factory):
    """The CPU report through the command line: exit status, doctor.json parsed, what it printed."""
    path = tmp_path_factory.mktemp("doctor") / "doctor.json"
    status, printed, _ = _quiet_main(["doctor", "--device", "cpu", "--out", str(path)])
    return status, json.loads(path.read_text()), printed


def _steps(report: dict) -> dict[str, dict]:
    return {s["name"]: s for s in report["steps"]}


def test_cpu_report_skips_every_cuda_step_with_its_reason(cpu_report):
    status, report, _ = cpu_report
    steps = _steps(report)
    assert status == 0 and report["failed"] == []
    assert [s["name"] for s in report["steps"]] == list(STEP_NAMES)
    for name in CUDA_ONLY:
        assert steps[name]["status"] == "skipped", name
        assert "no CUDA GPU" in steps[name]["summary"] and len(steps[name]["summary"]) > 30, name
    assert "python -m feedback bench" in steps["speed"]["summary"]
    assert report["machine"]["device"] == "cpu" and report["plan"]["greedy_tokens"] > 0
    kernel = report["machine"]["fp32_decode_kernel"]
    assert kernel == "gemv" if gemv.available() else kernel.startswith("oneDNN (gemv: ")


def test_cpu_report_runs_what_applies(cpu_report):
    _, report, _ = cpu_report
    steps = _steps(report)
    for name in set(STEP_NAMES) - CUDA_ONLY:
        assert steps[name]["status"] == "ok", (name, steps[name]["summary"])
        assert steps[name]["seconds"] > 0
    dtypes = steps["dtypes"]["details"]
    assert all(
        dtypes[d]["same_tokens"] and dtypes[d]["tokens"] > 0 for d in ("float32", "float16", "bfloat16")
    )
    memory = steps["memory"]["details"]
    assert memory["samples"] >= 1 and memory["rss_max_mb"] > 0 and not memory["cuda_fields"]
    strategies = steps["strategies"]["details"]
    assert strategies["residual"]["zero_vs_baseline_max_abs"] <= strategies["tolerances"]["strength_zero"]
    assert strategies["residual"]["mode"] == "jacobi" and "n/a" in strategies["restate"]["ppl"]
    app = steps["app"]["details"]
    assert app["health"]["status"] == "ok" and all(r["tokens"] > 0 for r in app["compare"]["rows"])


@pytest.mark.parametrize("family", ["gpt2", "gemma2", "mistral"])
def test_the_strategies_step_passes_on_tiny_families_it_once_failed(family, embedded_lm, tmp_path):
    """GPT-2 (cache and mask passed positionally), Gemma 2 (sliding and full layers in one block)
    and Mistral (a sliding window the prompt crosses), loaded as `random:<folder>`: every strategy
    exact beside a longer prompt, with causal scoring (inner_loop once failed all three)."""
    from tests.tiny_families import write_folder

    folder = write_folder(family, embedded_lm.tokenizer, tmp_path / family)
    path = tmp_path / "doctor.json"
    status, _, err = _quiet_main(
        [
            "doctor",
            "--device",
            "cpu",
            "--model",
            f"random:{folder}",
            "--only",
            "strategies",
            "--out",
            str(path),
        ]
    )
    strategies = _steps(json.loads(path.read_text()))["strategies"]
    assert status == 0 and strategies["status"] == "ok", strategies["summary"]
    loop = strategies["details"]["inner_loop"]
    assert loop["exact"] and loop["padded_batched_same_tokens_as_alone"]
    assert loop["causality_max_abs_nll"] <= strategies["details"]["tolerances"]["causality"]


def test_cpu_report_prints_a_table_row_per_step(cpu_report):
    _, report, printed = cpu_report
    lines = printed.splitlines()
    assert lines[0].split() == ["step", "status", "seconds", "result"]
    for step in report["steps"]:
        assert any(line.split()[:2] == [step["name"], step["status"]] for line in lines), step["name"]
    assert "wrote" in lines[-1]


def _empty_prompt_run(ctx: Context) -> Outcome:
    """A step whose real work raises: the engine refuses an empty prompt."""
    run_to_end(ctx.model("float32"), RunConfig(prompt="", max_new_tokens=4, rows=[RowSpec("baseline")]))
    return Outcome("unreachable")


def test_a_step_that_raises_is_recorded_and_the_next_step_runs(embedded_lm, tmp_path):
    ctx = Context(device="cpu", models={"float32": embedded_lm})
    memory = next(s for s in STEPS if s.name == "memory")
    out = tmp_path / "doctor.json"
    shown: list[str] = []
    report = run_steps(
        [Step("broken", "an engine run with an empty prompt", _empty_prompt_run), memory],
        ctx,
        out,
        shown.append,
    )
    broken, after = report["steps"]
    assert broken["status"] == "failed" and broken["summary"] == "prompt is empty"
    assert any("prompt is empty" in line for line in broken["details"]["traceback"])
    assert after["name"] == "memory" and after["status"] == "ok"
    assert report["failed"] == ["broken"] and json.loads(out.read_text())["steps"] == report["steps"]
    assert any(line.startswith("broken") and "failed" in line for line in shown)


def test_steps_left_out_or_past_the_budget_are_skipped_with_the_reason(embedded_lm):
    ctx = Context(device="cpu", models={"float32": embedded_lm})
    ran: list[str] = []
    steps = [Step(n, n, lambda c, n=n: ran.append(n) or Outcome("ran")) for n in ("a", "b")]
    report = run_steps(steps, ctx, show=lambda line: None, left_out={"a": "left out (--skip)"})
    assert [(s["status"], s["summary"]) for s in report["steps"]] == [
        ("skipped", "left out (--skip)"),
        ("ok", "ran"),
    ]
    report = run_steps(steps, ctx, show=lambda line: None, budget_s=0.0)
    assert all(s["status"] == "skipped" and "time budget (0 s)" in s["summary"] for s in report["steps"])
    assert ran == ["b"]
    assert "skipped" in table_row(skipped(steps[0], "why"))


def test_unknown_step_names_are_refused():
    status, _, err = _quiet_main(["doctor", "--only", "dtypes,nope"])
    assert status == 2 and "unknown step nope" in err and "strategies" in err


def test_cuda_steps_rehearsed_on_cpu(embedded_lm):
    """Speed and compiled decode run on a CPU when rehearsed (their numbers mean nothing here: the
    point is that their code runs); 8/4-bit loading cannot, and stays skipped."""
    ctx = Context(device="cpu", plan=REHEARSAL_PLAN, models={"float32": embedded_lm}, rehearse=True)
    report = run_steps([s for s in STEPS if s.name in CUDA_ONLY], ctx, show=lambda line: None)
    steps = _steps(report)
    assert steps["quantized"]["status"] == "skipped"
    speed = steps["speed"]
    assert speed["status"] == "ok", speed["summary"]
    shapes = speed["details"]["shapes"]
    assert [s["shape"] for s in shapes] == ["1x16", "2x16"]
    # generate's step is a difference of two wall times (a 4-token run less a 1-token one): on a busy
    # CPU at these sizes it can come out at or below zero, so only its presence is checked here
    assert all(
        s["engine_step_ms"] > 0 and isinstance(s["generate_step_ms"], float) and 0 < s["roofline_fraction"]
        for s in shapes
    )
    compiled = steps["compiled"]
    assert compiled["status"] == "ok", compiled["summary"]
    assert compiled["details"]["same_tokens"] and compiled["details"]["speedup"] > 0
