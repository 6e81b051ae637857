"""`ppl`: teacher-forced perplexity of a corpus, the baseline against a feedback strategy (the
baseline alone without --strategy), with ΔPPL and its paired-bootstrap 95% CI."""

from __future__ import annotations

from feedback.cli import common

NAME = "ppl"


def add_parser(sub) -> None:
    p = sub.add_parser(
        NAME,
        help="teacher-forced perplexity, baseline vs a feedback strategy (omit "
        "--strategy for the baseline only)",
    )
    common.add_ppl_args(p)
    common.add_strategy_args(p, None)
    p.add_argument("--out", default=None, help="also write the JSON result to this file")
    p.add_argument("--json", action="store_true")


def run(args) -> int:
    from feedback.eval import corpus
    from feedback.eval.perplexity import evaluate

    docs = corpus.load(args.data, common.warn)
    cfg = common.ppl_config(args)
    if args.strategy:
        from feedback.strategies import get_strategy

        get_strategy(args.strategy)
    cfg.resolved_mode()
    lm = common.load(args)
    result = evaluate(lm, docs, cfg, progress=None if args.json else common.progress)
    result["data"] = args.data
    if common.json_result(args, result, indent=2, printed_indent=2):
        return 0
    _print_result(args, result)
    return 0


def _print_result(args, result: dict) -> None:
    """The corpus, both perplexities and ΔPPL with its CI."""
    approximate = f" (approximate, {result['passes']} passes)" if result["approximate"] else ""
    print(
        f"{result['documents']} documents, {result['tokens']} tokens, mode {result['mode']}{approximate}, "
        f"{result['wall_seconds']:.1f} s"
    )
    print(f"baseline PPL  {result['baseline_ppl']:.3f}")
    if "feedback_ppl" in result:
        lo, hi = result["ci95"]
        print(
            f"feedback PPL  {result['feedback_ppl']:.3f}   ({args.strategy} "
            + ", ".join(f"{k}={v}" for k, v in result["config"]["params"].items())
            + ")"
        )
        print(
            f"ΔPPL          {result['delta_pct']:+.3f} %   95% CI [{lo:+.3f}, {hi:+.3f}] % "
            f"(paired bootstrap over {result['ci_method']})"
        )
