"""`recall`: long-context key-fact recall. Synthetic facts at depths 0-100 % of distractor texts of
256 to 4,096 tokens; accuracy per length x depth per row, McNemar and a paired bootstrap of the gold
answer's log-probability against the baseline; optionally the heatmaps as HTML."""

from __future__ import annotations

import sys
from pathlib import Path

from feedback.cli import common
from feedback.errors import FeedbackError

NAME = "recall"


def add_parser(sub) -> None:
    p = sub.add_parser(
        NAME,
        help="long-context key-fact recall: synthetic facts at depths 0-100 %% of texts "
        "of 256 to 4,096 tokens, accuracy per length x depth per row, McNemar and a paired bootstrap "
        "of the gold answer's log-probability vs the baseline",
    )
    common.add_model_args(p)
    common.add_strategy_args(p, None)
    p.add_argument(
        "--row",
        action="append",
        type=common.row,
        default=[],
        metavar="NAME:STRATEGY[,K=V...]",
        help="another strategy row; repeat (the baseline row is always first)",
    )
    # Numbers default to None: a flag left out keeps RecallConfig's own default (see `common.given`).
    p.add_argument("--items", type=int, help="facts (kinds in turn: number, name, date, two-hop); default 4")
    p.add_argument("--lengths", help="tokens of text, e.g. 256,1024,4096 (default 256,512,1024,2048,4096)")
    p.add_argument("--depths", help="%% of the text before the fact, e.g. 0,50,100 (default 0,25,50,75,100)")
    p.add_argument("--seed", type=int, help="facts, distractor text and the bootstrap")
    p.add_argument("--max-new-tokens", type=int, help="new tokens per answer at most (default 24)")
    p.add_argument(
        "--split", choices=["dev", "test"], help="built-in corpus split for the distractor text (test)"
    )
    p.add_argument("--bootstrap", type=int, help="resamples of the gold log-probability's 95%% CI (0: none)")
    p.add_argument("--out", default=None, help="also write the whole result (every answer) as JSON here")
    p.add_argument(
        "--html", default=None, help="also write the heatmaps (each row, each difference) to this HTML file"
    )
    p.add_argument("--json", action="store_true")


def run(args) -> int:
    from feedback.core.budget import Budget
    from feedback.eval.recall import RecallConfig, check_budget, evaluate_recall, plan, report_lines

    rows = _rows(args)
    cfg = RecallConfig(
        **common.given(args, "items", "lengths", "depths", "seed", "max_new_tokens", "split", "bootstrap")
    ).validate()  # refused before the model loads
    lm = common.load(args)
    instances = plan(lm, cfg)  # a length beyond the model's context is refused here, before any run
    budget = Budget.from_env(served=False)
    check_budget(budget, instances, rows, cfg.max_new_tokens, items_name="--items")
    res = evaluate_recall(
        lm, cfg, rows, instances=instances, on_instance=None if args.json else _progress, budget=budget
    )
    if args.html:
        from feedback.eval.recall_figures import write_html

        write_html(Path(args.html), res)
    if common.json_result(args, res):
        return 0
    print("\n".join(report_lines(res)))
    return 0


def _progress(rec: dict) -> None:
    """One line on stderr per answered instance: where the fact was, and each row right or wrong."""
    marks = " ".join(f"{name} {'right' if r['right'] else 'wrong'}" for name, r in rec["rows"].items())
    print(
        f"[{rec['done']}/{rec['total']}] length {rec['length']}, depth {rec['depth']:g}%, item {rec['item']} "
        f"({rec['kind']}): {marks}",
        file=sys.stderr,
        flush=True,
    )


def _rows(args) -> list:
    """The baseline, then --strategy (a row named after it) and each --row (each with a strategy)."""
    from feedback.core.records import RowSpec

    if args.param and not args.strategy:
        raise FeedbackError("--param goes with --strategy (with --row give parameters as NAME:STRATEGY,K=V)")
    rows = [RowSpec("baseline")] + (
        [RowSpec(args.strategy, args.strategy, dict(args.param))] if args.strategy else []
    )
    for name, strategy, params in args.row:
        if not strategy:
            raise FeedbackError(
                f"--row {name}: give it a strategy (NAME:STRATEGY); the baseline row is always there"
            )
        rows.append(RowSpec(name, strategy, params))
    names = [r.name for r in rows]
    if len(set(names)) != len(names):
        raise FeedbackError(f"row names must differ, got {', '.join(names)}")
    common.check_rows(rows)
    return rows
