"""`tune`: search a strategy's parameters for the lowest dev ΔPPL (Optuna TPE with pruning,
resumable from --out-dir), then score the best point once on held-out test text; writes
trials.jsonl, best.json and tune.html and recommends a trial only when it beats the baseline on both."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from feedback.cli import common
from feedback.errors import FeedbackError

NAME = "tune"


def add_parser(sub) -> None:
    p = sub.add_parser(
        NAME,
        help="search a strategy's parameters for the lowest dev ΔPPL (Optuna TPE with "
        "pruning, resumable), then score the best point once on test -> trials.jsonl, best.json, "
        "tune.html",
    )
    common.add_ppl_args(p)
    common.add_strategy_args(p, None, required=True)
    p.add_argument(
        "--trials", type=int, default=None, help="total trials, those already logged in --out-dir included"
    )
    p.add_argument(
        "--timeout", type=float, default=None, help="seconds to start new trials in (the last one finishes)"
    )
    p.add_argument(
        "--test",
        default=None,
        help="held-out corpus the best point is scored on once (default: "
        "builtin:test when --data is builtin:dev, else none)",
    )
    p.add_argument(
        "--out-dir",
        default=None,
        help="where trials.jsonl, best.json and tune.html go (default "
        "tune-STRATEGY); rerun with it to resume",
    )
    p.add_argument("--json", action="store_true", help="print the whole result as JSON instead of the table")


def run(args) -> int:
    from feedback.eval import corpus
    from feedback.eval.figures import table_row
    from feedback.eval.tune import TuneSettings, check_budget, run_tune, searched_names

    check_budget(args.trials, args.timeout)
    fixed = dict(args.param)
    searched_names(
        args.strategy, fixed
    )  # unknown strategy or parameter, nothing left to tune: before the model loads
    docs = corpus.load(args.data, common.warn)
    test = args.test if args.test is not None else ("builtin:test" if args.data == "builtin:dev" else "none")
    if test == args.data:
        raise FeedbackError(
            f"--test {test} is the tuning data: the best point must be confirmed on held-out text"
        )
    test_docs = corpus.load(test, common.warn) if test != "none" else None
    cfg = common.ppl_config(args, {})
    cfg.resolved_mode()
    lm = common.load(args)
    out = Path(args.out_dir or f"tune-{args.strategy}")

    def report(row: dict) -> None:
        trial, params, delta, state = table_row(row)
        ci = (
            f" [{row['ci95'][0]:+.3f}, {row['ci95'][1]:+.3f}]"
            if row.get("ci95") and None not in row["ci95"]
            else ""
        )
        print(
            f"[trial {trial}] {params}: ΔPPL {delta}{ci} {state} ({row['seconds']:.1f} s)",
            file=sys.stderr,
            flush=True,
        )

    settings = TuneSettings(
        trials=args.trials,
        timeout=args.timeout,
        seed=cfg.seed,
        out_dir=out,
        data=args.data,
        test=test if test_docs else "",
    )
    res = run_tune(lm, docs, args.strategy, cfg, fixed, settings, test_docs=test_docs, on_trial=report)
    if args.json:
        print(json.dumps(res))
        return 0
    _print_result(res, out)
    return 0


def _print_result(res: dict, out: Path) -> None:
    """The trials as a table, the files written, then the summary (`best_lines`)."""
    from feedback.eval.figures import table_row
    from feedback.eval.tune import BEST_FILE, HTML_FILE, TRIALS_FILE

    rows = [[str(c) for c in table_row(r)] for r in res["trials"]]
    head = ["trial", "params", "ΔPPL % dev", "state"]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    for line in [head, *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip())
    print(f"wrote {out / TRIALS_FILE}, {out / BEST_FILE} and {out / HTML_FILE}")
    if res["best"] is None:
        print("best: none (no trial completed with the strategy switched on)")
        return
    print("\n".join(best_lines(res["best"], res["test"])))


def best_lines(best: dict, test: dict | None) -> list[str]:
    """The tune's summary: the best dev trial (or, when none beats the baseline, the lowest) and its
    test score, each with its verdict (`feedback.eval.verdict`), then whether it is a recommendation."""
    from feedback.eval.figures import format_params
    from feedback.eval.verdict import ci_text, not_recommended, verdict

    dev_ci = best["ci95"] or [None, None]
    dev = verdict(best["delta_pct"], dev_ci)
    line = (
        f"{'best on dev' if dev.beats_baseline else 'lowest dev ΔPPL'}: trial {best['trial']} "
        f"({format_params(best['params'])}): dev ΔPPL {best['delta_pct']:+.3f} % "
        f"{ci_text(*dev_ci)} ({dev.text})"
    )
    on_test = None
    if test is None:
        line += "; no test evaluation (give --test DATA)"
    else:
        on_test = verdict(test["delta_pct"], test["ci95"])
        line += (
            f"; test ({test['data']}, {test['documents']} documents) "
            f"ΔPPL {test['delta_pct']:+.3f} %   95% CI "
            f"{ci_text(*test['ci95'])} % (paired bootstrap over {test['ci_method']}; {on_test.text})"
        )
    why = not_recommended(dev, on_test, noun="trial")
    verdict_line = (
        f"recommendation: trial {best['trial']} ({format_params(best['params'])})"
        if why is None
        else f"recommendation: none ({why})"
    )
    return [line, verdict_line]
