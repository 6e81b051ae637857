"""llama.cpp beside the engine on the same CPU, for `python -m feedback bench --peers`.

llama.cpp is what a CPU user would run instead, so its speed is the bar: each of the engine's CPU
modes (fp32, int8, int4) is timed against llama.cpp at the matching precision (F32, Q8_0, Q4_1) on
the same weights — the embedded model's GGUF, whose decoder is Q4_1 blocks and whose F32 and Q8_0
files are written once from it here — the same prompt token ids and greedy decoding, in turn, round
by round. Each side's decode-only CPU time per token is read where tokens come (the engine's
observer; llama.cpp's process CPU time after each token), the prefill and first token left out.

llama.cpp runs as the prebuilt CPU build in the npm package `node-llama-cpp` (no compiler, no
source build), found in `FEEDBACK_PEERS` (a folder with `node_modules/node-llama-cpp`; default the
`peers` folder of the model cache) with `node` on the PATH. It is never required: without it the
bench says how to install it and measures the rest. llama-cpp-python is not driven: it builds
llama.cpp from source on install, which takes many minutes on a 2-core machine.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from feedback.bench import (
    BENCH_PROMPT,
    _agree,
    _cpu,
    _engine_run,
    _load,
    _verdict,
    copy_bandwidth_gbs,
    ratio_of,
    weight_bytes,
)
from feedback.core import embedded, linear
from feedback.core.model import load_model, set_threads
from feedback.errors import FeedbackError

PEERS_ENV = "FEEDBACK_PEERS"
NODE_PACKAGE = "node-llama-cpp"
NODE_VERSION = "3.22.1"  # the version measured; another 3.x is likely to work
SCRIPT = Path(__file__).parent / "assets" / "llama_peer.mjs"
# What each pair is held to: the engine's CPU per token ÷ llama.cpp's, and the fp32 engine's share of
# the CPU-time roofline (a decode step reads every weight once, so copying them bounds it).
TARGETS = {"fp32_vs_F32": ("<=", 1.15), "int4_vs_Q4_1": ("<=", 2.0), "fp32_roofline": (">=", 0.85)}
# (engine mode, its load_model keywords, the llama.cpp precision it is held against)
PAIRS = (
    ("fp32", {"dtype": "float32"}, "F32"),
    ("int8", {"dtype": "float32", "load_in_8bit": True}, "Q8_0"),
    ("int4", {"dtype": "float32", "load_in_4bit": True}, "Q4_1"),
)


def peer_folder() -> Path:
    return Path(os.environ.get(PEERS_ENV) or embedded.cache_root() / "peers").expanduser()


def install_hint() -> str:
    return f"npm install --prefix {peer_folder()} {NODE_PACKAGE}@{NODE_VERSION}"


def find_llama_cpp() -> Path | None:
    """The installed node-llama-cpp package folder, where it and `node` are both there."""
    package = peer_folder() / "node_modules" / NODE_PACKAGE
    return package if (package / "package.json").is_file() and shutil.which("node") else None


def write_gguf(source: Path, target: Path, kind: str) -> None:
    """`source` rewritten with every 2-D weight as `kind` (F32 or Q8_0), the rest as it is: the
    same metadata and tokenizer, the same values where they are exact in `kind` (the embedded
    model's Q4_1 and Q8_0 weights are exact in F32; Q8_0 re-rounds the Q4_1 blocks to 8 bits)."""
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    reader = gguf.GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    tmp = target.with_suffix(f".{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(str(tmp), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if kind == "F32" else gguf.LlamaFileType.MOSTLY_Q8_0)
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        if values.ndim < 2 or kind == "F32":
            writer.add_tensor(tensor.name, values.astype("float32"))
        else:
            writer.add_tensor(tensor.name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, target)


def gguf_for(kind: str) -> Path:
    """The embedded model's GGUF at precision `kind`: the shipped file for Q4_1, else written once
    beside the peers (`write_gguf`)."""
    shipped = embedded.find_gguf()
    if kind == "Q4_1":
        return shipped
    target = peer_folder() / f"{shipped.name.removesuffix('.Q4_1.gguf')}.{kind}.gguf"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        write_gguf(shipped, target, kind)
    return target


def gguf_step_bytes(path: Path) -> int:
    """Bytes of weights a llama.cpp decode step reads: every tensor (the embedded model's output head
    is its token embedding, read whole each step)."""
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors)


def llama_cpp_runs(
    package: Path, path: Path, ids: list[int], tokens: int, threads: int, rounds: int = 1
) -> tuple[list[float], list[list[int]], str | None]:
    """`rounds` greedy runs of llama.cpp in one process: each run's decode-only CPU seconds per token
    (the first token's mark, after the prefill, is the start), each run's tokens, llama.cpp's release."""
    with tempfile.TemporaryDirectory() as tmp:  # the ids as a file: a long prompt outgrows argv
        ids_file = Path(tmp) / "ids.json"
        ids_file.write_text(json.dumps(ids))
        out = subprocess.run(
            [
                "node",
                str(SCRIPT),
                str(package),
                str(path),
                str(ids_file),
                str(tokens),
                str(threads),
                str(rounds),
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise FeedbackError(f"llama.cpp (node-llama-cpp) failed on {path.name}: {last}")
    report = json.loads(out.stdout.strip().splitlines()[-1])
    steps, replies = [], []
    for run in report["rounds"]:
        marks = run["marks"]
        if len(marks) < 2:
            raise FeedbackError(f"llama.cpp stopped after its first token on {path.name}")
        steps.append((marks[-1] - marks[0]) / (len(marks) - 1))
        replies.append(run["tokens"])
    return steps, replies, report.get("version")


def peers(tokens: int = 64, rounds: int = 5) -> dict:
    """Each pair of `PAIRS`: the engine's decode-only CPU time per token ÷ llama.cpp's, one run of
    each in turn per round (median and range of the rounds' ratios), each side's share of the
    CPU-time roofline (weights read per step ÷ the copy rate, over the step's CPU time; the copy rate
    measured in every round beside the two runs, as it moves with the machine's load: median of the
    rounds' shares), and how many greedy tokens agree before the first difference. Raises
    FeedbackError without llama.cpp."""
    package = find_llama_cpp()
    if package is None:
        raise FeedbackError(f"llama.cpp is not installed for the bench; install it with: {install_hint()}")
    threads = set_threads()  # FEEDBACK_THREADS, for both sides: idle threads may spin, costing CPU
    load_before = _load()
    out: dict = {
        "cpu": linear.cpu_name(),
        "threads": threads,
        "tokens": tokens,
        "rounds": rounds,
        "llama_cpp": f"{NODE_PACKAGE} {json.loads((package / 'package.json').read_text())['version']}",
        "timing": "CPU time per generated token after the first (decode only), each side in its own "
        "process's CPU clock, one run of each in turn per round",
        "pairs": {},
    }
    exact: list[int] = []
    rates: list[float] = []  # the copy rate per CPU-second (as both sides' steps are timed), each round
    for mode, kwargs, kind in PAIRS:
        lm = load_model("embedded", **kwargs)
        path = gguf_for(kind)
        ids = lm.encode(BENCH_PROMPT)
        _engine_run(lm, 4)  # warm-up: first calls pick kernels and fill caches
        pairs, replies, engine_bytes, llama_bytes = [], None, weight_bytes(lm), gguf_step_bytes(path)
        shares: list[tuple[float, float]] = []
        for _ in range(max(1, rounds)):
            engine_s, engine_tokens = _engine_run(lm, tokens)
            llama, llama_replies, release = llama_cpp_runs(package, path, ids, tokens, threads)
            rates.append(copy_bandwidth_gbs(clock=_cpu))
            pairs.append((engine_s, llama[0]))
            shares.append(
                (engine_bytes / (rates[-1] * 1e9) / engine_s, llama_bytes / (rates[-1] * 1e9) / llama[0])
            )
            replies = (engine_tokens, llama_replies[0])
        exact = exact or replies[0]  # the first pair is the exact fp32 engine: the reference reply
        r = ratio_of(pairs)
        out["llama_cpp_release"] = release
        out["pairs"][f"{mode}_vs_{kind}"] = {
            "engine": lm.quantization or f"{lm.dtype} (exact)",
            "llama_cpp": kind,
            "ratio": r.median,
            "spread": [r.low, r.high],
            "engine_ms": r.a * 1e3,
            "llama_cpp_ms": r.b * 1e3,
            "engine_weights_mb": engine_bytes / 1e6,
            "llama_cpp_weights_mb": llama_bytes / 1e6,
            "engine_roofline": statistics.median(e for e, _ in shares),
            "llama_cpp_roofline": statistics.median(b for _, b in shares),
            "engine_tokens_as_fp32": _agree(exact, replies[0]),
            "llama_cpp_tokens_as_fp32": _agree(exact, replies[1]),
        }
        del lm
    out["bandwidth_gbs"], out["bandwidth_range"] = statistics.median(rates), [min(rates), max(rates)]
    out["load_average"] = {"before": load_before, "after": _load()}
    return out


def peers_text(report: dict) -> str:
    lines = [
        f"llama.cpp ({report['llama_cpp']}, {report.get('llama_cpp_release') or 'release ?'}) beside the "
        f"engine on {report['cpu']}, {report['threads']} thread(s), {report['tokens']} greedy tokens, "
        f"{report['rounds']} rounds in turn; CPU ms per token after the first; copy rate "
        f"{report['bandwidth_gbs']:.1f} GB per CPU-second (median of the rounds; "
        f"{report['bandwidth_range'][0]:.1f}–{report['bandwidth_range'][1]:.1f}); load average "
        f"{report['load_average']['before']} before, {report['load_average']['after']} after",
        f"  {'pair':16} {'engine ÷ llama.cpp':>19}  {'range':13} {'engine ms':>9} {'llama.cpp ms':>12}  "
        "roofline share (engine / llama.cpp)  tokens agreeing",
    ]
    for name, p in report["pairs"].items():
        lines.append(
            f"  {name:16} {p['ratio']:19.2f}  [{p['spread'][0]:.2f}–{p['spread'][1]:.2f}]  "
            f"{p['engine_ms']:9.1f} {p['llama_cpp_ms']:12.1f}  "
            f"{p['engine_roofline']:.2f} / {p['llama_cpp_roofline']:.2f} "
            f"({p['engine_weights_mb']:.0f} / {p['llama_cpp_weights_mb']:.0f} MB a step)    "
            f"{p['engine_tokens_as_fp32']} / {p['llama_cpp_tokens_as_fp32']}"
        )
    lines.append(
        "  (tokens agreeing: greedy tokens equal to the exact fp32 engine's before the first "
        f"difference, engine / llama.cpp, of {report['tokens']})"
    )
    lines += [f"  {line}" for line in verdicts(report)]
    return "\n".join(lines)


def verdicts(report: dict) -> list[str]:
    """Each of `TARGETS` against what was measured: the pairs' ratios and the fp32 roofline share."""
    fp32 = report["pairs"].get("fp32_vs_F32")
    values = {name: p["ratio"] for name, p in report["pairs"].items()}
    if fp32:
        values["fp32_roofline"] = fp32["engine_roofline"]
    return [
        f"{name} {values[name]:.2f} {_verdict(name, values[name], TARGETS)}"
        for name in TARGETS
        if name in values
    ]


def for_bench(args) -> dict | None:
    """`peers` at the bench's tokens and rounds, or None (said on stderr) without llama.cpp."""
    if find_llama_cpp() is None:
        print(
            f"llama.cpp is not installed, so no peer comparison; install it with: {install_hint()}",
            file=sys.stderr,
        )
        return None
    return peers(args.tokens, max(3, args.repeats))


def run(args) -> int:
    """`bench --peers-only`: the comparison alone, as text or JSON; 1 without llama.cpp."""
    report = for_bench(args)
    if report is None:
        return 1
    print(json.dumps(report, indent=2) if args.json else peers_text(report))
    return 0
