"""`bench`: the engine's speed ratios on the embedded model, each against its target (the
measurements themselves are `feedback.bench`)."""

from __future__ import annotations

NAME = "bench"


def add_parser(sub) -> None:
    p = sub.add_parser(NAME, help="engine speed ratios on the embedded model, each against its target")
    p.add_argument("--tokens", type=int, default=64, help="tokens generated per measurement")
    p.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="rounds per ratio (its two sides in turn; the median of "
        "the per-round ratios is kept, the lowest and highest shown)",
    )
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument(
        "--modes",
        action="store_true",
        help="also compare the ways to run the model here (exact fp32 "
        "on oneDNN or MKL, transformers' own layers, bf16 matmuls, bf16 weights, int8 and int4 weights): "
        "step, pair_vs_row, bandwidth, "
        "greedy agreement and ΔPPL on the built-in test split",
    )
    p.add_argument("--modes-only", action="store_true", help="only that comparison")
    p.add_argument(
        "--peers",
        action="store_true",
        help="also time llama.cpp (npm node-llama-cpp, when installed) beside the engine: fp32, int8 "
        "and int4 against F32, Q8_0 and Q4_1 GGUFs of the same weights, the same prompt ids, in turn",
    )
    p.add_argument("--peers-only", action="store_true", help="only that comparison")
    p.add_argument(
        "--api", action="store_true", help="also time a run through the HTTP API against the engine"
    )
    p.add_argument(
        "--concurrency-only",
        action="store_true",
        help="only the concurrency measure (also part of the full bench): 8 HTTP clients at once, "
        "their runs decoding together against one at a time (CPU per token), time to first token of "
        "a request sent mid-run, and every request's tokens against its solo run",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="smaller scaling, Deep Think and concurrency shapes, named by their "
        "shapes (a check that every measurement runs; not the targets' shapes)",
    )
    p.add_argument(
        "--hog",
        action="store_true",
        help="also time 1 and 2 threads x PASSIVE and ACTIVE waiting, "
        "quiet and beside a CPU hog (each in its own process)",
    )
    p.add_argument("--json", action="store_true")


def run(args) -> int:
    from feedback import peers
    from feedback.bench import run_bench

    if args.peers_only:
        return peers.run(args)
    return run_bench(args, (lambda: peers.for_bench(args), peers.peers_text) if args.peers else None)
