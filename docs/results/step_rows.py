"""Bare decode steps of one and two rows on the engine's cache (`threads.bare_step_seconds`: no
sampling, metrics or hooks; 66 prompt tokens, 16 steps, the best of 3), exact fp32, int4 and int8,
at 1 thread: CPU ms, on one line. To compare two commits, run it in a checkout of each, in turn,
a few times each (the host's speed moves between runs more than between the two).

Run:
  OMP_WAIT_POLICY=PASSIVE PYTHONPATH=. .venv/bin/python docs/results/step_rows.py
"""

import time

import torch

from feedback.core import threads
from feedback.core.model import load_model

torch.set_num_threads(1)
ids = torch.arange(1, 67)[None]
out = []
for label, kwargs in (("fp32", {}), ("int4", {"load_in_4bit": True}), ("int8", {"load_in_8bit": True})):
    lm = load_model("embedded", dtype="float32", **kwargs)
    for rows in (1, 2):
        best = min(
            threads.bare_step_seconds(lm.model, ids, rows, 16, 1, time.process_time, True) for _ in range(3)
        )
        out.append(f"{label} {rows} row(s) {best * 1e3:.2f}")
print(", ".join(out))
