"""`qa`: a question set with gold answers, answered greedily per row: accuracy and the gold answer's
perplexity per row (how a prompt-level strategy such as restate is scored)."""

from __future__ import annotations

import sys

from feedback.cli import common
from feedback.errors import FeedbackError

NAME = "qa"


def add_parser(sub) -> None:
    p = sub.add_parser(
        NAME,
        help="a question set with gold answers, greedy: accuracy and the gold answer's "
        "perplexity per row (how a prompt-level strategy such as restate is scored)",
    )
    p.add_argument(
        "--questions",
        default=None,
        help="JSONL of {question, answer} (default: the built-in 16, feedback/assets/questions.jsonl)",
    )
    p.add_argument(
        "--row",
        action="append",
        type=common.row,
        default=[],
        metavar="NAME[:STRATEGY][,K=V...]",
        help="a row; repeat (default: baseline, and restate)",
    )
    p.add_argument("--max-new-tokens", type=int, help="new tokens per answer at most")
    common.add_model_args(p)
    p.add_argument("--out", default=None, help="also write the whole result (every answer) as JSON here")
    p.add_argument("--json", action="store_true")


def run(args) -> int:
    from feedback.eval.deepthink import load_questions
    from feedback.eval.qa import BUILTIN_QUESTIONS, evaluate_qa

    rows = _rows(args)
    questions = load_questions(args.questions or BUILTIN_QUESTIONS)
    lm = common.load(args)
    res = evaluate_qa(
        lm, questions, rows, **common.given(args, "max_new_tokens"), progress=None if args.json else _progress
    )
    if common.json_result(args, res):
        return 0
    print(f"{res['questions']} questions, greedy, {res['max_new_tokens']} new tokens at most")
    for name, s in res["rows"].items():
        ppl = "n/a" if s["gold_ppl"] is None else f"{s['gold_ppl']:.2f}"
        print(
            f"  {name:14} accuracy {s['accuracy']:6.1%} ({s['right']}/{res['questions']})  "
            f"gold-answer PPL {ppl:>8}"
            f"  mean tokens {s['mean_tokens']:.1f}"
        )
    return 0


def _progress(done: int, total: int) -> None:
    print(f"[{done}/{total}]", file=sys.stderr, flush=True)


def _rows(args) -> list:
    """The --row rows (default: baseline and restate), every name and value checked before the model loads."""
    from feedback.core.records import MAX_NEW_TOKENS_CAP, RowSpec

    rows = [RowSpec(name, strategy, params) for name, strategy, params in args.row] or [
        RowSpec("baseline"),
        RowSpec("restate", "restate"),
    ]
    if len({r.name for r in rows}) != len(rows):
        raise FeedbackError("row names must differ")
    if args.max_new_tokens is not None and not 1 <= args.max_new_tokens <= MAX_NEW_TOKENS_CAP:
        raise FeedbackError(
            f"--max-new-tokens must be in [1, {MAX_NEW_TOKENS_CAP}], got {args.max_new_tokens}"
        )
    common.check_rows(rows)
    return rows
