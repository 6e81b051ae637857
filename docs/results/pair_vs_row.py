"""The bench's raw_batch2_vs_batch1 alone: a bare decode step of 2 rows (a baseline and a feedback
row) ÷ 1 row, CPU time, the two in turn over 5 rounds of 32 tokens, at 2 threads and at 1.

Run: OMP_WAIT_POLICY=PASSIVE PYTHONPATH=. .venv/bin/python docs/results/pair_vs_row.py
"""
import torch
from feedback.core.model import load_model
from feedback.bench import ratio, _raw_step_s
lm = load_model("embedded")
_raw_step_s(lm, 2, 4)
for threads in (2, 1):
    torch.set_num_threads(threads)
    r = ratio(lambda: _raw_step_s(lm, 2, 32), lambda: _raw_step_s(lm, 1, 32), 5)
    print(f"threads {threads}: {r.median:.3f} [{r.low:.3f}-{r.high:.3f}], {r.a * 1e3:.1f} / {r.b * 1e3:.1f} ms")
