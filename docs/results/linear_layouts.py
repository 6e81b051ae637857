"""fp32 one-row products per shape of the embedded model, three ways: oneDNN and MKL on the usual
[out, in] weight, and MKL on the weight stored [in, out] (x @ W.t() then reads it contiguously).
CPU ms per call and GB read per CPU-second at 1, 2, 4 and 8 rows, the weights cycled through 64 MB
of copies so they come from memory (linear._time), one thread.

Run: OMP_WAIT_POLICY=PASSIVE PYTHONPATH=. .venv/bin/python docs/results/linear_layouts.py
"""
import time, torch
from torch import nn
from feedback.core import linear

torch.set_num_threads(1)
SHAPES = {"q,k,v fused": (960, 576), "o": (576, 576), "gate,up fused": (3072, 576), "down": (576, 1536), "head": (49152, 576)}
for label, (out_f, in_f) in SHAPES.items():
    module = nn.Linear(in_f, out_f, bias=False)
    usual = linear._cold_copies(module)
    stored_t = [(w.t().contiguous().t(), b) for w, b in usual]
    ways = {"oneDNN": (linear._onednn, usual), "MKL": (linear._aten, usual), "MKL, [in, out]": (linear._aten, stored_t)}
    gb = out_f * in_f * 4 / 1e9
    for rows in linear.ROWS:
        x = torch.randn(rows, in_f)
        cells = []
        for name, (fn, weights) in ways.items():
            s = linear._time(fn, x, weights, time.process_time)
            cells.append(f"{name} {s * 1e3:.3f} ms ({gb / s:.1f} GB/s)")
        print(f"{label:14} {out_f}x{in_f} rows {rows}: " + "; ".join(cells), flush=True)
