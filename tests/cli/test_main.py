"""`main` (feedback/cli/__init__.py): every command registered and its help, and what a run's failure
prints: one line and status 2 for a refused input, 1 for a failure mid-run (its traceback on request)."""

from __future__ import annotations

import pytest

from feedback.cli import COMMANDS, TRACEBACK_ENV, build_parser, generate, main
from tests.cli.helpers import cli, in_process


def test_a_refused_input_in_a_real_process_is_one_line_and_status_2():
    out = cli("generate", "--prompt", "hi", "--param", "alpha=7")
    assert out.returncode == 2 and "alpha=7.0 is out of range" in out.stderr and "Traceback" not in out.stderr


def _crash(args):
    """A failure mid-run as torch reports a model's shape mismatch: a long, many-line message."""
    raise RuntimeError(
        "The size of tensor a (74) must match the size of tensor b (37) at non-singleton "
        "dimension 3\n" + "  frame\n" * 100
    )


def test_a_failure_mid_run_is_one_line_and_status_1(monkeypatch):
    monkeypatch.setattr(generate, "run", _crash)
    monkeypatch.delenv(TRACEBACK_ENV, raising=False)
    out = in_process("generate", "--prompt", "hi")
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        "error: generate failed: RuntimeError: The size of tensor a (74) must match the size of tensor b "
        "(37) at non-singleton dimension 3 (set FEEDBACK_TRACEBACK=1 for the traceback)"
    ]


def test_the_traceback_is_there_when_asked_for(monkeypatch):
    monkeypatch.setattr(generate, "run", _crash)
    monkeypatch.setenv(TRACEBACK_ENV, "1")
    with pytest.raises(RuntimeError, match="size of tensor a"):
        in_process("generate", "--prompt", "hi")


@pytest.mark.parametrize("command", [command.NAME for command in COMMANDS])
def test_every_command_prints_its_help(command, capsys):
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0 and capsys.readouterr().out.startswith("usage:")


def test_help_lists_every_command_once_in_the_order_registered():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert list(sub.choices) == [command.NAME for command in COMMANDS]


def test_usage_names_the_command_as_it_was_called(monkeypatch):
    from feedback.cli import build_parser

    monkeypatch.setattr("sys.argv", ["/usr/local/bin/feedback-lens", "--help"])
    assert build_parser().format_usage().startswith("usage: feedback-lens ")
    monkeypatch.setattr("sys.argv", ["/repo/feedback/__main__.py", "--help"])
    assert build_parser().format_usage().startswith("usage: python -m feedback ")
