"""The products of one decode step by each fp32 kernel: every linear layer of the embedded model in
turn (the lean layer's shapes: q/k/v fused 576x960, o 576x576, gate/up fused 576x3072, down
1536x576, x 30 layers, and the 576x49152 head), 1 to 16 rows, CPU time, best of 5 passes, weights
read from memory (513 MB, more than any cache). gemv = feedback/core/gemv.c, oneDNN =
torch.ops.mkldnn._linear_pointwise, MKL = torch.nn.functional.linear.

Run: OMP_WAIT_POLICY=PASSIVE PYTHONPATH=. .venv/bin/python docs/results/gemv_kernels.py [threads]
"""
import sys
import time

import torch

from feedback.core import gemv, linear

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]
weights = [torch.randn(o, i) for o, i in shapes]
gb = sum(w.numel() * 4 for w in weights) / 1e9
kernels = {
    "gemv": lambda x, w: gemv.product(x, w, None),
    "oneDNN": lambda x, w: linear._onednn(x, w, None),
    "MKL": lambda x, w: torch.nn.functional.linear(x, w),
}
print(f"CPU {linear.cpu_name()}, {torch.get_num_threads()} thread(s), {gb * 1e3:.0f} MB of weights a step")
with torch.inference_mode():
    for rows in (1, 2, 3, 4, 8, 16):
        xs = {i: torch.randn(rows, i) for i in (576, 1536)}
        line = []
        for name, fn in kernels.items():
            best = float("inf")
            for _ in range(5):
                start = time.process_time()
                for w in weights:
                    fn(xs[w.shape[1]], w)
                best = min(best, time.process_time() - start)
            line.append(f"{name} {best * 1e3:6.1f} ms ({gb / best:4.1f} GB/CPU-s)")
        print(f"rows {rows:2}: " + "; ".join(line))
