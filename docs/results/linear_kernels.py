"""Decode CPU time per token through the engine with each fp32 linear choice: the default (`auto`:
gemv for the rows it was measured faster at, per shape, oneDNN above), oneDNN everywhere, and
PyTorch's own (MKL) everywhere; 48 greedy tokens, 1 row and the baseline + residual pair, the three
models in turn over 4 rounds (median), at torch's threads with decode steps at the model's decode
threads; and whether their greedy tokens agree.

Run: OMP_WAIT_POLICY=PASSIVE PYTHONPATH=. .venv/bin/python docs/results/linear_kernels.py
"""
import statistics
import time

import torch

from feedback.bench import BENCH_PROMPT
from feedback.core import linear
from feedback.core.engine import run_to_end
from feedback.core.model import load_model
from feedback.core.records import RowSpec, RunConfig

models = {name: load_model("embedded", dtype="float32", linear_kernel=name) for name in ("auto", "onednn", "aten")}
print(f"{torch.get_num_threads()} threads; decode threads {models['auto'].decode_threads}")
print("auto:", linear.kernel_summary(models["auto"].kernels))


def step_cpu(lm, rows):
    marks = []
    specs = [RowSpec("baseline")] + [RowSpec("feedback", "residual", {})] * (rows - 1)
    result = run_to_end(
        lm,
        RunConfig(prompt=BENCH_PROMPT, model=lm.name, max_new_tokens=48, rows=specs),
        observer=lambda step, live, logits: marks.append(time.process_time()),
    )
    return (marks[-1] - marks[0]) / (len(marks) - 1), result.rows[0].token_ids


for rows in (1, 2):
    seen = {name: [] for name in models}
    tokens = {}
    for _ in range(4):
        for name, lm in models.items():
            s, tokens[name] = step_cpu(lm, rows)
            seen[name].append(s)
    line = ", ".join(f"{name} {statistics.median(v) * 1e3:.1f} ms" for name, v in seen.items())
    same = all(t == tokens["auto"] for t in tokens.values())
    print(f"{rows} row(s): {line}; same greedy tokens: {same}", flush=True)
