"""`python -m feedback bench`: the engine's speed ratios against their targets, measured in one run.

Ratios, not absolute timings, are the point: each compares two measurements taken moments apart on
the same machine, the median of several repeats. They are reported, never asserted.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import torch
from transformers import DynamicCache

from feedback.core.engine import run_to_end
from feedback.core.model import LoadedModel, load_model, set_fast_matmul
from feedback.core.records import RowSpec, RunConfig

BENCH_PROMPT = "Write a detailed, step-by-step explanation of how a refrigerator keeps food cold."
TARGETS = {
    "baseline_vs_generate": (">=", 0.95),
    "side_by_side_overhead": ("<=", 1.05),
    "feedback_row_overhead": ("<=", 1.03),
    "cold_start_s": ("<=", 3.0),
    "mixed_prompts_overhead": ("<=", 1.10),
    "rows4_vs_forward4": ("<=", 1.05),
    "quality_overhead": ("<=", 1.05),
    # decode step of N plain rows on one prompt ÷ one row (the KV cache and attention grow with both)
    "rows16_ctx1024_vs_row1": ("<=", 4.0),
    "rows8_ctx1024_vs_row1": ("<=", 3.0),
    "rows8_ctx256_vs_row1": ("<=", 3.0),
    "rows8_ctx16_vs_row1": ("<=", 3.0),
}
SCALING = ((16, 1024), (8, 1024), (8, 256), (8, 16))  # (rows, prompt tokens) of the rowsN_ctxT ratios
DEEPTHINK = (16, 256)  # (traces, prompt tokens) of the Deep Think throughput
# `--quick`: the same measurements on smaller shapes (a check that every part runs, in seconds), named
# by their own shapes, so their ratios are never read against the full shapes' targets.
QUICK_SCALING = ((16, 128), (8, 16))
QUICK_DEEPTHINK = (8, 32)
SHORT_PROMPT = "How does a fridge work?"


def _median(fn, repeats: int) -> float:
    return statistics.median(fn() for _ in range(repeats))


def _interleaved(a, b, repeats: int) -> tuple[float, float]:
    """Medians of a and b timed in turn (a b a b ...), so a drift in machine load hits both alike."""
    times = [(a(), b()) for _ in range(repeats)]
    return statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)


def _engine_step_s(lm: LoadedModel, rows: list[RowSpec], tokens: int, prompt: str = BENCH_PROMPT,
                   chat_template: bool = True) -> float:
    """Mean wall time of the decode steps after the first (the first one carries the prefill)."""
    result = run_to_end(lm, RunConfig(prompt=prompt, max_new_tokens=tokens, rows=rows, chat_template=chat_template))
    steps = result.rows[0].steps[1:]
    return sum(s.time_ms for s in steps) / len(steps) / 1000.0


def _engine_wall_s(lm: LoadedModel, tokens: int) -> tuple[float, list[int]]:
    t = time.perf_counter()
    result = run_to_end(lm, RunConfig(prompt=BENCH_PROMPT, max_new_tokens=tokens, rows=[RowSpec("baseline")]))
    return time.perf_counter() - t, result.rows[0].token_ids


def _generate_wall_s(lm: LoadedModel, tokens: int) -> tuple[float, list[int]]:
    ids = torch.tensor([lm.encode(BENCH_PROMPT)], device=lm.device)
    with torch.inference_mode():
        t = time.perf_counter()
        out = lm.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, do_sample=False,
                                pad_token_id=lm.tokenizer.eos_token_id)
        elapsed = time.perf_counter() - t
    return elapsed, out[0, ids.shape[1]:].tolist()


def _raw_step_s(lm: LoadedModel, batch: int, tokens: int) -> float:
    """A bare batched forward per step on a real cache: no sampling, metrics, hooks or records."""
    ids = torch.tensor([lm.encode(BENCH_PROMPT)], device=lm.device)
    with torch.inference_mode():
        cache = DynamicCache(config=lm.model.config)
        out = lm.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        cache.batch_repeat_interleave(batch)
        tok = out.logits[:, -1].argmax(-1).repeat(batch)[:, None]
        t = time.perf_counter()
        for _ in range(tokens - 1):
            out = lm.model(input_ids=tok, cache=cache, use_cache=True)
            tok = out.logits[:, -1].argmax(-1)[:, None]
        return (time.perf_counter() - t) / (tokens - 1)


def prompt_of(lm: LoadedModel, tokens: int) -> str:
    """A prompt of about `tokens` tokens (no chat template): Python Language Reference text, which
    ships with CPython, so every machine measures the same prompt."""
    from pydoc_data.topics import topics

    text = " ".join(topics[name] for name in sorted(topics))
    ids = lm.tokenizer(text, add_special_tokens=False)["input_ids"][:tokens]
    return lm.tokenizer.decode(ids)


def scaling(lm: LoadedModel, tokens: int, repeats: int, shapes=SCALING) -> dict:
    """Decode step of N plain rows ÷ one row on the same T-token prompt, timed in turn."""
    out = {}
    for rows, ctx in shapes:
        prompt = prompt_of(lm, ctx)
        many = [RowSpec(f"r{i}") for i in range(rows)]
        one, n = _interleaved(lambda: _engine_step_s(lm, many[:1], tokens, prompt, False),
                              lambda: _engine_step_s(lm, many, tokens, prompt, False), repeats)
        out[f"rows{rows}_ctx{ctx}_vs_row1"] = n / one
        out.setdefault("step_ms_scaling", {})[f"rows{rows}_ctx{ctx}"] = {"one_row": one * 1e3, "rows": n * 1e3}
    return out


def deepthink_throughput(lm: LoadedModel, tokens: int, repeats: int, traces: int = DEEPTHINK[0],
                         ctx: int = DEEPTHINK[1]) -> dict:
    """Deep Think's shape: `traces` sampled traces of one `ctx`-token prompt, decoded as one batched
    run, against the same traces run one by one (each with its own seed offset, so the same tokens).
    Throughput in trace-tokens per second of wall time."""
    from feedback.core.sampling import SamplingConfig

    prompt = prompt_of(lm, ctx)
    rows = [RowSpec(f"t{i}", seed_offset=i) for i in range(traces)]
    sampling = SamplingConfig(temperature=0.7, top_p=0.95)

    def run(specs) -> tuple[float, int]:
        t = time.perf_counter()
        res = run_to_end(lm, RunConfig(prompt=prompt, max_new_tokens=tokens, rows=specs, chat_template=False,
                                       sampling=sampling))
        return time.perf_counter() - t, sum(len(r.token_ids) for r in res.rows)

    def separate() -> tuple[float, int]:
        parts = [run([spec]) for spec in rows]
        return sum(p[0] for p in parts), sum(p[1] for p in parts)

    batched, one_by_one = zip(*[(run(rows), separate()) for _ in range(repeats)])
    b_wall, b_tok = statistics.median(w for w, _ in batched), batched[0][1]
    s_wall, s_tok = statistics.median(w for w, _ in one_by_one), one_by_one[0][1]
    name = f"deepthink{traces}"
    return {f"{name}_batched_tok_s": b_tok / b_wall, f"{name}_separate_tok_s": s_tok / s_wall,
            f"{name}_speedup": (b_tok / b_wall) / (s_tok / s_wall), "deepthink_shape": [traces, ctx]}


def batch_invariance(lm: LoadedModel, tokens: int = 24) -> dict:
    """How far a row's logits move with its batch: two identical rows (bitwise?), and one row in a
    2-row and a 16-row batch against the same row alone (max |Δ logit| over the run)."""
    def logits(rows):
        seen = []
        run_to_end(lm, RunConfig(prompt=SHORT_PROMPT, max_new_tokens=tokens, rows=rows),
                   observer=lambda step, live, lg: seen.append(lg.clone()))
        return seen

    alone, two = logits([RowSpec("a")]), logits([RowSpec("a"), RowSpec("b")])
    sixteen = logits([RowSpec(f"r{i}") for i in range(16)])
    gap = lambda batch: max((a[0] - b[0]).abs().max().item() for a, b in zip(alone, batch))  # noqa: E731
    return {"identical_rows_bitwise_equal": all(torch.equal(lg[0], lg[1]) for lg in two),
            "rows2_vs_alone_max_abs": gap(two), "rows16_vs_alone_max_abs": gap(sixteen)}


def _quality_overhead(lm: LoadedModel, tokens: int, repeats: int) -> float:
    """Wall time of a baseline + feedback run with the forward-pass quality metrics (self and prompt
    perplexity) ÷ the same run without them."""
    def wall(quality: bool) -> float:
        rows = [RowSpec("baseline"), RowSpec("feedback", "residual", {})]
        t = time.perf_counter()
        run_to_end(lm, RunConfig(prompt=BENCH_PROMPT, max_new_tokens=tokens, rows=rows, quality=quality))
        return time.perf_counter() - t

    with_metrics, without = _interleaved(lambda: wall(True), lambda: wall(False), repeats)
    return with_metrics / without


def _bandwidth_gbs() -> float:
    """Memory bandwidth from a large copy (bytes read + written per second), best of three."""
    src = torch.empty(64 * 1024 * 1024, dtype=torch.float32).fill_(1.0)  # 256 MiB
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() * src.element_size() / best / 1e9


def _weight_bytes(lm: LoadedModel) -> int:
    seen: set[int] = set()
    total = 0
    for p in lm.model.parameters():  # tied tensors (embedding = lm_head) are read once a step
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def _cold_start_s(dtype: str) -> float:
    """load_model() from the prepared cache in a fresh process (interpreter and imports excluded)."""
    code = ("import time; from feedback.core.model import load_model; t = time.perf_counter(); "
            f"load_model('embedded', dtype={dtype!r}); print(time.perf_counter() - t)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def measure(tokens: int = 64, repeats: int = 3, dtype: str = "auto", lm: LoadedModel | None = None,
            quick: bool = False) -> dict:
    lm = lm or load_model("embedded", dtype=dtype)
    base, fb = RowSpec("baseline"), RowSpec("feedback", "residual", {})
    _engine_step_s(lm, [base, fb], 8)  # warm-up (allocator, kernels)
    # interleaved (generate, engine, generate, ...) so a drift in machine load hits both sides alike
    pairs = [(_generate_wall_s(lm, tokens), _engine_wall_s(lm, tokens)) for _ in range(repeats)]
    (gen_s, gen_tokens), (eng_s, eng_tokens) = (zip(*side) for side in zip(*pairs))
    pair = _median(lambda: _engine_step_s(lm, [base, fb], tokens), repeats)
    twin = _median(lambda: _engine_step_s(lm, [base, RowSpec("baseline2")], tokens), repeats)
    raw2 = _median(lambda: _raw_step_s(lm, 2, tokens), repeats)
    raw1 = _median(lambda: _raw_step_s(lm, 1, tokens), repeats)
    single = _median(lambda: _engine_step_s(lm, [base], tokens), repeats)
    # rows with their own prompts: left-padded into one batch (mask and position ids every step)
    mixed, shared = _interleaved(lambda: _engine_step_s(lm, [RowSpec("short", prompt=SHORT_PROMPT),
                                                             RowSpec("long", prompt=BENCH_PROMPT)], tokens),
                                 lambda: _engine_step_s(lm, [RowSpec("a"), RowSpec("b")], tokens), repeats)
    four = [base] + [RowSpec(f"alpha{a}", "residual", {"alpha": a}) for a in (0.05, 0.1, 0.2)]
    rows4, raw4 = _interleaved(lambda: _engine_step_s(lm, four, tokens), lambda: _raw_step_s(lm, 4, tokens),
                               repeats)
    quality = _quality_overhead(lm, 2 * tokens, repeats)
    grows = scaling(lm, max(4, tokens // 4), repeats, QUICK_SCALING if quick else SCALING)
    deep = deepthink_throughput(lm, max(4, tokens // 4), repeats, *(QUICK_DEEPTHINK if quick else DEEPTHINK))
    invariance = batch_invariance(lm, max(4, tokens // 4))
    bandwidth = _bandwidth_gbs()
    weights = _weight_bytes(lm)
    ideal = weights / (bandwidth * 1e9)
    return {
        "model": lm.name, "dtype": lm.dtype, "device": str(lm.device), "tokens": tokens, "repeats": repeats,
        "threads": torch.get_num_threads(),
        "same_tokens_as_generate": all(g == e for g, e in zip(gen_tokens, eng_tokens)),
        "baseline_vs_generate": statistics.median(gen_s) / statistics.median(eng_s),
        "side_by_side_overhead": pair / raw2,
        "feedback_row_overhead": pair / twin,
        "two_rows_vs_two_generations": pair / (2 * single),
        "cold_start_s": _cold_start_s(lm.dtype),
        "mixed_prompts_overhead": mixed / shared,
        "rows4_vs_forward4": rows4 / raw4,
        "quality_overhead": quality, "quality_tokens": 2 * tokens,
        "roofline_fraction": ideal / single,
        "step_ms": {"engine_baseline": single * 1e3, "engine_baseline_residual": pair * 1e3,
                    "engine_baseline_baseline": twin * 1e3, "engine_two_prompts": mixed * 1e3,
                    "engine_four_rows": rows4 * 1e3, "raw_batch1": raw1 * 1e3, "raw_batch2": raw2 * 1e3,
                    "raw_batch4": raw4 * 1e3},
        "weights_mb": weights / 2**20, "bandwidth_gbs": bandwidth,
        "attention": lm.model.config._attn_implementation, **grows, **deep, "batch_invariance": invariance,
    }


def api_overhead(lm: LoadedModel, tokens: int = 64, repeats: int = 3) -> dict:
    """One baseline + feedback run through the HTTP API on a local server (streamed as NDJSON and
    parsed by the client, or whole) against the same run on the engine in-process, wall time."""
    import httpx

    from feedback.serve.api import local_server
    from feedback.serve.pool import ModelPool

    rows = [RowSpec("baseline"), RowSpec("feedback", "residual", {})]
    body = {"prompt": BENCH_PROMPT, "max_new_tokens": tokens,
            "rows": [{"name": r.name, "strategy": r.strategy} for r in rows]}

    def direct() -> tuple[float, list]:
        t = time.perf_counter()
        result = run_to_end(lm, RunConfig(prompt=BENCH_PROMPT, max_new_tokens=tokens, rows=rows))
        return time.perf_counter() - t, [r.token_ids for r in result.rows]

    with local_server(ModelPool.serving(lm)) as url, httpx.Client(base_url=url + "/api", timeout=600) as client:
        def streamed() -> tuple[float, list]:
            t = time.perf_counter()
            with client.stream("POST", "/generate/stream", json=body) as r:
                events = [json.loads(line) for line in r.iter_lines() if line]
            return time.perf_counter() - t, [row["token_ids"] for row in events[-1]["result"]["rows"]]

        def whole() -> tuple[float, list]:
            t = time.perf_counter()
            data = client.post("/generate", json=body).json()
            return time.perf_counter() - t, [row["token_ids"] for row in data["rows"]]

        whole()  # warm-up: first request, server threads
        runs = {name: [fn() for _ in range(repeats)] for name, fn in
                (("engine", direct), ("stream", streamed), ("generate", whole))}
    wall = {name: statistics.median(t for t, _ in r) for name, r in runs.items()}
    tokens_seen = {name: r[0][1] for name, r in runs.items()}
    return {"api_stream_vs_engine": wall["stream"] / wall["engine"],
            "api_generate_vs_engine": wall["generate"] / wall["engine"],
            "api_same_tokens": tokens_seen["stream"] == tokens_seen["engine"] == tokens_seen["generate"],
            "api_wall_s": wall}


def compare_dtypes(tokens: int = 64, repeats: int = 3) -> dict:
    """Decode step time and greedy agreement with exact fp32 of each CPU precision: fp32, bf16
    weights, and fp32 weights with bf16 matmuls (the two fast modes). Confidences are compared over
    the tokens before the first difference."""
    out: dict = {}
    ref: list[int] | None = None
    ref_conf: list[float] = []
    for label, dtype, fast in (("float32", "float32", False), ("bfloat16", "bfloat16", False),
                               ("float32+bf16_matmul", "float32", True)):
        lm = load_model("embedded", dtype=dtype, fast_matmul=fast)
        _raw_step_s(lm, 1, 8)
        step = _median(lambda: _raw_step_s(lm, 1, tokens), repeats)
        result = run_to_end(lm, RunConfig(prompt=BENCH_PROMPT, max_new_tokens=tokens, rows=[RowSpec("b")]))
        ids, conf = result.rows[0].token_ids, [s.confidence for s in result.rows[0].steps]
        ref, ref_conf = ref or ids, ref_conf or conf
        agree = next((i for i, (a, b) in enumerate(zip(ref, ids)) if a != b), min(len(ref), len(ids)))
        out[label] = {"step_ms_batch1": step * 1e3, "tokens_equal_to_fp32_before_first_difference": agree,
                      "max_confidence_diff": max((abs(a - b) for a, b in zip(ref_conf[:agree], conf[:agree])),
                                                 default=0.0),
                      "precision": lm.precision, "text": result.rows[0].text[:160]}
    set_fast_matmul(False)
    base = out["float32"]["step_ms_batch1"]
    for d in out.values():
        d["step_vs_fp32"] = d["step_ms_batch1"] / base
    return out


HOG = "import time\nwhile True: sum(range(10_000))"  # one busy core, like a neighbour on a shared CPU


def _step_in_process(threads: int, wait: str, tokens: int) -> float:
    """A bare one-row decode step (ms) in a fresh process with these threads and wait policy (the
    policy is read once, when torch loads, so it needs its own process)."""
    code = ("import torch, time; from feedback.core.model import load_model; from feedback.bench import _raw_step_s; "
            f"torch.set_num_threads({threads}); lm = load_model('embedded', dtype='float32'); _raw_step_s(lm, 1, 4); "
            f"print(min(_raw_step_s(lm, 1, {tokens}) for _ in range(2)) * 1e3)")
    env = {**os.environ, "OMP_WAIT_POLICY": wait}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    return float(out.stdout.strip().splitlines()[-1])


def busy_machine(tokens: int = 16) -> dict:
    """Decode step (ms) for 1 and 2 threads x PASSIVE and ACTIVE waiting, on the machine as it is and
    with a CPU hog beside it (one process spinning on one core)."""
    configs = [(t, w) for t in (1, 2) for w in ("PASSIVE", "ACTIVE")]
    out: dict = {"quiet": {}, "hog": {}}
    for t, w in configs:
        out["quiet"][f"{t}t_{w.lower()}"] = _step_in_process(t, w, tokens)
    hog = subprocess.Popen([sys.executable, "-c", HOG])
    try:
        for t, w in configs:
            out["hog"][f"{t}t_{w.lower()}"] = _step_in_process(t, w, tokens)
    finally:
        hog.kill()
        hog.wait()
    return out


def _verdict(key: str, value: float) -> str:
    op, target = TARGETS[key]
    ok = value >= target if op == ">=" else value <= target
    return f"{op} {target}  {'ok' if ok else 'MISSED'}"


def run_bench(args) -> int:
    lm = load_model("embedded", dtype=args.dtype)
    report = measure(args.tokens, args.repeats, lm=lm, quick=getattr(args, "quick", False))
    if getattr(args, "api", False):
        report |= api_overhead(lm, args.tokens, args.repeats)
    if getattr(args, "dtypes", False):
        report["dtypes"] = compare_dtypes()
    if getattr(args, "hog", False):
        report["busy_machine"] = busy_machine()
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"model {report['model']} {report['dtype']} on {report['device']} ({report['threads']} threads), "
          f"{report['tokens']} tokens, median of {report['repeats']}")
    print(f"{'metric':32} {'value':>9}  target")
    for key in TARGETS:
        if key in report:  # --quick measures the scaling ratios on other shapes
            print(f"{key:32} {report[key]:9.3f}  {_verdict(key, report[key])}")
    for key in sorted(k for k in report if k.startswith("rows") and k.endswith("_vs_row1") and k not in TARGETS):
        print(f"{key:32} {report[key]:9.3f}  (--quick shape, no target)")
    print(f"  (quality_overhead: wall of a {report['quality_tokens']}-token baseline + feedback run with self and "
          "prompt perplexity ÷ without)")
    print(f"{'two_rows_vs_two_generations':32} {report['two_rows_vs_two_generations']:9.3f}  (< 1 means batching pays)")
    print(f"{'roofline_fraction':32} {report['roofline_fraction']:9.3f}  ({report['weights_mb']:.0f} MB weights "
          f"at {report['bandwidth_gbs']:.1f} GB/s)")
    print("step ms: " + ", ".join(f"{k} {v:.1f}" for k, v in report["step_ms"].items()))
    print(f"same greedy tokens as model.generate: {report['same_tokens_as_generate']}")
    inv = report["batch_invariance"]
    print(f"batch invariance: identical rows bitwise equal {inv['identical_rows_bitwise_equal']}; a row in 2 / 16 "
          f"rows vs alone: max |Δ logit| {inv['rows2_vs_alone_max_abs']:.1e} / {inv['rows16_vs_alone_max_abs']:.1e}")
    traces, ctx = report["deepthink_shape"]
    name = f"deepthink{traces}"
    print(f"{name + '_speedup':32} {report[name + '_speedup']:9.3f}  ({traces} traces of a {ctx}-token prompt, "
          f"batched {report[name + '_batched_tok_s']:.1f} vs one by one {report[name + '_separate_tok_s']:.1f} "
          f"trace-tokens/s; attention: {report['attention']})")
    if "api_stream_vs_engine" in report:
        print(f"{'api_stream_vs_engine':32} {report['api_stream_vs_engine']:9.3f}  (HTTP API, NDJSON stream, local)")
        print(f"{'api_generate_vs_engine':32} {report['api_generate_vs_engine']:9.3f}  (HTTP API, whole result)")
        print(f"same greedy tokens through the API: {report['api_same_tokens']}")
    for where, steps in report.get("busy_machine", {}).items():
        print(f"decode step ms, {where:5}: " + ", ".join(f"{k} {v:.1f}" for k, v in steps.items()))
    for dtype, d in report.get("dtypes", {}).items():
        print(f"{dtype}: {d['step_ms_batch1']:.1f} ms/step ({d['step_vs_fp32']:.2f} x fp32), equal to fp32 for "
              f"{d['tokens_equal_to_fp32_before_first_difference']} tokens, confidences within "
              f"{d['max_confidence_diff']:.1e} there ({d['precision']}): {d['text']!r}")
    return 0
