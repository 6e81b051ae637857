"""Command line: python -m feedback {generate, bench, prepare}."""
from __future__ import annotations

import argparse
import json
import sys
import textwrap

from feedback.errors import FeedbackError


def _param(text: str) -> tuple[str, str]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"--param expects KEY=VALUE, got {text!r}")
    key, value = text.split("=", 1)
    return key.strip(), value.strip()


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one line and exit 2 (no usage dump)."""

    def error(self, message: str):
        self.exit(2, f"error: {message}\n")


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="baseline vs feedback on one prompt")
    p.add_argument("--prompt", required=True)
    p.add_argument("--model", default="embedded", help="embedded | hub id | local folder | file.gguf")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--strategy", default="residual", help="feedback strategy of the second row")
    p.add_argument("--param", action="append", type=_param, default=[], metavar="KEY=VALUE")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-chat-template", action="store_true")
    p.add_argument("--system", default=None, help="system prompt (chat template only)")
    p.add_argument("--k", type=int, default=20, help="DeepConf top-k for token confidence")
    p.add_argument("--window", type=int, default=32, help="DeepConf group window (tokens)")
    p.add_argument("--threshold", type=float, default=None, help="early-stop group-confidence threshold")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--json", action="store_true", help="print one RunResult JSON object")


def _generate(args) -> int:
    from feedback.engine import Engine
    from feedback.model import load_model
    from feedback.records import DeepConfConfig, RunConfig, default_rows
    from feedback.sampling import SamplingConfig
    from feedback.strategies import get_strategy

    get_strategy(args.strategy)  # unknown names fail before the model loads
    config = RunConfig(
        prompt=args.prompt, model=args.model, dtype=args.dtype, chat_template=not args.no_chat_template,
        system_prompt=args.system, max_new_tokens=args.max_new_tokens, seed=args.seed,
        sampling=SamplingConfig(args.temperature, args.top_k, args.top_p, args.min_p, args.repetition_penalty),
        deepconf=DeepConfConfig(args.k, args.window, args.threshold),
        rows=default_rows(args.strategy, dict(args.param)),
    ).validate()
    lm = load_model(args.model, dtype=args.dtype, trust_remote_code=args.trust_remote_code)
    engine = Engine(lm)
    if args.json:
        print(engine.run(config).to_json())
        return 0
    run = engine.start(config)
    print(f"model {lm.name} ({lm.dtype}, {lm.device}), prompt {len(run.prompt_ids)} tokens", file=sys.stderr)
    for _ in run:
        pass
    _print_result(run.result)
    return 0


def _print_result(result) -> None:
    width = 100
    for row in result.rows:
        label = row.name if not row.strategy else f"{row.name} [{row.strategy} " + ", ".join(
            f"{k}={v}" for k, v in row.params.items()) + "]"
        m = row.metrics
        print(f"=== {label} ===")
        print(textwrap.fill(row.text.strip(), width, replace_whitespace=False) if row.text.strip() else "(empty)")
        lowest = m.get("lowest_group")
        print(f"--- {len(row.token_ids)} tokens, {row.tokens_per_s:.1f} tok/s, mean confidence "
              f"{(m.get('mean') or 0):.2f}, lowest group {lowest if lowest is None else round(lowest, 2)}, "
              f"stop: {row.stop_reason} at step {row.stop_step}\n")
    if result.first_divergence_step is not None:
        print(f"first divergence at step {result.first_divergence_step}")
    else:
        print("the two rows produced identical tokens")


def _prepare(args) -> int:
    from feedback import embedded

    path = embedded.prepare(log=lambda msg: print(msg, file=sys.stderr, flush=True))
    print(path)
    return 0


def _bench(args) -> int:
    from feedback.bench import run_bench

    return run_bench(args)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m feedback", description="Feedback Lens: baseline vs activation feedback")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_generate(sub)
    p = sub.add_parser("prepare", help="convert the embedded GGUF model into the cache (once)")
    p = sub.add_parser("bench", help="engine speed ratios on the embedded model (SPEC §7)")
    p.add_argument("--tokens", type=int, default=64, help="tokens generated per measurement")
    p.add_argument("--repeats", type=int, default=3, help="repeats per measurement (the median is kept)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--dtypes", action="store_true", help="also compare float32 and bfloat16 decode speed")
    p.add_argument("--json", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler = {"generate": _generate, "prepare": _prepare, "bench": _bench}[args.command]
    try:
        return handler(args)
    except FeedbackError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
