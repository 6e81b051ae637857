"""`batch`: run a JSONL file of tasks, appending each result to a JSONL file (rerun to resume);
under accelerate launch, torchrun or MPI each process runs its share into a part file (see `merge`)."""

from __future__ import annotations

import argparse
import os
import sys

from feedback.cli import common

NAME = "batch"
DEFAULT_PARALLEL = 4


def parallel(text: str) -> int:
    """--parallel N: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expects a whole number >= 1, got {text!r}")
    return value


def add_parser(sub) -> None:
    p = sub.add_parser(NAME, help="run a JSONL file of tasks; results appended to a JSONL file (resumable)")
    p.add_argument("input", help="JSONL: one task a line (id, prompt, mode, strategy, params, ...)")
    p.add_argument("output", help="JSONL results; rerun with the same file to resume")
    common.add_model_args(p)
    p.add_argument("--retries", type=int, help="retries of a failing task before it is recorded")
    p.add_argument(
        "--parallel",
        type=parallel,
        default=DEFAULT_PARALLEL,
        metavar="N",
        help=f"tasks run at once (default {DEFAULT_PARALLEL}): compare and deepthink tasks decode together "
        "in one batch, exact (the same tokens as one at a time), so N tasks take about the CPU of one "
        "batched run; ppl tasks take turns at the model. Results are written as tasks finish",
    )
    p.add_argument(
        "--lenient",
        action="store_true",
        help="ignore unknown task fields instead of recording the line as invalid",
    )


def run(args) -> int:
    from feedback.core.budget import Budget
    from feedback.serve.batch import run_batch, summary_line

    rank, world, device = _launcher_shard()
    tag = f"[rank {rank}/{world}] " if world > 1 else ""
    if world > 1 and args.device_map:
        print(
            f"warning: {tag}--device-map with {world} processes: every rank spreads its own copy of the "
            "model over all devices; for a model that needs several GPUs run one process",
            file=sys.stderr,
        )
    lm = common.load(args, device=device if args.device_map is None else "auto")

    def progress(done: int, total: int, elapsed: float) -> None:
        rate = done / elapsed if elapsed > 0 else 0.0
        eta = (total - done) / rate if rate > 0 else float("nan")
        end = "\n" if world > 1 or done == total else ""  # ranks share stderr: whole lines only
        print(
            f"\r  {tag}[{done}/{total}] {rate:.2f} tasks/s, ETA {eta:.0f} s",
            end=end,
            file=sys.stderr,
            flush=True,
        )

    summary = run_batch(
        lm,
        args.input,
        args.output,
        **common.given(args, "retries"),
        shard=(rank, world),
        warn=lambda msg: print(f"warning: {tag}{msg}", file=sys.stderr),
        progress=progress,
        lenient=args.lenient,
        parallel=args.parallel,
        budget=Budget.from_env(served=False),
    )
    print(tag + summary_line(summary))
    if world > 1:
        print(
            f"{tag}wrote {summary['output']}; once every rank is done: python -m feedback merge {args.output}"
        )
    return 0


def _launcher_shard() -> tuple[int, int, str]:
    """(rank, processes, device) under accelerate launch, torchrun or MPI; (0, 1, "auto") when run plainly."""
    if not any(
        os.environ.get(k)
        for k in (
            "WORLD_SIZE",
            "LOCAL_RANK",
            "PMI_SIZE",
            "OMPI_COMM_WORLD_SIZE",
            "MV2_COMM_WORLD_SIZE",
            "ACCELERATE_USE_CPU",
        )
    ):
        return 0, 1, "auto"
    import torch
    from accelerate import PartialState

    cpu = not torch.cuda.is_available() or os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true")
    state = PartialState(cpu=cpu)
    return state.process_index, state.num_processes, str(state.device)
