"""`deepthink`: DeepConf's multi-trace vote per side (the baseline and a feedback strategy), with an
early-stop threshold calibrated on warm-up traces; on one prompt (every trace shown) or on a question
file (accuracy per side)."""

from __future__ import annotations

import json

from feedback.cli import common
from feedback.errors import FeedbackError

NAME = "deepthink"


def add_parser(sub) -> None:
    p = sub.add_parser(NAME, help="DeepConf multi-trace vote per side, with calibrated early stop")
    p.add_argument("--prompt", default=None)
    p.add_argument("--questions", default=None, help="JSONL of {question, answer}: accuracy per side")
    common.add_model_args(p)
    common.add_strategy_args(p, "residual")
    # Numbers default to None: a flag left out keeps DeepThinkConfig's own default (see `common.given`).
    p.add_argument("--traces", type=int, help="online traces per side")
    p.add_argument("--warmup", type=int, help="warm-up traces per side for calibration")
    p.add_argument("--eta", type=float, help="share of traces kept, %% (10: DeepConf-low, 90: high)")
    common.add_trace_args(p)
    p.add_argument("--expected", default=None, help="the right answer to --prompt: marks traces and votes")
    p.add_argument("--shared-threshold", action="store_true", help="one threshold from both sides' warm-up")
    p.add_argument("--check", action="store_true", help="finish stopped traces to measure tokens saved")
    p.add_argument("--no-chat-template", action="store_true")
    p.add_argument("--json", action="store_true")


def deepthink_config(args, prompt: str):
    """The DeepThinkConfig of the flags, for `prompt`."""
    from feedback.eval.deepthink import DeepThinkConfig

    return DeepThinkConfig(
        prompt=prompt,
        **common.given(
            args, "traces", "warmup", "eta", "window", "k", "max_new_tokens", "temperature", "top_p", "seed"
        ),
        strategy=args.strategy,
        params=dict(args.param),
        answer_regex=args.answer_regex,
        shared_threshold=args.shared_threshold,
        check=args.check,
        chat_template=not args.no_chat_template,
        expected=getattr(args, "expected", None),
    )


def run(args) -> int:
    from feedback.eval.deepthink import load_questions
    from feedback.strategies import get_strategy

    if (args.prompt is None) == (args.questions is None):
        raise FeedbackError("give either --prompt TEXT or --questions FILE.jsonl")
    if args.expected is not None and args.questions is not None:
        raise FeedbackError("--expected goes with --prompt; a question file has an answer per question")
    get_strategy(args.strategy)
    questions = load_questions(args.questions) if args.questions else None
    lm = common.load(args)
    if questions is not None:
        return _questions(args, lm, questions)
    return _one_prompt(args, lm)


def _validated(args, lm, prompt: str):
    """The config for `prompt`, checked against the model, its warnings printed."""
    cfg = deepthink_config(args, prompt)
    for warning in cfg.validate(lm.num_layers):
        common.warn(warning)
    return cfg


def _questions(args, lm, questions) -> int:
    """--questions: accuracy per side (single trace, majority vote, DeepConf vote) and tokens."""
    from feedback.eval.deepthink import accuracy

    base = _validated(args, lm, "")
    res = accuracy(lm, questions, base, progress=None if args.json else common.progress)
    if args.json:
        print(json.dumps(res))
        return 0
    print(
        f"{res['questions']} questions, {base.traces} traces + {base.warmup} warm-up per side, "
        f"eta {base.eta}%"
    )
    print(f"{'side':10} {'single':>7} {'majority':>9} {'deepconf':>9} {'tokens':>9} {'saved':>8}")
    for side, a in res["accuracy"].items():
        print(
            f"{side:10} {a['single']:7.1%} {a['majority']:9.1%} {a['deepconf']:9.1%} {a['tokens_spent']:9d} "
            f"{a['tokens_saved']:8d}"
        )
    return 0


def _one_prompt(args, lm) -> int:
    """--prompt: each side's answer, its votes and every trace."""
    from feedback.eval.deepthink import deep_think

    cfg = _validated(args, lm, args.prompt)
    rep = deep_think(lm, cfg)
    if args.json:
        print(json.dumps(rep))
        return 0
    for side, s in rep["sides"].items():
        _print_side(side, s, cfg.traces)
    print(f"{rep['wall_seconds']:.1f} s")
    return 0


def _mark(correct) -> str:
    return "" if correct is None else " (correct)" if correct else " (wrong)"


def _print_side(side: str, s: dict, traces: int) -> None:
    """One side of a --prompt run: threshold, answer and votes, tokens, then a line per trace."""
    votes = s["votes"]
    print(f"=== {side} === threshold {s['threshold']:.3f}, {s['stopped']} of {traces} online traces stopped")
    print(
        f"answer: {s['answer']!r}{_mark(s['correct'])} (share {s['share']:.0%}; majority "
        f"{votes['majority']['answer']!r}{_mark(votes['majority']['correct'])}, tail-weighted "
        f"{votes['tail']['answer']!r}{_mark(votes['tail']['correct'])})"
    )
    print(f"tokens spent {s['tokens_spent']}, saved {s['tokens_saved']} ({s['tokens_saved_method']})")
    for t in s["traces"]:
        flag = (
            "stopped"
            if t["stopped"]
            else "filtered"
            if t["excluded"]
            else "voted"
            if t["answer"] is not None
            else "no answer"
        )
        low = t["lowest_group"]
        print(
            f"  {t['phase']:6} {t['name']:14} {flag:9} {t['tokens']:4d} tok  "
            f"lowest {low if low is None else round(low, 2)!s:>6}  "
            f"answer {t['answer']!r}{_mark(t['correct'])}"
        )
