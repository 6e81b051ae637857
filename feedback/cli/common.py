"""What the commands share: the parser class, the flag groups several commands take (model loading,
strategy, sampled traces, perplexity scoring), the argument types of those flags, the one model
loader, and the output helpers (the whole result as JSON, a progress line)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from feedback.errors import FeedbackError


class Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one line and exit 2 (no usage dump)."""

    def error(self, message: str):
        self.exit(2, f"error: {message}\n")


# ---- argument types ----


def param(text: str) -> tuple[str, str]:
    """KEY=VALUE -> (key, value)."""
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"--param expects KEY=VALUE, got {text!r}")
    key, value = text.split("=", 1)
    return key.strip(), value.strip()


def named(text: str) -> tuple[str, str]:
    """NAME=TEXT (the text may itself hold '=')."""
    name, sep, value = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"expects NAME=TEXT, got {text!r}")
    return name.strip(), value


def row(text: str) -> tuple[str, str | None, dict]:
    """NAME[:STRATEGY][,KEY=VALUE...] -> (name, strategy or None, params)."""
    head, *pairs = text.split(",")
    name, _, strategy = head.partition(":")
    if not name.strip():
        raise argparse.ArgumentTypeError(f"--row expects NAME[:STRATEGY][,KEY=VALUE...], got {text!r}")
    return name.strip(), strategy.strip() or None, dict(param(p) for p in pairs if p.strip())


def max_memory(text: str) -> dict:
    """`0=20GiB,1=20GiB,cpu=64GiB` -> {0: "20GiB", 1: "20GiB", "cpu": "64GiB"} (accelerate's max_memory)."""
    out: dict = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        device, sep, amount = item.partition("=")
        device, amount = device.strip(), amount.strip()
        if not sep or not amount or not (device.isdigit() or device in ("cpu", "disk", "mps")):
            raise argparse.ArgumentTypeError(
                f"--max-memory expects DEVICE=AMOUNT,... (e.g. 0=20GiB,cpu=64GiB), got {item!r}"
            )
        out[int(device) if device.isdigit() else device] = amount
    return out


def given(args, *names: str, **renamed: str) -> dict:
    """The config fields whose flags were given: each of `names` is a field and its flag's
    attribute; `renamed` maps a field to its attribute. Flags left out are absent, so the config
    keeps its own default, declared once beside it (the flags default to None)."""
    attrs = {**{name: name for name in names}, **renamed}
    return {name: getattr(args, attr) for name, attr in attrs.items() if getattr(args, attr) is not None}


# ---- flag groups ----


def add_model_args(p) -> None:
    """The model to load and how: every command that loads a model takes these (see `load`)."""
    p.add_argument("--model", default=None, help="embedded (default) | hub id | local folder | file.gguf")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument(
        "--fast-matmul",
        action="store_true",
        help="fast, not bit-exact: bf16 matmuls on fp32 weights (CPU, oneDNN); results say so",
    )
    g = p.add_argument_group("large models")
    g.add_argument(
        "--device-map", default=None, help="e.g. auto: spread layers over GPUs, then CPU (accelerate)"
    )
    g.add_argument(
        "--max-memory",
        type=max_memory,
        default=None,
        metavar="DEV=AMOUNT,...",
        help="memory cap per device for --device-map, e.g. 0=20GiB,1=20GiB,cpu=64GiB",
    )
    quant = g.add_mutually_exclusive_group()
    quant.add_argument(
        "--load-in-4bit",
        action="store_true",
        help="4-bit weights: bitsandbytes NF4 on CUDA; on CPU the decoder as 4-bit codes in groups of 32 "
        "and an int8 output head, bf16 activations: not bit-exact (on an Intel Xeon a step took 0.28 x "
        "exact fp32's CPU time, ΔPPL +0.38 %%; bench --peers and --modes measure yours)",
    )
    quant.add_argument(
        "--load-in-8bit",
        action="store_true",
        help="int8 weights: bitsandbytes on CUDA; on CPU every linear layer, the output head too, as int8 "
        "with per-channel scales, bf16 activations: not bit-exact (on an Intel Xeon 0.36 x exact fp32's "
        "CPU time a step, ΔPPL +0.69 %%)",
    )
    g.add_argument("--trust-remote-code", action="store_true", help="run the model repository's own code")


def add_strategy_args(p, default: str | None, required: bool = False) -> None:
    """--strategy (a name or a '+' stack) and its repeated --param KEY=VALUE."""
    p.add_argument(
        "--strategy",
        default=default,
        required=required,
        help="feedback strategy, or several joined by '+' applied in that order (a stack: "
        "inner_loop+deep_cache)" + (f" (default {default})" if default else ""),
    )
    p.add_argument(
        "--param",
        action="append",
        type=param,
        default=[],
        metavar="KEY=VALUE",
        help="a strategy parameter; a stack's are named STRATEGY.PARAM (deep_cache.lam=0.05)",
    )


def add_trace_args(p) -> None:
    """Sampled traces with DeepConf's confidence (Deep Think and calibration): numbers default to None,
    so a flag left out keeps the command's config default."""
    p.add_argument("--window", type=int, help="DeepConf group window (tokens)")
    p.add_argument("--k", type=int, help="DeepConf top-k for token confidence")
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--answer-regex", default=None, help="regex for the answer (first group, else the match)")


def add_ppl_args(p) -> None:
    """Teacher-forced scoring of a corpus (ppl, sweep, tune), with the model flags; see `ppl_config`."""
    p.add_argument(
        "--data", default="builtin:dev", help="builtin:dev | builtin:test | file.txt | file.jsonl | folder"
    )
    add_model_args(p)
    p.add_argument(
        "--mode",
        default=None,
        choices=["exact", "parallel", "jacobi"],
        help="default: parallel for non-recurrent strategies, jacobi for recurrent ones",
    )
    # Numbers default to None: a flag left out keeps PPLConfig's own default (see `given`).
    p.add_argument("--passes", type=int, help="jacobi passes (the first is clean)")
    p.add_argument("--window", type=int, help="tokens per scoring window")
    p.add_argument("--stride", type=int, help="new tokens scored per window")
    p.add_argument("--chunk", type=int, help="baseline prefill chunk within a window")
    p.add_argument("--max-docs", type=int)
    p.add_argument("--max-tokens", type=int, help="truncate each document to this many tokens")
    p.add_argument("--bootstrap", type=int, help="bootstrap resamples for the 95%% CI")
    p.add_argument("--seed", type=int)


# ---- what the shared flags build ----


def check_rows(rows: list) -> None:
    """Each row's strategy name and parameter values, before the model loads: a refusal names the
    row (layer indices are checked against the model once it has loaded)."""
    from feedback.strategies import check_strategy

    for r in rows:
        if r.strategy:
            try:
                check_strategy(r.strategy, r.params)
            except FeedbackError as exc:
                raise FeedbackError(f"row {r.name}: {exc}") from None


def load(args, device: str = "auto", model: str | None = None, dtype: str | None = None):
    """The one model loader, with every model flag of the command line. `model`/`dtype`: a saved
    run's, used unless --model / --dtype were given."""
    from feedback.core.model import load_model

    if args.max_memory and not args.device_map:
        raise FeedbackError("--max-memory needs --device-map (e.g. --device-map auto)")
    dtype = args.dtype if args.dtype != "auto" or not dtype else dtype
    return load_model(
        args.model or model or "embedded",
        dtype=dtype,
        device=device,
        device_map=args.device_map,
        max_memory=args.max_memory,
        load_in_4bit=args.load_in_4bit,
        load_in_8bit=args.load_in_8bit,
        trust_remote_code=args.trust_remote_code,
        fast_matmul=args.fast_matmul or None,
    )


def ppl_config(args, params: dict | None = None):
    """The PPLConfig of the `add_ppl_args` and `add_strategy_args` flags (`params`: instead of --param)."""
    from feedback.eval.perplexity import TOKENS_PER_DOC, PPLConfig

    if args.max_tokens is not None:  # refused before the model loads, as the config would refuse it after
        TOKENS_PER_DOC.check(args.max_tokens)
    return PPLConfig(
        strategy=args.strategy,
        params=dict(args.param) if params is None else params,
        mode=args.mode,
        **given(
            args,
            "passes",
            "window",
            "stride",
            "chunk",
            "max_docs",
            "bootstrap",
            "seed",
            max_tokens_per_doc="max_tokens",
        ),
    )


# ---- output ----


def json_result(args, res: dict, indent: int | None = 1, printed_indent: int | None = None) -> bool:
    """A command's whole result as JSON: written to --out when given, printed with --json (True: then
    it is all the command prints)."""
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=indent))
    if args.json:
        print(json.dumps(res, indent=printed_indent))
    return bool(args.json)


def progress(done: int, total: int, name: str) -> None:
    """One progress line on stderr, rewritten in place until the last item."""
    print(
        f"\r  [{done}/{total}] {name[:40]:40}", end="" if done < total else "\n", file=sys.stderr, flush=True
    )


def warn(msg: str) -> None:
    """A warning on stderr."""
    print(f"warning: {msg}", file=sys.stderr)
