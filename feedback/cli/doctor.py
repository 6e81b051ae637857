"""`doctor`: check this machine (dtypes, 8/4-bit, memory readings, speed against the roofline,
compiled decode, every strategy, the app) into doctor.json and a table (the checks themselves are
`feedback.doctor`)."""

from __future__ import annotations

NAME = "doctor"


def add_parser(sub) -> None:
    p = sub.add_parser(
        NAME,
        help="check this machine (dtypes, 8/4-bit, memory readings, speed vs the roofline, "
        "compiled decode, every strategy, the app): doctor.json and a table; CUDA-only steps are "
        "skipped on CPU with the reason",
    )
    p.add_argument(
        "--out",
        default="doctor.json",
        help="where the report goes (default doctor.json); rewritten after every step",
    )
    p.add_argument("--model", default=None, help="embedded (default) | hub id | local folder | file.gguf")
    p.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="auto (default): the GPU where there is one; cpu: the CPU report on any machine",
    )
    p.add_argument(
        "--only",
        type=_step_names,
        default=None,
        metavar="STEP,...",
        help="run only these steps (dtypes, quantized, memory, speed, compiled, strategies, app)",
    )
    p.add_argument("--skip", type=_step_names, default=[], metavar="STEP,...", help="leave these steps out")
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="start no step after this many seconds (default: 300 on CUDA, none on CPU)",
    )


def _step_names(text: str) -> list[str]:
    """STEP,... -> the step names."""
    return [name.strip() for name in text.split(",") if name.strip()]


def run(args) -> int:
    from feedback.doctor import run_doctor

    return run_doctor(args.out, args.model, args.only, args.skip, args.budget_s, args.device)
