"""Decode CPU time per token with the fp32 linear kernels this machine measured fastest (per shape
and rows), against oneDNN's and PyTorch's own (MKL) for every layer: 48 greedy tokens, 1 row and the
baseline + residual pair, the three choices in turn over 4 rounds on one loaded model.

Run: OMP_WAIT_POLICY=PASSIVE PYTHONPATH=. .venv/bin/python docs/results/linear_kernels.py
"""
import time, torch, statistics
from feedback.core import linear
from feedback.core.model import load_model
from feedback.core.engine import run_to_end
from feedback.core.records import RunConfig, RowSpec
from feedback.bench import BENCH_PROMPT
t0=time.perf_counter()
lm = load_model("embedded", dtype="float32")
print("load", round(time.perf_counter()-t0,1), "s")
print(linear.kernel_summary(lm.kernels))
measured = lm.kernels
def all_of(name): return {k: {str(r): {"kernel": name} for r in linear.ROWS} for k in measured}
choices = {"measured": measured, "onednn": all_of("onednn"), "aten": all_of("aten")}
def step_cpu(rows):
    cfg = RunConfig(prompt=BENCH_PROMPT, max_new_tokens=48, rows=rows)
    t = time.process_time(); res = run_to_end(lm, cfg); 
    return (time.process_time()-t) / len(res.rows[0].token_ids) * 1000
res = {k: {1: [], 2: []} for k in choices}
for rnd in range(4):
    for name, ch in choices.items():
        linear.use_measured(lm.model, ch)
        res[name][1].append(step_cpu([RowSpec("b")]))
        res[name][2].append(step_cpu([RowSpec("b"), RowSpec("f", "residual")]))
for name in choices:
    print(name, {r: round(statistics.median(v), 1) for r, v in res[name].items()})
for r in (1, 2):
    print(r, "measured/onednn", [round(a/b, 3) for a, b in zip(res["measured"][r], res["onednn"][r])], "aten/onednn", [round(a/b,3) for a,b in zip(res["aten"][r], res["onednn"][r])])
