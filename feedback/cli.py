"""Command line: python -m feedback {generate, ppl, sweep, tune, qa, recall, deepthink, lmeval, calibrate, batch, merge, bench, doctor, prepare}."""
from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
from pathlib import Path

from feedback.errors import FeedbackError, one_line

# An unexpected failure prints one line; with this set to 1 the command raises it, traceback and all.
TRACEBACK_ENV = "FEEDBACK_TRACEBACK"


def _param(text: str) -> tuple[str, str]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"--param expects KEY=VALUE, got {text!r}")
    key, value = text.split("=", 1)
    return key.strip(), value.strip()


def _given(args, *names: str, **renamed: str) -> dict:
    """The config fields whose flags were given: each of `names` is a field and its flag's
    attribute; `renamed` maps a field to its attribute. Flags left out are absent, so the config
    keeps its own default, declared once beside it (the flags default to None)."""
    attrs = {**{name: name for name in names}, **renamed}
    return {name: getattr(args, attr) for name, attr in attrs.items() if getattr(args, attr) is not None}


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one line and exit 2 (no usage dump)."""

    def error(self, message: str):
        self.exit(2, f"error: {message}\n")


def _max_memory(text: str) -> dict:
    """`0=20GiB,1=20GiB,cpu=64GiB` -> {0: "20GiB", 1: "20GiB", "cpu": "64GiB"} (accelerate's max_memory)."""
    out: dict = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        device, sep, amount = item.partition("=")
        device, amount = device.strip(), amount.strip()
        if not sep or not amount or not (device.isdigit() or device in ("cpu", "disk", "mps")):
            raise argparse.ArgumentTypeError(f"--max-memory expects DEVICE=AMOUNT,... (e.g. 0=20GiB,cpu=64GiB), "
                                             f"got {item!r}")
        out[int(device) if device.isdigit() else device] = amount
    return out


def _add_model_args(p) -> None:
    p.add_argument("--model", default=None, help="embedded (default) | hub id | local folder | file.gguf")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--fast-matmul", action="store_true",
                   help="fast, not bit-exact: bf16 matmuls on fp32 weights (CPU, oneDNN); results say so")
    g = p.add_argument_group("large models")
    g.add_argument("--device-map", default=None, help="e.g. auto: spread layers over GPUs, then CPU (accelerate)")
    g.add_argument("--max-memory", type=_max_memory, default=None, metavar="DEV=AMOUNT,...",
                   help="memory cap per device for --device-map, e.g. 0=20GiB,1=20GiB,cpu=64GiB")
    quant = g.add_mutually_exclusive_group()
    quant.add_argument("--load-in-4bit", action="store_true", help="bitsandbytes NF4 weights (CUDA only)")
    quant.add_argument("--load-in-8bit", action="store_true", help="int8 weights: bitsandbytes on CUDA; on CPU the "
                       "decoder's layers as int8 weights (per-channel scales, bf16 activations), not bit-exact")
    g.add_argument("--trust-remote-code", action="store_true", help="run the model repository's own code")


def _load(args, device: str = "auto", model: str | None = None, dtype: str | None = None):
    """The one model loader, with every model flag of the command line. `model`/`dtype`: a saved
    run's, used unless --model / --dtype were given."""
    from feedback.core.model import load_model

    if args.max_memory and not args.device_map:
        raise FeedbackError("--max-memory needs --device-map (e.g. --device-map auto)")
    dtype = args.dtype if args.dtype != "auto" or not dtype else dtype
    return load_model(args.model or model or "embedded", dtype=dtype, device=device, device_map=args.device_map,
                      max_memory=args.max_memory, load_in_4bit=args.load_in_4bit, load_in_8bit=args.load_in_8bit,
                      trust_remote_code=args.trust_remote_code, fast_matmul=args.fast_matmul or None)


def _add_strategy_args(p, default: str | None, required: bool = False) -> None:
    p.add_argument("--strategy", default=default, required=required,
                   help="feedback strategy, or several joined by '+' applied in that order (a stack: "
                        "inner_loop+deep_cache)" + (f" (default {default})" if default else ""))
    p.add_argument("--param", action="append", type=_param, default=[], metavar="KEY=VALUE",
                   help="a strategy parameter; a stack's are named STRATEGY.PARAM (deep_cache.lam=0.05)")


def _json_result(args, res: dict, indent: int | None = 1, printed_indent: int | None = None) -> bool:
    """A command's whole result as JSON: written to --out when given, printed with --json (True: then
    it is all the command prints)."""
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=indent))
    if args.json:
        print(json.dumps(res, indent=printed_indent))
    return bool(args.json)


def _add_trace_args(p) -> None:
    """Sampled traces with DeepConf's confidence (Deep Think and calibration): numbers default to None,
    so a flag left out keeps the command's config default."""
    p.add_argument("--window", type=int, help="DeepConf group window (tokens)")
    p.add_argument("--k", type=int, help="DeepConf top-k for token confidence")
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--answer-regex", default=None, help="regex for the answer (first group, else the match)")


def _named(text: str) -> tuple[str, str]:
    """NAME=TEXT (the text may itself hold '=')."""
    name, sep, value = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"expects NAME=TEXT, got {text!r}")
    return name.strip(), value


def _row(text: str) -> tuple[str, str | None, dict]:
    """NAME[:STRATEGY][,KEY=VALUE...] -> (name, strategy or None, params)."""
    head, *pairs = text.split(",")
    name, _, strategy = head.partition(":")
    if not name.strip():
        raise argparse.ArgumentTypeError(f"--row expects NAME[:STRATEGY][,KEY=VALUE...], got {text!r}")
    return name.strip(), strategy.strip() or None, dict(_param(p) for p in pairs if p.strip())


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="baseline vs feedback (or any rows, each with its own prompt) on one prompt; "
                       "the next turn of a saved run (--continue), or a branch of it (--branch)")
    p.add_argument("--prompt", default=None, help="the prompt (every row's, unless --row-prompt gives it its own)")
    _add_model_args(p)
    _add_strategy_args(p, "residual")
    g = p.add_argument_group("rows (default: baseline, and feedback with --strategy/--param)")
    g.add_argument("--row", action="append", type=_row, default=[], metavar="NAME[:STRATEGY][,K=V...]",
                   help="a row; repeat for more (no STRATEGY: a plain baseline row)")
    g.add_argument("--row-prompt", action="append", type=_named, default=[], metavar="NAME=TEXT",
                   help="this row's own prompt (a prompt variant)")
    g.add_argument("--row-system", action="append", type=_named, default=[], metavar="NAME=TEXT",
                   help="this row's own system prompt")
    # Numbers default to None: a flag left out keeps the config's own default (see `_given`).
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
    q = p.add_argument_group("quality metrics (length, distinct-n and repetition are always reported)")
    q.add_argument("--quality", action="store_true", help="also self-perplexity and prompt perplexity per row")
    q.add_argument("--reference", default=None, help="a reference answer: its perplexity after each row's prompt")
    q.add_argument("--key-fact", action="append", default=[], metavar="TEXT|/REGEX/",
                   help="a fact each answer should contain; repeat; recall is reported per row")
    f = p.add_argument_group("follow-ups of a saved run (RUN.json from --json or --out; its settings carry over)")
    follow = f.add_mutually_exclusive_group()
    follow.add_argument("--continue", dest="continue_from", default=None, metavar="RUN.json",
                        help="the next turn: every row answers --say after its own conversation")
    follow.add_argument("--branch", dest="branch_from", default=None, metavar="RUN.json",
                        help="replay --row up to --step, force --token there, decode on")
    f.add_argument("--say", default=None, help="the next user message (with --continue)")
    f.add_argument("--step", type=int, default=None, help="the step to branch at (with --branch)")
    f.add_argument("--token", default=None, help="the token forced at --step: a token id, or text (its tokens)")
    f.add_argument("--only-row", action="store_true",
                   help="branch only --row; the other rows decode afresh (default: every row goes on from "
                        "--row's text and the forced token)")
    f.add_argument("--matching-only", action="store_true",
                   help="branch only the rows whose answer matched --row's up to --step; the others are "
                        "replayed as they were")
    p.add_argument("--out", default=None, help="also write the RunResult JSON to this file")
    p.add_argument("--json", action="store_true", help="print one RunResult JSON object")


def _rows(args) -> list:
    """The rows the flags describe, each with its own prompt and system prompt where given."""
    from feedback.core.records import RowSpec, default_rows

    rows = ([RowSpec(name, strategy, params) for name, strategy, params in args.row] if args.row
            else default_rows(args.strategy, dict(args.param)))
    by_name = {r.name: r for r in rows}
    for flag, field, pairs in (("--row-prompt", "prompt", args.row_prompt), ("--row-system", "system_prompt",
                                                                           args.row_system)):
        for name, text in pairs:
            if name not in by_name:
                raise FeedbackError(f"{flag} {name}: no such row (rows: {', '.join(by_name)})")
            setattr(by_name[name], field, text)
    return rows


def _generate(args) -> int:
    from feedback.core.records import DeepConfConfig, RunConfig
    from feedback.core.sampling import SamplingConfig
    from feedback.strategies import get_strategy

    if args.continue_from or args.branch_from:
        return _follow_up(args)
    if args.say is not None or args.step is not None or args.token is not None or args.only_row or \
            args.matching_only:
        raise FeedbackError("--say goes with --continue; --step, --token, --only-row and --matching-only go with "
                            "--branch")
    if args.row and args.param:
        raise FeedbackError("--param sets the default feedback row; with --row give parameters as NAME:STRATEGY,K=V")
    for _, strategy, _ in args.row or [(None, args.strategy, None)]:
        if strategy:
            get_strategy(strategy)  # unknown names fail before the model loads
    config = RunConfig(
        prompt=args.prompt or "", model=args.model or "embedded", dtype=args.dtype,
        chat_template=not args.no_chat_template, system_prompt=args.system, **_given(args, "max_new_tokens", "seed"),
        sampling=SamplingConfig(**_given(args, "temperature", "top_k", "top_p", "min_p", "repetition_penalty")),
        deepconf=DeepConfConfig(**_given(args, "k", "window"), threshold=args.threshold), rows=_rows(args),
        reference=args.reference, key_facts=list(args.key_fact), quality=args.quality,
    ).validate()
    return _run_and_report(args, _load(args), config)


def _follow_up(args) -> int:
    """--continue / --branch: a saved run's next turn or branch, on the model it ran on (unless
    --model/--dtype say otherwise), with its settings; --quality, --reference and --key-fact add to them."""
    from dataclasses import replace

    from feedback.core.session import branch, continue_run

    fresh = [flag for flag, given in (("--prompt", args.prompt), ("--row-prompt", args.row_prompt),
                                      ("--row-system", args.row_system), ("--system", args.system),
                                      ("--param", args.param)) if given]
    if fresh:
        raise FeedbackError(f"{fresh[0]} belongs to a new run; a follow-up takes the saved run's prompts and rows")
    saved = _read_run(args.continue_from or args.branch_from)
    if args.continue_from:
        if args.say is None or args.row or args.step is not None or args.token is not None or args.only_row or \
                args.matching_only:
            raise FeedbackError('--continue takes --say "the next message" (and no --row, --step, --token)')
        lm = _checked(args, saved, args.continue_from)
        config = continue_run(saved, args.say)
    else:
        if len(args.row) != 1 or args.row[0][1] or args.row[0][2] or args.step is None or args.token is None:
            raise FeedbackError("--branch needs --row NAME, --step N and --token TEXT|ID")
        lm = _checked(args, saved, args.branch_from)
        config = branch(saved, args.row[0][0], args.step, _token_ids(lm, args.token), all_rows=not args.only_row,
                        matching_only=args.matching_only)
    extra = {"quality": config.quality or args.quality}
    if args.reference is not None:
        extra["reference"] = args.reference
    if args.key_fact:
        extra["key_facts"] = list(args.key_fact)
    return _run_and_report(args, lm, replace(config, **extra).validate())


def _read_run(path: str):
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
        raise FeedbackError(f"{path} is not a saved run (a RunResult from --json or --out): {exc!r}") from None


def _checked(args, saved, path: str):
    """The model a saved run goes on with (its own, unless --model/--dtype say otherwise), the run
    checked against it as every door checks a saved run: the library's limits here, as for a new
    run from the command line, and each row's answer against this model's vocabulary."""
    from feedback.serve.limits import check_saved_run

    lm = _load(args, model=saved.config.get("model"), dtype=saved.config.get("dtype"))
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
    from feedback.core.engine import run_to_end, start_run

    if args.json:
        result = run_to_end(lm, config)
    else:
        run = start_run(lm, config)
        print(f"model {lm.name} ({lm.dtype}, {lm.device}), prompt {len(run.prompt_ids)} tokens", file=sys.stderr)
        for _ in run:
            pass
        result = run.result
    if args.out:
        Path(args.out).write_text(result.to_json())
    if args.json:
        print(result.to_json())
    else:
        _print_result(result)
    return 0


def _print_result(result) -> None:
    width = 100
    for row in result.rows:
        label = row.name if not row.strategy else f"{row.name} [{row.strategy} " + ", ".join(
            f"{k}={v}" for k, v in row.params.items()) + "]"
        m = row.metrics
        forced = sum(s.forced for s in row.steps)
        print(f"=== {label} ===")
        print(textwrap.fill(row.text.strip(), width, replace_whitespace=False) if row.text.strip() else "(empty)")
        lowest = m.get("lowest_group")
        print(f"--- {len(row.token_ids)} tokens{f' ({forced} forced)' if forced else ''}, {row.tokens_per_s:.1f} tok/s, "
              f"mean confidence {(m.get('mean') or 0):.2f}, lowest group {lowest if lowest is None else round(lowest, 2)}, "
              f"stop: {row.stop_reason} at step {row.stop_step}")
        print("--- " + _quality_line(m) + "\n")
    if result.first_divergence_step is not None:
        print(f"first divergence of {result.rows[0].name} and {result.rows[1].name} at step "
              f"{result.first_divergence_step}")
    elif len(result.rows) > 1:
        print(f"{result.rows[0].name} and {result.rows[1].name} produced identical tokens")


def _quality_line(m: dict) -> str:
    def num(key: str, spec: str) -> str:
        return "n/a" if m.get(key) is None else format(m[key], spec)

    parts = [f"distinct-1 {num('distinct_1', '.2f')}", f"distinct-2 {num('distinct_2', '.2f')}",
             f"repeated 3-grams {num('repeat_3gram_rate', '.0%')}", f"longest repeat {m.get('longest_repeat', 0)}"]
    for key, label in (("self_ppl", "self PPL"), ("prompt_ppl", "prompt PPL"), ("reference_ppl", "reference PPL")):
        if key in m:
            parts.append(f"{label} {num(key, '.2f')}")
    if "key_fact_recall" in m:
        unjudged = m.get("key_facts_unjudged") or []
        late = f"; not judged, out of time: {', '.join(unjudged)}" if unjudged else ""
        parts.append(f"key-fact recall {num('key_fact_recall', '.0%')} "
                     f"({', '.join(m['key_facts_found']) or 'none found'}{late})")
    return ", ".join(parts)


def _ppl_config(args, params: dict | None = None):
    from feedback.eval.perplexity import TOKENS_PER_DOC, PPLConfig

    if args.max_tokens is not None:  # refused before the model loads, as the config would refuse it after
        TOKENS_PER_DOC.check(args.max_tokens)
    return PPLConfig(strategy=args.strategy, params=dict(args.param) if params is None else params, mode=args.mode,
                     **_given(args, "passes", "window", "stride", "chunk", "max_docs", "bootstrap", "seed",
                              max_tokens_per_doc="max_tokens"))


def _progress(done: int, total: int, name: str) -> None:
    print(f"\r  [{done}/{total}] {name[:40]:40}", end="" if done < total else "\n", file=sys.stderr, flush=True)


def _ppl(args) -> int:
    from feedback.eval import corpus
    from feedback.eval.perplexity import evaluate

    warn = lambda msg: print(f"warning: {msg}", file=sys.stderr)  # noqa: E731
    docs = corpus.load(args.data, warn)
    cfg = _ppl_config(args)
    if args.strategy:
        from feedback.strategies import get_strategy

        get_strategy(args.strategy)
    cfg.resolved_mode()
    lm = _load(args)
    result = evaluate(lm, docs, cfg, progress=None if args.json else _progress)
    result["data"] = args.data
    if _json_result(args, result, indent=2, printed_indent=2):
        return 0
    print(f"{result['documents']} documents, {result['tokens']} tokens, mode {result['mode']}"
          f"{' (approximate, %d passes)' % result['passes'] if result['approximate'] else ''}, "
          f"{result['wall_seconds']:.1f} s")
    print(f"baseline PPL  {result['baseline_ppl']:.3f}")
    if "feedback_ppl" in result:
        lo, hi = result["ci95"]
        print(f"feedback PPL  {result['feedback_ppl']:.3f}   ({args.strategy} "
              + ", ".join(f"{k}={v}" for k, v in result["config"]["params"].items()) + ")")
        print(f"ΔPPL          {result['delta_pct']:+.3f} %   95% CI [{lo:+.3f}, {hi:+.3f}] % "
              f"(paired bootstrap over {result['ci_method']})")
    return 0


def _sweep(args) -> int:
    from feedback.eval import corpus
    from feedback.eval.sweep import best_point, parse_grid, run_sweep, to_csv
    from feedback.strategies import build_strategy

    warn = lambda msg: print(f"warning: {msg}", file=sys.stderr)  # noqa: E731
    docs = corpus.load(args.data, warn)
    fixed = dict(args.param)
    cfg = _ppl_config(args, fixed)
    cfg.resolved_mode()
    lm = _load(args)
    grid = parse_grid(args.grid, args.strategy, lm.num_layers)
    build_strategy(args.strategy, fixed, lm.num_layers)
    names = list(grid)

    def report(row: dict, done: int, total: int) -> None:
        point = ", ".join(f"{k}={row[k]}" for k in names)
        print(f"[{done}/{total}] {point}: ΔPPL {row['delta_pct']:+.3f}% "
              f"[{row['ci95_low']:+.3f}, {row['ci95_high']:+.3f}] ({row['wall_seconds']:.1f} s)",
              file=sys.stderr, flush=True)

    rows = run_sweep(lm, docs, args.strategy, grid, cfg, fixed, report)
    out = Path(args.out_dir or f"sweep-{args.strategy}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.csv").write_text(to_csv(rows, names))
    if len(names) <= 2:
        from feedback.eval.figures import sweep_heatmap

        fig = sweep_heatmap(rows, names[0], names[1] if len(names) == 2 else None,
                            f"{args.strategy} on {args.data}: ΔPPL % vs baseline ({rows[0]['mode']})")
        fig.write_html(out / "sweep.html", include_plotlyjs=True)
    else:
        print("note: a heatmap needs one or two grid parameters; wrote the CSV only", file=sys.stderr)
    print(f"wrote {out / 'sweep.csv'}" + (f" and {out / 'sweep.html'}" if len(names) <= 2 else ""))
    print(_sweep_best_line(best_point(rows, args.strategy, fixed), names))
    if args.json:
        print(json.dumps(rows))
    return 0


def _sweep_best_line(best: dict | None, names: list[str]) -> str:
    """The sweep's last line: "best: ..." only for a point that beats the baseline, with the verdict
    on it (`feedback.eval.verdict`); else "best: none", why, and the lowest point."""
    from feedback.eval.verdict import ci_text, not_recommended, verdict

    if best is None:
        return "best: none (every point has strength 0, i.e. measures the baseline again)"
    judged = verdict(best["delta_pct"], [best["ci95_low"], best["ci95_high"]])
    point = (", ".join(f"{k}={best[k]}" for k in names) + f" ΔPPL {best['delta_pct']:+.3f}% "
             f"{ci_text(best['ci95_low'], best['ci95_high'])} ({judged.text}; points with strength 0 left out)")
    why = not_recommended(judged)
    return f"best: {point}" if why is None else f"best: none ({why}); the lowest ΔPPL: {point}"


def _tune_best_lines(best: dict, test: dict | None) -> list[str]:
    """The tune's summary: the best dev trial (or, when none beats the baseline, the lowest) and its
    test score, each with its verdict (`feedback.eval.verdict`), then whether it is a recommendation."""
    from feedback.eval.figures import format_params
    from feedback.eval.verdict import ci_text, not_recommended, verdict

    dev_ci = best["ci95"] or [None, None]
    dev = verdict(best["delta_pct"], dev_ci)
    line = (f"{'best on dev' if dev.beats_baseline else 'lowest dev ΔPPL'}: trial {best['trial']} "
            f"({format_params(best['params'])}): dev ΔPPL {best['delta_pct']:+.3f} % {ci_text(*dev_ci)} ({dev.text})")
    on_test = None
    if test is None:
        line += "; no test evaluation (give --test DATA)"
    else:
        on_test = verdict(test["delta_pct"], test["ci95"])
        line += (f"; test ({test['data']}, {test['documents']} documents) ΔPPL {test['delta_pct']:+.3f} %   95% CI "
                 f"{ci_text(*test['ci95'])} % (paired bootstrap over {test['ci_method']}; {on_test.text})")
    why = not_recommended(dev, on_test, noun="trial")
    verdict_line = (f"recommendation: trial {best['trial']} ({format_params(best['params'])})" if why is None else
                    f"recommendation: none ({why})")
    return [line, verdict_line]


def _tune(args) -> int:
    from feedback.eval import corpus
    from feedback.eval.figures import table_row
    from feedback.eval.tune import (BEST_FILE, HTML_FILE, TRIALS_FILE, TuneSettings, check_budget, run_tune,
                                    searched_names)

    check_budget(args.trials, args.timeout)
    fixed = dict(args.param)
    searched_names(args.strategy, fixed)  # unknown strategy or parameter, nothing left to tune: before the model loads
    warn = lambda msg: print(f"warning: {msg}", file=sys.stderr)  # noqa: E731
    docs = corpus.load(args.data, warn)
    test = args.test if args.test is not None else ("builtin:test" if args.data == "builtin:dev" else "none")
    if test == args.data:
        raise FeedbackError(f"--test {test} is the tuning data: the best point must be confirmed on held-out text")
    test_docs = corpus.load(test, warn) if test != "none" else None
    cfg = _ppl_config(args, {})
    cfg.resolved_mode()
    lm = _load(args)
    out = Path(args.out_dir or f"tune-{args.strategy}")

    def report(row: dict) -> None:
        trial, params, delta, state = table_row(row)
        ci = f" [{row['ci95'][0]:+.3f}, {row['ci95'][1]:+.3f}]" if row.get("ci95") and None not in row["ci95"] else ""
        print(f"[trial {trial}] {params}: ΔPPL {delta}{ci} {state} ({row['seconds']:.1f} s)", file=sys.stderr,
              flush=True)

    settings = TuneSettings(trials=args.trials, timeout=args.timeout, seed=cfg.seed, out_dir=out, data=args.data,
                            test=test if test_docs else "")
    res = run_tune(lm, docs, args.strategy, cfg, fixed, settings, test_docs=test_docs, on_trial=report)
    if args.json:
        print(json.dumps(res))
        return 0
    rows = [[str(c) for c in table_row(r)] for r in res["trials"]]
    head = ["trial", "params", "ΔPPL % dev", "state"]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    for line in [head, *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip())
    print(f"wrote {out / TRIALS_FILE}, {out / BEST_FILE} and {out / HTML_FILE}")
    if res["best"] is None:
        print("best: none (no trial completed with the strategy switched on)")
        return 0
    print("\n".join(_tune_best_lines(res["best"], res["test"])))
    return 0


def _qa(args) -> int:
    from feedback.core.records import MAX_NEW_TOKENS_CAP, RowSpec
    from feedback.eval.deepthink import load_questions
    from feedback.eval.qa import BUILTIN_QUESTIONS, evaluate_qa
    from feedback.strategies import build_strategy

    rows = [RowSpec(name, strategy, params) for name, strategy, params in args.row] or [
        RowSpec("baseline"), RowSpec("restate", "restate")]
    if len({r.name for r in rows}) != len(rows):
        raise FeedbackError("row names must differ")
    if args.max_new_tokens is not None and not 1 <= args.max_new_tokens <= MAX_NEW_TOKENS_CAP:
        raise FeedbackError(f"--max-new-tokens must be in [1, {MAX_NEW_TOKENS_CAP}], got {args.max_new_tokens}")
    for r in rows:
        if r.strategy:
            build_strategy(r.strategy, r.params, 10_000)  # names and values, before the model loads
    questions = load_questions(args.questions or BUILTIN_QUESTIONS)
    lm = _load(args)
    progress = lambda i, n: print(f"[{i}/{n}]", file=sys.stderr, flush=True)  # noqa: E731
    res = evaluate_qa(lm, questions, rows, **_given(args, "max_new_tokens"), progress=None if args.json else progress)
    if _json_result(args, res):
        return 0
    print(f"{res['questions']} questions, greedy, {res['max_new_tokens']} new tokens at most")
    for name, s in res["rows"].items():
        ppl = "n/a" if s["gold_ppl"] is None else f"{s['gold_ppl']:.2f}"
        print(f"  {name:14} accuracy {s['accuracy']:6.1%} ({s['right']}/{res['questions']})  gold-answer PPL {ppl:>8}"
              f"  mean tokens {s['mean_tokens']:.1f}")
    return 0


def _recall_rows(args) -> list:
    """The baseline, then --strategy (a row named after it) and each --row (each with a strategy)."""
    from feedback.core.records import RowSpec
    from feedback.strategies import build_strategy

    if args.param and not args.strategy:
        raise FeedbackError("--param goes with --strategy (with --row give parameters as NAME:STRATEGY,K=V)")
    rows = [RowSpec("baseline")] + ([RowSpec(args.strategy, args.strategy, dict(args.param))] if args.strategy else [])
    for name, strategy, params in args.row:
        if not strategy:
            raise FeedbackError(f"--row {name}: give it a strategy (NAME:STRATEGY); the baseline row is always there")
        rows.append(RowSpec(name, strategy, params))
    names = [r.name for r in rows]
    if len(set(names)) != len(names):
        raise FeedbackError(f"row names must differ, got {', '.join(names)}")
    for r in rows[1:]:
        try:
            build_strategy(r.strategy, r.params, 10_000)  # names and values, before the model loads
        except FeedbackError as exc:
            raise FeedbackError(f"row {r.name}: {exc}") from None
    return rows


def _recall(args) -> int:
    from feedback.core.budget import Budget
    from feedback.eval.recall import RecallConfig, check_budget, evaluate_recall, plan, report_lines

    rows = _recall_rows(args)
    cfg = RecallConfig(**_given(args, "items", "lengths", "depths", "seed", "max_new_tokens", "split",
                                "bootstrap")).validate()  # refused before the model loads
    lm = _load(args)
    instances = plan(lm, cfg)  # a length beyond the model's context is refused here, before any run
    budget = Budget.from_env(served=False)
    check_budget(budget, instances, rows, cfg.max_new_tokens, items_name="--items")

    def progress(rec: dict) -> None:
        marks = " ".join(f"{name} {'right' if r['right'] else 'wrong'}" for name, r in rec["rows"].items())
        print(f"[{rec['done']}/{rec['total']}] length {rec['length']}, depth {rec['depth']:g}%, item {rec['item']} "
              f"({rec['kind']}): {marks}", file=sys.stderr, flush=True)

    res = evaluate_recall(lm, cfg, rows, instances=instances, on_instance=None if args.json else progress,
                          budget=budget)
    if args.html:
        from feedback.eval.recall_figures import write_html

        write_html(Path(args.html), res)
    if _json_result(args, res):
        return 0
    print("\n".join(report_lines(res)))
    return 0


def _deepthink_config(args, prompt: str):
    from feedback.eval.deepthink import DeepThinkConfig

    return DeepThinkConfig(prompt=prompt, **_given(args, "traces", "warmup", "eta", "window", "k", "max_new_tokens",
                                                   "temperature", "top_p", "seed"),
                           strategy=args.strategy, params=dict(args.param),
                           answer_regex=args.answer_regex, shared_threshold=args.shared_threshold,
                           check=args.check, chat_template=not args.no_chat_template,
                           expected=getattr(args, "expected", None))


def _deepthink(args) -> int:
    from feedback.eval.deepthink import accuracy, deep_think, load_questions
    from feedback.strategies import get_strategy

    if (args.prompt is None) == (args.questions is None):
        raise FeedbackError("give either --prompt TEXT or --questions FILE.jsonl")
    if args.expected is not None and args.questions is not None:
        raise FeedbackError("--expected goes with --prompt; a question file has an answer per question")
    get_strategy(args.strategy)
    questions = load_questions(args.questions) if args.questions else None
    lm = _load(args)
    if questions is not None:
        base = _deepthink_config(args, "")
        for warning in base.validate(lm.num_layers):
            print(f"warning: {warning}", file=sys.stderr)
        res = accuracy(lm, questions, base, progress=None if args.json else _progress)
        if args.json:
            print(json.dumps(res))
            return 0
        print(f"{res['questions']} questions, {base.traces} traces + {base.warmup} warm-up per side, eta {base.eta}%")
        print(f"{'side':10} {'single':>7} {'majority':>9} {'deepconf':>9} {'tokens':>9} {'saved':>8}")
        for side, a in res["accuracy"].items():
            print(f"{side:10} {a['single']:7.1%} {a['majority']:9.1%} {a['deepconf']:9.1%} {a['tokens_spent']:9d} "
                  f"{a['tokens_saved']:8d}")
        return 0
    cfg = _deepthink_config(args, args.prompt)
    for warning in cfg.validate(lm.num_layers):
        print(f"warning: {warning}", file=sys.stderr)
    rep = deep_think(lm, cfg)
    if args.json:
        print(json.dumps(rep))
        return 0
    def mark(correct) -> str:
        return "" if correct is None else " (correct)" if correct else " (wrong)"

    for side, s in rep["sides"].items():
        votes = s["votes"]
        print(f"=== {side} === threshold {s['threshold']:.3f}, {s['stopped']} of {cfg.traces} online traces stopped")
        print(f"answer: {s['answer']!r}{mark(s['correct'])} (share {s['share']:.0%}; majority "
              f"{votes['majority']['answer']!r}{mark(votes['majority']['correct'])}, tail-weighted "
              f"{votes['tail']['answer']!r}{mark(votes['tail']['correct'])})")
        print(f"tokens spent {s['tokens_spent']}, saved {s['tokens_saved']} ({s['tokens_saved_method']})")
        for t in s["traces"]:
            flag = ("stopped" if t["stopped"] else "filtered" if t["excluded"] else
                    "voted" if t["answer"] is not None else "no answer")
            low = t["lowest_group"]
            print(f"  {t['phase']:6} {t['name']:14} {flag:9} {t['tokens']:4d} tok  lowest {low if low is None else round(low, 2)!s:>6}"
                  f"  answer {t['answer']!r}{mark(t['correct'])}")
    print(f"{rep['wall_seconds']:.1f} s")
    return 0


def _calibration_config(args):
    from feedback.eval.calibration import CalibrationConfig

    return CalibrationConfig(strategy=args.strategy, params=dict(args.param),
                             **_given(args, "samples", "max_new_tokens", "temperature", "top_p", "seed", "window", "k",
                                      "bins", etas="eta"),
                             answer_regex=args.answer_regex, chat_template=not args.no_chat_template)


def _num(value, fmt: str) -> str:
    """`value` in `fmt`, or a dash as wide as the format's width when there is no number."""
    width = int("".join(c for c in fmt.split(".")[0] if c.isdigit()) or 0)
    return "—".rjust(width) if value is None else format(value, fmt)


def _interval(pair, too_few: str | None) -> str:
    """A 95% CI column: "[0.61, 0.93]", "too few" where the traces cannot judge the measure, or a dash."""
    if too_few:
        return "too few"
    return "—" if pair is None else f"[{pair[0]:.2f}, {pair[1]:.2f}]"


def _calibrate(args) -> int:
    from feedback.eval.calibration import (ECE_RESAMPLES, ECE_SEED, MIN_JUDGED_TRACES, MIN_PER_CLASS, calibrate,
                                           check_questions, read_questions, side_too_few)

    cfg = _calibration_config(args)
    cfg.validate(10_000)  # every value (strategy names and parameters too) before the model loads
    questions = check_questions(read_questions(args.questions))
    lm = _load(args)
    res = calibrate(lm, questions, cfg, progress=None if args.json else _progress)
    for warning in res["warnings"]:
        print(f"warning: {warning}", file=sys.stderr)
    if _json_result(args, res):
        return 0
    split = res["split"]
    print(f"{res['questions']} questions (dev {split['dev']}, test {split['test']}: even / odd positions), "
          f"{cfg.samples} samples per question per row, temperature {cfg.temperature:g}, top-p {cfg.top_p:g}, "
          f"<= {cfg.max_new_tokens} new tokens, window {cfg.window}, seed {cfg.seed}")
    print("Platt scaling fitted on dev; every number below on test")
    head = f"{'row':9} {'measure':15} {'traces':>6} {'acc':>6} {'AUROC':>6} {'95% CI':>12} {'ECE':>6} {'95% CI':>12} " \
           f"{'aECE':>6} {'Brier':>6} {'base':>6} {'rawECE*':>7}"
    print(head)
    for side, rep in res["sides"].items():
        for name, m in rep["measures"].items():
            t = m["test"]
            print(f"{side:9} {name:15} {t['traces']:6d} {_num(t['accuracy'], '6.1%')} {_num(t['auroc'], '6.3f')} "
                  f"{_interval(t['auroc_ci95'], t['too_few']):>12} {_num(t['ece'], '6.3f')} "
                  f"{_interval(t['ece_ci95'], t['too_few']):>12} {_num(t['adaptive_ece'], '6.3f')} "
                  f"{_num(t['brier'], '6.3f')} {_num(t['brier_base_rate'], '6.3f')} "
                  f"{_num(t['uncalibrated_minmax_ece'], '7.3f')}")
    print("aECE: equal-mass bins; base: Brier of predicting the dev accuracy for every trace; *rawECE: the raw "
          "measure min-max scaled over dev, uncalibrated (not a probability)")
    print(f"95% CI: the AUROC's a score interval on Hanley & McNeil's variance, the ECE's a bootstrap of the test "
          f"traces ({ECE_RESAMPLES} resamples, seed {ECE_SEED}); too few: fewer than {MIN_JUDGED_TRACES} test traces, "
          f"or fewer than {MIN_PER_CLASS} right or {MIN_PER_CLASS} wrong ones, which cannot judge a measure")
    for side, rep in res["sides"].items():
        reason = side_too_few(rep)
        if reason:
            print(f"  {side}: {reason}; its AUROC and ECE are no evidence either way")
    print("early-stop threshold on lowest group confidence (voting.calibrate_threshold over the dev traces):")
    for side, rep in res["sides"].items():
        for th in rep["thresholds"]:
            if th["threshold"] is None:
                print(f"  {side:9} eta {th['eta']:g}%: no dev trace with a confidence")
                continue
            dev, test, per_q = th["dev"], th["test"], th["per_question_dev"]
            print(f"  {side:9} eta {th['eta']:g}%: s = {th['threshold']:.3f} keeps {_num(dev['kept_share'], '.0%')} "
                  f"of dev traces, accuracy {_num(dev['accuracy_kept'], '.1%')} vs {_num(dev['accuracy_all'], '.1%')} "
                  f"all; test: keeps {_num(test['kept_share'], '.0%')}, {_num(test['accuracy_kept'], '.1%')} vs "
                  f"{_num(test['accuracy_all'], '.1%')}; a threshold per dev question (as Deep Think): "
                  f"{_num(per_q and per_q['accuracy_kept'], '.1%')} vs {_num(per_q and per_q['accuracy_all'], '.1%')}")
    print(f"{res['wall_seconds']:.1f} s")
    return 0


def _lmeval(args) -> int:
    """lm-eval tasks for the baseline and a strategy on the same documents, paired (feedback/eval/lmeval.py)."""
    try:
        from feedback.eval.lmeval import format_table, run_pair
    except ImportError as exc:
        raise FeedbackError(f"lmeval needs lm-evaluation-harness: pip install lm-eval==0.4.13 ({exc})") from None
    from feedback.eval.perplexity import BOOTSTRAP, PPLConfig
    from feedback.strategies import PromptStrategy, build_strategy, get_strategy

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise FeedbackError("--tasks needs at least one task name")
    if args.limit is not None and args.limit <= 0:
        raise FeedbackError(f"--limit must be positive, got {args.limit:g}")
    if args.bootstrap is not None:
        BOOTSTRAP.check(args.bootstrap)
    build_strategy(args.strategy, dict(args.param), 10_000)  # names and values, before the model loads
    if not issubclass(get_strategy(args.strategy), PromptStrategy):  # a prompt-level one only generates
        PPLConfig(args.strategy, dict(args.param), args.mode, **_given(args, "passes")).resolved_mode()
    if args.include_path and not Path(args.include_path).is_dir():
        raise FeedbackError(f"--include-path {args.include_path}: no such folder")
    lm = _load(args)
    limit = int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit
    res = run_pair(lm, tasks, args.strategy, dict(args.param), include_path=args.include_path, limit=limit,
                   log=None if args.json else lambda msg: print(msg, file=sys.stderr, flush=True),
                   **_given(args, "mode", "passes", "max_length", "window", "stride", "num_fewshot", "batch_size",
                            "max_gen_toks", "bootstrap", "seed"))
    if _json_result(args, res, printed_indent=1):
        return 0
    side = res["feedback_side"]
    print(f"{lm.name}: baseline vs {side['strategy']} (" + ", ".join(f"{k}={v}" for k, v in side["params"].items())
          + f"), mode {side['mode']}" + (f" ({side['passes']} passes)" if side["passes"] else "")
          + f", {res['wall_seconds']:.1f} s")
    print(format_table(res["comparison"]))
    return 0


def _launcher_shard() -> tuple[int, int, str]:
    """(rank, processes, device) under accelerate launch, torchrun or MPI; (0, 1, "auto") when run plainly."""
    if not any(os.environ.get(k) for k in ("WORLD_SIZE", "LOCAL_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE",
                                           "MV2_COMM_WORLD_SIZE", "ACCELERATE_USE_CPU")):
        return 0, 1, "auto"
    import torch
    from accelerate import PartialState

    cpu = not torch.cuda.is_available() or os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true")
    state = PartialState(cpu=cpu)
    return state.process_index, state.num_processes, str(state.device)


def _batch(args) -> int:
    from feedback.serve.batch import run_batch, summary_line

    rank, world, device = _launcher_shard()
    tag = f"[rank {rank}/{world}] " if world > 1 else ""
    if world > 1 and args.device_map:
        print(f"warning: {tag}--device-map with {world} processes: every rank spreads its own copy of the model "
              "over all devices; for a model that needs several GPUs run one process", file=sys.stderr)
    lm = _load(args, device=device if args.device_map is None else "auto")

    def progress(done: int, total: int, elapsed: float) -> None:
        rate = done / elapsed if elapsed > 0 else 0.0
        eta = (total - done) / rate if rate > 0 else float("nan")
        end = "\n" if world > 1 or done == total else ""  # ranks share stderr: whole lines only
        print(f"\r  {tag}[{done}/{total}] {rate:.2f} tasks/s, ETA {eta:.0f} s", end=end, file=sys.stderr, flush=True)

    from feedback.core.budget import Budget

    summary = run_batch(lm, args.input, args.output, **_given(args, "retries"), shard=(rank, world),
                        warn=lambda msg: print(f"warning: {tag}{msg}", file=sys.stderr), progress=progress,
                        lenient=args.lenient, budget=Budget.from_env(served=False))
    print(tag + summary_line(summary))
    if world > 1:
        print(f"{tag}wrote {summary['output']}; once every rank is done: python -m feedback merge {args.output}")
    return 0


def _merge(args) -> int:
    from feedback.serve.batch import merge

    res = merge(args.output)
    if not res["parts"]:
        print(f"no part files: {res['output']} already holds all {res['records']} results")
        return 0
    print(f"merged {res['parts']} part files into {res['output']}: {res['records']} results"
          + (f" ({res['duplicates']} duplicates dropped)" if res["duplicates"] else ""))
    return 0


def _prepare(args) -> int:
    from feedback.core import embedded

    path = embedded.prepare(log=lambda msg: print(msg, file=sys.stderr, flush=True))
    print(path)
    return 0


def _bench(args) -> int:
    from feedback.bench import run_bench

    return run_bench(args)


def _doctor(args) -> int:
    from feedback.doctor import run_doctor

    return run_doctor(args.out, args.model, args.only, args.skip, args.budget_s, args.device)


def _step_names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def _add_ppl_args(p) -> None:
    p.add_argument("--data", default="builtin:dev", help="builtin:dev | builtin:test | file.txt | file.jsonl | folder")
    _add_model_args(p)
    p.add_argument("--mode", default=None, choices=["exact", "parallel", "jacobi"],
                   help="default: parallel for non-recurrent strategies, jacobi for recurrent ones")
    # Numbers default to None: a flag left out keeps PPLConfig's own default (see `_given`).
    p.add_argument("--passes", type=int, help="jacobi passes (the first is clean)")
    p.add_argument("--window", type=int, help="tokens per scoring window")
    p.add_argument("--stride", type=int, help="new tokens scored per window")
    p.add_argument("--chunk", type=int, help="baseline prefill chunk within a window")
    p.add_argument("--max-docs", type=int)
    p.add_argument("--max-tokens", type=int, help="truncate each document to this many tokens")
    p.add_argument("--bootstrap", type=int, help="bootstrap resamples for the 95%% CI")
    p.add_argument("--seed", type=int)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m feedback", description="Feedback Lens: baseline vs activation feedback")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_generate(sub)
    p = sub.add_parser("prepare", help="convert the embedded GGUF model into the cache (once)")
    p = sub.add_parser("ppl", help="teacher-forced perplexity, baseline vs a feedback strategy (omit "
                       "--strategy for the baseline only)")
    _add_ppl_args(p)
    _add_strategy_args(p, None)
    p.add_argument("--out", default=None, help="also write the JSON result to this file")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("sweep", help="ΔPPL over a grid of strategy parameters -> CSV + heatmap HTML")
    _add_ppl_args(p)
    _add_strategy_args(p, None, required=True)
    p.add_argument("--grid", action="append", default=[], metavar="NAME=V1,V2,...")
    p.add_argument("--out-dir", default=None, help="where sweep.csv and sweep.html go (default sweep-STRATEGY)")
    p.add_argument("--json", action="store_true", help="also print the rows as JSON")
    p = sub.add_parser("tune", help="search a strategy's parameters for the lowest dev ΔPPL (Optuna TPE with "
                       "pruning, resumable), then score the best point once on test -> trials.jsonl, best.json, "
                       "tune.html")
    _add_ppl_args(p)
    _add_strategy_args(p, None, required=True)
    p.add_argument("--trials", type=int, default=None, help="total trials, those already logged in --out-dir included")
    p.add_argument("--timeout", type=float, default=None, help="seconds to start new trials in (the last one finishes)")
    p.add_argument("--test", default=None, help="held-out corpus the best point is scored on once (default: "
                   "builtin:test when --data is builtin:dev, else none)")
    p.add_argument("--out-dir", default=None, help="where trials.jsonl, best.json and tune.html go (default "
                   "tune-STRATEGY); rerun with it to resume")
    p.add_argument("--json", action="store_true", help="print the whole result as JSON instead of the table")
    p = sub.add_parser("deepthink", help="DeepConf multi-trace vote per side, with calibrated early stop")
    p.add_argument("--prompt", default=None)
    p.add_argument("--questions", default=None, help="JSONL of {question, answer}: accuracy per side")
    _add_model_args(p)
    _add_strategy_args(p, "residual")
    # Numbers default to None: a flag left out keeps DeepThinkConfig's own default (see `_given`).
    p.add_argument("--traces", type=int, help="online traces per side")
    p.add_argument("--warmup", type=int, help="warm-up traces per side for calibration")
    p.add_argument("--eta", type=float, help="share of traces kept, %% (10: DeepConf-low, 90: high)")
    _add_trace_args(p)
    p.add_argument("--expected", default=None, help="the right answer to --prompt: marks traces and votes")
    p.add_argument("--shared-threshold", action="store_true", help="one threshold from both sides' warm-up")
    p.add_argument("--check", action="store_true", help="finish stopped traces to measure tokens saved")
    p.add_argument("--no-chat-template", action="store_true")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("qa", help="a question set with gold answers, greedy: accuracy and the gold answer's "
                       "perplexity per row (how a prompt-level strategy such as restate is scored)")
    p.add_argument("--questions", default=None, help="JSONL of {question, answer} (default: the built-in 16, "
                   "assets/questions.jsonl)")
    p.add_argument("--row", action="append", type=_row, default=[], metavar="NAME[:STRATEGY][,K=V...]",
                   help="a row; repeat (default: baseline, and restate)")
    p.add_argument("--max-new-tokens", type=int, help="new tokens per answer at most")
    _add_model_args(p)
    p.add_argument("--out", default=None, help="also write the whole result (every answer) as JSON here")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("calibrate", help="is the confidence worth trusting? sampled traces of a question set with "
                       "gold answers, per row: reliability bins, ECE, adaptive ECE, Brier and AUROC of each DeepConf "
                       "measure (Platt-scaled on dev, scored on test), and what the early-stop threshold keeps")
    p.add_argument("--questions", default=None, help="builtin (default: the 16 of assets/questions.jsonl) | JSONL of "
                   "{question, answer}")
    _add_model_args(p)
    _add_strategy_args(p, "residual")
    # Numbers default to None: a flag left out keeps CalibrationConfig's own default (see `_given`).
    p.add_argument("--samples", type=int, help="sampled traces per question per row (default 8)")
    p.add_argument("--eta", type=float, action="append", default=None,
                   help="share of traces the early-stop threshold keeps, %%; repeat (default 10 and 90)")
    p.add_argument("--bins", type=int, help="reliability bins (default 10)")
    _add_trace_args(p)
    p.add_argument("--no-chat-template", action="store_true")
    p.add_argument("--out", default=None, help="also write the whole result (every trace) as JSON here")
    p.add_argument("--json", action="store_true", help="print the whole result as JSON instead of the table")
    p = sub.add_parser("lmeval", help="lm-evaluation-harness tasks, baseline and a strategy on the same documents: "
                       "per metric both values, the difference and a paired 95%% interval")
    p.add_argument("--tasks", required=True, help="comma-separated lm-eval task names (e.g. arc_easy,hellaswag)")
    p.add_argument("--include-path", default=None, metavar="DIR", help="a folder of task YAML files of your own")
    _add_model_args(p)
    _add_strategy_args(p, None, required=True)
    # Numbers default to None: a flag left out keeps run_pair's own default (see `_given`).
    p.add_argument("--mode", default=None, choices=["exact", "parallel", "jacobi"],
                   help="how the strategy scores (as ppl; default: parallel, jacobi for recurrent strategies)")
    p.add_argument("--passes", type=int, help="jacobi passes (the first is clean)")
    p.add_argument("--max-length", type=int, help="tokens per sequence at most (default 2048, capped by the model)")
    p.add_argument("--window", type=int, help="rolling window in tokens (default max-length + 1)")
    p.add_argument("--stride", type=int, help="new tokens per rolling window (default window - 1, as lm-eval)")
    p.add_argument("--limit", type=float, default=None, help="documents per task (below 1: a share of them)")
    p.add_argument("--num-fewshot", type=int)
    p.add_argument("--batch-size", type=int, help="rows per batch (baseline scoring, generation)")
    p.add_argument("--max-gen-toks", type=int, help="new tokens per generation unless the task says")
    p.add_argument("--bootstrap", type=int, help="paired bootstrap resamples for continuous metrics")
    p.add_argument("--seed", type=int)
    p.add_argument("--out", default=None, help="also write the JSON result to this file")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("recall", help="long-context key-fact recall: synthetic facts at depths 0-100 %% of texts "
                       "of 256 to 4,096 tokens, accuracy per length x depth per row, McNemar and a paired bootstrap "
                       "of the gold answer's log-probability vs the baseline")
    _add_model_args(p)
    _add_strategy_args(p, None)
    p.add_argument("--row", action="append", type=_row, default=[], metavar="NAME:STRATEGY[,K=V...]",
                   help="another strategy row; repeat (the baseline row is always first)")
    # Numbers default to None: a flag left out keeps RecallConfig's own default (see `_given`).
    p.add_argument("--items", type=int, help="facts (kinds in turn: number, name, date, two-hop); default 4")
    p.add_argument("--lengths", help="tokens of text, e.g. 256,1024,4096 (default 256,512,1024,2048,4096)")
    p.add_argument("--depths", help="%% of the text before the fact, e.g. 0,50,100 (default 0,25,50,75,100)")
    p.add_argument("--seed", type=int, help="facts, distractor text and the bootstrap")
    p.add_argument("--max-new-tokens", type=int, help="new tokens per answer at most (default 24)")
    p.add_argument("--split", choices=["dev", "test"], help="built-in corpus split for the distractor text (test)")
    p.add_argument("--bootstrap", type=int, help="resamples of the gold log-probability's 95%% CI (0: none)")
    p.add_argument("--out", default=None, help="also write the whole result (every answer) as JSON here")
    p.add_argument("--html", default=None, help="also write the heatmaps (each row, each difference) to this HTML file")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("batch", help="run a JSONL file of tasks; results appended to a JSONL file (resumable)")
    p.add_argument("input", help="JSONL: one task a line (id, prompt, mode, strategy, params, ...)")
    p.add_argument("output", help="JSONL results; rerun with the same file to resume")
    _add_model_args(p)
    p.add_argument("--retries", type=int, help="retries of a failing task before it is recorded")
    p.add_argument("--lenient", action="store_true",
                   help="ignore unknown task fields instead of recording the line as invalid")
    p = sub.add_parser("merge", help="join the part files of a sharded batch run (accelerate launch) in task order")
    p.add_argument("output", help="the OUTPUT given to batch; OUTPUT.part0, OUTPUT.part1, ... are joined into it")
    p = sub.add_parser("bench", help="engine speed ratios on the embedded model, each against its target")
    p.add_argument("--tokens", type=int, default=64, help="tokens generated per measurement")
    p.add_argument("--repeats", type=int, default=5, help="rounds per ratio (its two sides in turn; the median of "
                   "the per-round ratios is kept, the lowest and highest shown)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--modes", action="store_true", help="also compare the ways to run the model here (exact fp32 "
                   "on oneDNN or MKL, bf16 matmuls, bf16 weights, int8 weights): step, pair_vs_row, bandwidth, "
                   "greedy agreement and ΔPPL on the built-in test split")
    p.add_argument("--modes-only", action="store_true", help="only that comparison")
    p.add_argument("--api", action="store_true", help="also time a run through the HTTP API against the engine")
    p.add_argument("--quick", action="store_true", help="smaller scaling and Deep Think shapes, named by their "
                   "shapes (a check that every measurement runs; not the targets' shapes)")
    p.add_argument("--hog", action="store_true", help="also time 1 and 2 threads x PASSIVE and ACTIVE waiting, "
                   "quiet and beside a CPU hog (each in its own process)")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("doctor", help="check this machine (dtypes, 8/4-bit, memory readings, speed vs the roofline, "
                       "compiled decode, every strategy, the app): doctor.json and a table; CUDA-only steps are "
                       "skipped on CPU with the reason")
    p.add_argument("--out", default="doctor.json", help="where the report goes (default doctor.json); rewritten after "
                   "every step")
    p.add_argument("--model", default=None, help="embedded (default) | hub id | local folder | file.gguf")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto (default): the GPU where there is one; cpu: the CPU report on any machine")
    p.add_argument("--only", type=_step_names, default=None, metavar="STEP,...",
                   help="run only these steps (dtypes, quantized, memory, speed, compiled, strategies, app)")
    p.add_argument("--skip", type=_step_names, default=[], metavar="STEP,...", help="leave these steps out")
    p.add_argument("--budget-s", type=float, default=None, help="start no step after this many seconds (default: "
                   "300 on CUDA, none on CPU)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler = {"generate": _generate, "prepare": _prepare, "bench": _bench, "ppl": _ppl,
               "sweep": _sweep, "tune": _tune, "qa": _qa, "recall": _recall, "deepthink": _deepthink, "calibrate": _calibrate, "batch": _batch,
               "merge": _merge, "lmeval": _lmeval, "doctor": _doctor}[args.command]
    try:
        return handler(args)
    except FeedbackError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a failure mid-run (a model's layer, the machine): one line, not 100
        if os.environ.get(TRACEBACK_ENV, "").strip().lower() in ("1", "true", "yes", "on"):
            raise
        print(f"error: {args.command} failed: {one_line(exc)} (set {TRACEBACK_ENV}=1 for the traceback)",
              file=sys.stderr)
        return 1
