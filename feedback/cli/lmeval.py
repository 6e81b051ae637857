"""`lmeval`: lm-evaluation-harness tasks for the baseline and a strategy on the same documents,
paired: per metric both values, the difference and a paired 95% interval (`feedback.eval.lmeval`)."""

from __future__ import annotations

import sys
from pathlib import Path

from feedback.cli import common
from feedback.errors import FeedbackError

NAME = "lmeval"


def add_parser(sub) -> None:
    p = sub.add_parser(
        NAME,
        help="lm-evaluation-harness tasks, baseline and a strategy on the same documents: "
        "per metric both values, the difference and a paired 95%% interval",
    )
    p.add_argument(
        "--tasks", required=True, help="comma-separated lm-eval task names (e.g. arc_easy,hellaswag)"
    )
    p.add_argument(
        "--include-path", default=None, metavar="DIR", help="a folder of task YAML files of your own"
    )
    common.add_model_args(p)
    common.add_strategy_args(p, None, required=True)
    # Numbers default to None: a flag left out keeps run_pair's own default (see `common.given`).
    p.add_argument(
        "--mode",
        default=None,
        choices=["exact", "parallel", "jacobi"],
        help="how the strategy scores (as ppl; default: parallel, jacobi for recurrent strategies)",
    )
    p.add_argument("--passes", type=int, help="jacobi passes (the first is clean)")
    p.add_argument(
        "--max-length", type=int, help="tokens per sequence at most (default 2048, capped by the model)"
    )
    p.add_argument("--window", type=int, help="rolling window in tokens (default max-length + 1)")
    p.add_argument(
        "--stride", type=int, help="new tokens per rolling window (default window - 1, as lm-eval)"
    )
    p.add_argument("--limit", type=float, default=None, help="documents per task (below 1: a share of them)")
    p.add_argument("--num-fewshot", type=int)
    p.add_argument("--batch-size", type=int, help="rows per batch (baseline scoring, generation)")
    p.add_argument("--max-gen-toks", type=int, help="new tokens per generation unless the task says")
    p.add_argument("--bootstrap", type=int, help="paired bootstrap resamples for continuous metrics")
    p.add_argument("--seed", type=int)
    p.add_argument("--out", default=None, help="also write the JSON result to this file")
    p.add_argument("--json", action="store_true")


def run(args) -> int:
    try:
        from feedback.eval.lmeval import format_table, run_pair
    except ImportError as exc:
        raise FeedbackError(
            f"lmeval needs lm-evaluation-harness: pip install lm-eval==0.4.13 ({exc})"
        ) from None

    tasks = _checked_tasks(args)
    lm = common.load(args)
    limit = int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit
    res = run_pair(
        lm,
        tasks,
        args.strategy,
        dict(args.param),
        include_path=args.include_path,
        limit=limit,
        log=None if args.json else lambda msg: print(msg, file=sys.stderr, flush=True),
        **common.given(
            args,
            "mode",
            "passes",
            "max_length",
            "window",
            "stride",
            "num_fewshot",
            "batch_size",
            "max_gen_toks",
            "bootstrap",
            "seed",
        ),
    )
    if common.json_result(args, res, printed_indent=1):
        return 0
    side = res["feedback_side"]
    print(
        f"{lm.name}: baseline vs {side['strategy']} ("
        + ", ".join(f"{k}={v}" for k, v in side["params"].items())
        + f"), mode {side['mode']}"
        + (f" ({side['passes']} passes)" if side["passes"] else "")
        + f", {res['wall_seconds']:.1f} s"
    )
    print(format_table(res["comparison"]))
    return 0


def _checked_tasks(args) -> list[str]:
    """The --tasks names, every flag checked before the model loads."""
    from feedback.eval.perplexity import BOOTSTRAP, PPLConfig
    from feedback.strategies import PromptStrategy, check_strategy, get_strategy

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise FeedbackError("--tasks needs at least one task name")
    if args.limit is not None and args.limit <= 0:
        raise FeedbackError(f"--limit must be positive, got {args.limit:g}")
    if args.bootstrap is not None:
        BOOTSTRAP.check(args.bootstrap)
    check_strategy(args.strategy, dict(args.param))  # names and values, before the model loads
    if not issubclass(get_strategy(args.strategy), PromptStrategy):  # a prompt-level one only generates
        PPLConfig(args.strategy, dict(args.param), args.mode, **common.given(args, "passes")).resolved_mode()
    if args.include_path and not Path(args.include_path).is_dir():
        raise FeedbackError(f"--include-path {args.include_path}: no such folder")
    return tasks
