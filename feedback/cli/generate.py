"""`generate`: the baseline and a feedback strategy (or any rows, each with its own prompt) on one
prompt, side by side; or a saved run's next turn (--continue) or a branch of it from a forced token
(--branch). Prints each row's answer and metrics, or the RunResult as JSON."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

from feedback.cli import common
from feedback.errors import FeedbackError

NAME = "generate"


def add_parser(sub) -> None:
    p = sub.add_parser(
        NAME,
        help="baseline vs feedback (or any rows, each with its own prompt) on one prompt; "
        "the next turn of a saved run (--continue), or a branch of it (--branch)",
    )
    p.add_argument(
        "--prompt", default=None, help="the prompt (every row's, unless --row-prompt gives it its own)"
    )
    common.add_model_args(p)
    common.add_strategy_args(p, "residual")
    _add_row_args(p)
    _add_sampling_args(p)
    _add_quality_args(p)
    _add_follow_up_args(p)
    p.add_argument("--out", default=None, help="also write the RunResult JSON to this file")
    p.add_argument("--json", action="store_true", help="print one RunResult JSON object")


def _add_row_args(p) -> None:
    g = p.add_argument_group("rows (default: baseline, and feedback with --strategy/--param)")
    g.add_argument(
        "--row",
        action="append",
        type=common.row,
        default=[],
        metavar="NAME[:STRATEGY][,K=V...]",
        help="a row; repeat for more (no STRATEGY: a plain baseline row)",
    )
    g.add_argument(
        "--row-prompt",
        action="append",
        type=common.named,
        default=[],
        metavar="NAME=TEXT",
        help="this row's own prompt (a prompt variant)",
    )
    g.add_argument(
        "--row-system",
        action="append",
        type=common.named,
        default=[],
        metavar="NAME=TEXT",
        help="this row's own system prompt",
    )


def _add_sampling_args(p) -> None:
    # Numbers default to None: a flag left out keeps the config's own default (see `common.given`).
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--temperature", type=float, help="0 = greedy")
    p.add_argument("--top-p", type=float, help="1 = off")
    p.add_argument("--top-k", type=int, help="0 = off")
    p.add_argument("--min-p", type=float, help="0 = off")
    p.add_argument("--repetition-penalty", type=float, help="1 = off")
    p.add_argument("--seed", type=int)
    p.add_argument("--no-chat-template", action="store_true")
    p.add_argument("--system", default=None, help="system prompt (chat template only)")
    p.add_argument("--k", type=int, help="DeepConf top-k for token confidence")
    p.add_argument("--window", type=int, help="DeepConf group window (tokens)")
    p.add_argument("--threshold", type=float, default=None, help="early-stop group-confidence threshold")


def _add_quality_args(p) -> None:
    q = p.add_argument_group("quality metrics (length, distinct-n and repetition are always reported)")
    q.add_argument(
        "--quality", action="store_true", help="also self-perplexity and prompt perplexity per row"
    )
    q.add_argument(
        "--reference", default=None, help="a reference answer: its perplexity after each row's prompt"
    )
    q.add_argument(
        "--key-fact",
        action="append",
        default=[],
        metavar="TEXT|/REGEX/",
        help="a fact each answer should contain; repeat; recall is reported per row",
    )


def _add_follow_up_args(p) -> None:
    f = p.add_argument_group(
        "follow-ups of a saved run (RUN.json from --json or --out; its settings carry over)"
    )
    follow = f.add_mutually_exclusive_group()
    follow.add_argument(
        "--continue",
        dest="continue_from",
        default=None,
        metavar="RUN.json",
        help="the next turn: every row answers --say after its own conversation",
    )
    follow.add_argument(
        "--branch",
        dest="branch_from",
        default=None,
        metavar="RUN.json",
        help="replay --row up to --step, force --token there, decode on",
    )
    f.add_argument("--say", default=None, help="the next user message (with --continue)")
    f.add_argument("--step", type=int, default=None, help="the step to branch at (with --branch)")
    f.add_argument(
        "--token", default=None, help="the token forced at --step: a token id, or text (its tokens)"
    )
    f.add_argument(
        "--only-row",
        action="store_true",
        help="branch only --row; the other rows decode afresh (default: every row goes on from "
        "--row's text and the forced token)",
    )
    f.add_argument(
        "--matching-only",
        action="store_true",
        help="branch only the rows whose answer matched --row's up to --step; the others are "
        "replayed as they were",
    )


def run(args) -> int:
    from feedback.core.records import DeepConfConfig, RunConfig
    from feedback.core.sampling import SamplingConfig

    if args.continue_from or args.branch_from:
        return _follow_up(args)
    if (
        args.say is not None
        or args.step is not None
        or args.token is not None
        or args.only_row
        or args.matching_only
    ):
        raise FeedbackError(
            "--say goes with --continue; --step, --token, --only-row and --matching-only go with --branch"
        )
    if args.row and args.param:
        raise FeedbackError(
            "--param sets the default feedback row; with --row give parameters as NAME:STRATEGY,K=V"
        )
    rows = _rows(args)
    common.check_rows(rows)  # names and values, before the model loads
    given = common.given
    config = RunConfig(
        prompt=args.prompt or "",
        model=args.model or "embedded",
        dtype=args.dtype,
        chat_template=not args.no_chat_template,
        system_prompt=args.system,
        **given(args, "max_new_tokens", "seed"),
        sampling=SamplingConfig(
            **given(args, "temperature", "top_k", "top_p", "min_p", "repetition_penalty")
        ),
        deepconf=DeepConfConfig(**given(args, "k", "window"), threshold=args.threshold),
        rows=rows,
        reference=args.reference,
        key_facts=list(args.key_fact),
        quality=args.quality,
    ).validate()
    return _run_and_report(args, common.load(args), config)


def _rows(args) -> list:
    """The rows the flags describe, each with its own prompt and system prompt where given."""
    from feedback.core.records import RowSpec, default_rows

    rows = (
        [RowSpec(name, strategy, params) for name, strategy, params in args.row]
        if args.row
        else default_rows(args.strategy, dict(args.param))
    )
    by_name = {r.name: r for r in rows}
    for flag, field, pairs in (
        ("--row-prompt", "prompt", args.row_prompt),
        ("--row-system", "system_prompt", args.row_system),
    ):
        for name, text in pairs:
            if name not in by_name:
                raise FeedbackError(f"{flag} {name}: no such row (rows: {', '.join(by_name)})")
            setattr(by_name[name], field, text)
    return rows


def _follow_up(args) -> int:
    """--continue / --branch: a saved run's next turn or branch, on the model it ran on (unless
    --model/--dtype say otherwise), with its settings; --quality, --reference and --key-fact add to them."""
    from dataclasses import replace

    from feedback.core.session import branch, continue_run

    fresh = [
        flag
        for flag, given in (
            ("--prompt", args.prompt),
            ("--row-prompt", args.row_prompt),
            ("--row-system", args.row_system),
            ("--system", args.system),
            ("--param", args.param),
        )
        if given
    ]
    if fresh:
        raise FeedbackError(
            f"{fresh[0]} belongs to a new run; a follow-up takes the saved run's prompts and rows"
        )
    saved = _read_run(args.continue_from or args.branch_from)
    if args.continue_from:
        if (
            args.say is None
            or args.row
            or args.step is not None
            or args.token is not None
            or args.only_row
            or args.matching_only
        ):
            raise FeedbackError('--continue takes --say "the next message" (and no --row, --step, --token)')
        lm = _checked(args, saved, args.continue_from)
        config = continue_run(saved, args.say)
    else:
        if len(args.row) != 1 or args.row[0][1] or args.row[0][2] or args.step is None or args.token is None:
            raise FeedbackError("--branch needs --row NAME, --step N and --token TEXT|ID")
        lm = _checked(args, saved, args.branch_from)
        config = branch(
            saved,
            args.row[0][0],
            args.step,
            _token_ids(lm, args.token),
            all_rows=not args.only_row,
            matching_only=args.matching_only,
        )
    extra = {"quality": config.quality or args.quality}
    if args.reference is not None:
        extra["reference"] = args.reference
    if args.key_fact:
        extra["key_facts"] = list(args.key_fact)
    return _run_and_report(args, lm, replace(config, **extra).validate())


def _read_run(path: str):
    """A saved run (RunResult JSON), checked as a new run's config is, before the model loads."""
    from feedback.core.records import RunConfig, RunResult

    try:
        data = json.loads(Path(path).read_text())
        result = RunResult.from_dict(data)
        RunConfig.from_dict(result.config).validate()  # as a new run is, before the model loads
        return result
    except FileNotFoundError:
        raise FeedbackError(f"no such file: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise FeedbackError(f"{path} is not JSON: {exc}") from None
    except FeedbackError as exc:
        raise FeedbackError(f"{path}: {exc}") from None
    except (KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise FeedbackError(
            f"{path} is not a saved run (a RunResult from --json or --out): {exc!r}"
        ) from None


def _checked(args, saved, path: str):
    """The model a saved run goes on with (its own, unless --model/--dtype say otherwise), the run
    checked against it as every door checks a saved run: the library's limits here, as for a new
    run from the command line, and each row's answer against this model's vocabulary."""
    from feedback.serve.limits import check_saved_run

    lm = common.load(args, model=saved.config.get("model"), dtype=saved.config.get("dtype"))
    try:
        check_saved_run(saved, lm.vocab_size, served=False)
    except FeedbackError as exc:
        raise FeedbackError(f"{path}: {exc}") from None
    return lm


def _token_ids(lm, token: str) -> list[int]:
    """--token: digits are a token id; anything else is text, forced as its tokens."""
    if token.strip().isdigit():
        return [int(token)]
    ids = list(lm.tokenizer(token, add_special_tokens=False)["input_ids"])
    if not ids:
        raise FeedbackError(f"--token {token!r} has no tokens")
    return ids


def _run_and_report(args, lm, config) -> int:
    """Run `config` on `lm`; print the result (as JSON with --json) and write it to --out."""
    from feedback.core.engine import run_to_end, start_run

    if args.json:
        result = run_to_end(lm, config)
    else:
        live = start_run(lm, config)
        print(
            f"model {lm.name} ({lm.dtype}, {lm.device}), prompt {len(live.prompt_ids)} tokens",
            file=sys.stderr,
        )
        for _ in live:
            pass
        result = live.result
    if args.out:
        Path(args.out).write_text(result.to_json())
    if args.json:
        print(result.to_json())
    else:
        _print_result(result)
    return 0


def _print_result(result) -> None:
    """Each row's answer and its metrics, then where the first two rows diverge."""
    width = 100
    for row in result.rows:
        label = (
            row.name
            if not row.strategy
            else f"{row.name} [{row.strategy} " + ", ".join(f"{k}={v}" for k, v in row.params.items()) + "]"
        )
        m = row.metrics
        forced = sum(s.forced for s in row.steps)
        print(f"=== {label} ===")
        print(
            textwrap.fill(row.text.strip(), width, replace_whitespace=False)
            if row.text.strip()
            else "(empty)"
        )
        lowest = m.get("lowest_group")
        print(
            f"--- {len(row.token_ids)} tokens{f' ({forced} forced)' if forced else ''}, "
            f"{row.tokens_per_s:.1f} tok/s, mean confidence {(m.get('mean') or 0):.2f}, "
            f"lowest group {lowest if lowest is None else round(lowest, 2)}, "
            f"stop: {row.stop_reason} at step {row.stop_step}"
        )
        print("--- " + _quality_line(m) + "\n")
    if result.first_divergence_step is not None:
        print(
            f"first divergence of {result.rows[0].name} and {result.rows[1].name} at step "
            f"{result.first_divergence_step}"
        )
    elif len(result.rows) > 1:
        print(f"{result.rows[0].name} and {result.rows[1].name} produced identical tokens")


def _quality_line(m: dict) -> str:
    """A row's quality metrics on one line."""

    def num(key: str, spec: str) -> str:
        return "n/a" if m.get(key) is None else format(m[key], spec)

    parts = [
        f"distinct-1 {num('distinct_1', '.2f')}",
        f"distinct-2 {num('distinct_2', '.2f')}",
        f"repeated 3-grams {num('repeat_3gram_rate', '.0%')}",
        f"longest repeat {m.get('longest_repeat', 0)}",
    ]
    for key, label in (
        ("self_ppl", "self PPL"),
        ("prompt_ppl", "prompt PPL"),
        ("reference_ppl", "reference PPL"),
    ):
        if key in m:
            parts.append(f"{label} {num(key, '.2f')}")
    if "key_fact_recall" in m:
        unjudged = m.get("key_facts_unjudged") or []
        late = f"; not judged, out of time: {', '.join(unjudged)}" if unjudged else ""
        parts.append(
            f"key-fact recall {num('key_fact_recall', '.0%')} "
            f"({', '.join(m['key_facts_found']) or 'none found'}{late})"
        )
    return ", ".join(parts)
