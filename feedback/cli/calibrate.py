"""`calibrate`: is the confidence worth trusting? Sampled traces of a question set with gold answers,
per row: reliability bins, ECE, adaptive ECE, Brier and AUROC of each DeepConf measure (Platt-scaled
on the dev half, scored on the test half), and what the early-stop threshold keeps."""

from __future__ import annotations

from feedback.cli import common

NAME = "calibrate"


def add_parser(sub) -> None:
    p = sub.add_parser(
        NAME,
        help="is the confidence worth trusting? sampled traces of a question set with "
        "gold answers, per row: reliability bins, ECE, adaptive ECE, Brier and AUROC of each DeepConf "
        "measure (Platt-scaled on dev, scored on test), and what the early-stop threshold keeps",
    )
    p.add_argument(
        "--questions",
        default=None,
        help="builtin (default: the 16 of feedback/assets/questions.jsonl) | JSONL of {question, answer}",
    )
    common.add_model_args(p)
    common.add_strategy_args(p, "residual")
    # Numbers default to None: a flag left out keeps CalibrationConfig's own default (see `common.given`).
    p.add_argument("--samples", type=int, help="sampled traces per question per row (default 8)")
    p.add_argument(
        "--eta",
        type=float,
        action="append",
        default=None,
        help="share of traces the early-stop threshold keeps, %%; repeat (default 10 and 90)",
    )
    p.add_argument("--bins", type=int, help="reliability bins (default 10)")
    common.add_trace_args(p)
    p.add_argument("--no-chat-template", action="store_true")
    p.add_argument("--out", default=None, help="also write the whole result (every trace) as JSON here")
    p.add_argument("--json", action="store_true", help="print the whole result as JSON instead of the table")


def calibration_config(args):
    """The CalibrationConfig of the flags."""
    from feedback.eval.calibration import CalibrationConfig

    return CalibrationConfig(
        strategy=args.strategy,
        params=dict(args.param),
        **common.given(
            args,
            "samples",
            "max_new_tokens",
            "temperature",
            "top_p",
            "seed",
            "window",
            "k",
            "bins",
            etas="eta",
        ),
        answer_regex=args.answer_regex,
        chat_template=not args.no_chat_template,
    )


def run(args) -> int:
    from feedback.eval.calibration import calibrate, check_questions, read_questions
    from feedback.strategies import ANY_LAYERS

    cfg = calibration_config(args)
    cfg.validate(ANY_LAYERS)  # every value (strategy names and parameters too) before the model loads
    questions = check_questions(read_questions(args.questions))
    lm = common.load(args)
    res = calibrate(lm, questions, cfg, progress=None if args.json else common.progress)
    for warning in res["warnings"]:
        common.warn(warning)
    if common.json_result(args, res):
        return 0
    _print_measures(res, cfg)
    _print_thresholds(res)
    print(f"{res['wall_seconds']:.1f} s")
    return 0


def _num(value, fmt: str) -> str:
    """`value` in `fmt`, or a dash as wide as the format's width when there is no number."""
    width = int("".join(c for c in fmt.split(".")[0] if c.isdigit()) or 0)
    return "—".rjust(width) if value is None else format(value, fmt)


def _interval(pair, too_few: str | None) -> str:
    """A 95% CI column: "[0.61, 0.93]", "too few" where the traces cannot judge the measure, or a dash."""
    if too_few:
        return "too few"
    return "—" if pair is None else f"[{pair[0]:.2f}, {pair[1]:.2f}]"


def _print_measures(res: dict, cfg) -> None:
    """The settings, then a table row per row and measure on the test half, with its legend."""
    from feedback.eval.calibration import (
        ECE_RESAMPLES,
        ECE_SEED,
        MIN_JUDGED_TRACES,
        MIN_PER_CLASS,
        side_too_few,
    )

    split = res["split"]
    print(
        f"{res['questions']} questions (dev {split['dev']}, test {split['test']}: even / odd positions), "
        f"{cfg.samples} samples per question per row, temperature {cfg.temperature:g}, top-p {cfg.top_p:g}, "
        f"<= {cfg.max_new_tokens} new tokens, window {cfg.window}, seed {cfg.seed}"
    )
    print("Platt scaling fitted on dev; every number below on test")
    head = (
        f"{'row':9} {'measure':15} {'traces':>6} {'acc':>6} {'AUROC':>6} {'95% CI':>12} {'ECE':>6} "
        f"{'95% CI':>12} {'aECE':>6} {'Brier':>6} {'base':>6} {'rawECE*':>7}"
    )
    print(head)
    for side, rep in res["sides"].items():
        for name, m in rep["measures"].items():
            t = m["test"]
            print(
                f"{side:9} {name:15} {t['traces']:6d} {_num(t['accuracy'], '6.1%')} "
                f"{_num(t['auroc'], '6.3f')} "
                f"{_interval(t['auroc_ci95'], t['too_few']):>12} {_num(t['ece'], '6.3f')} "
                f"{_interval(t['ece_ci95'], t['too_few']):>12} {_num(t['adaptive_ece'], '6.3f')} "
                f"{_num(t['brier'], '6.3f')} {_num(t['brier_base_rate'], '6.3f')} "
                f"{_num(t['uncalibrated_minmax_ece'], '7.3f')}"
            )
    print(
        "aECE: equal-mass bins; base: Brier of predicting the dev accuracy for every trace; *rawECE: the raw "
        "measure min-max scaled over dev, uncalibrated (not a probability)"
    )
    print(
        "95% CI: the AUROC's a score interval on Hanley & McNeil's variance, the ECE's a bootstrap of the "
        f"test traces ({ECE_RESAMPLES} resamples, seed {ECE_SEED}); too few: fewer than {MIN_JUDGED_TRACES} "
        "test traces, "
        f"or fewer than {MIN_PER_CLASS} right or {MIN_PER_CLASS} wrong ones, which cannot judge a measure"
    )
    for side, rep in res["sides"].items():
        reason = side_too_few(rep)
        if reason:
            print(f"  {side}: {reason}; its AUROC and ECE are no evidence either way")


def _print_thresholds(res: dict) -> None:
    """Per row and eta: the early-stop threshold from dev, what it keeps on dev and test, and per question."""
    print("early-stop threshold on lowest group confidence (voting.calibrate_threshold over the dev traces):")
    for side, rep in res["sides"].items():
        for th in rep["thresholds"]:
            if th["threshold"] is None:
                print(f"  {side:9} eta {th['eta']:g}%: no dev trace with a confidence")
                continue
            dev, test, per_q = th["dev"], th["test"], th["per_question_dev"]
            print(
                f"  {side:9} eta {th['eta']:g}%: s = {th['threshold']:.3f} "
                f"keeps {_num(dev['kept_share'], '.0%')} of dev traces, "
                f"accuracy {_num(dev['accuracy_kept'], '.1%')} vs {_num(dev['accuracy_all'], '.1%')} all; "
                f"test: keeps {_num(test['kept_share'], '.0%')}, "
                f"{_num(test['accuracy_kept'], '.1%')} vs {_num(test['accuracy_all'], '.1%')}; "
                "a threshold per dev question (as Deep Think): "
                f"{_num(per_q and per_q['accuracy_kept'], '.1%')} vs "
                f"{_num(per_q and per_q['accuracy_all'], '.1%')}"
            )
