"""The compiled SiLU (`layer.c`, `feedback_silu`) against PyTorch's `nn.functional.silu` on every fp32
value (all 2^32 bit patterns, NaNs compared as NaNs), at 1 thread, in pieces PyTorch runs in one
part, at the block `lean._silu_block` chose here. Prints the count of values whose bits differ.

Run (about 90 s; its output is silu_exhaustive.txt):
  PYTHONPATH=. python docs/results/silu_exhaustive.py
"""

import time

import torch

from feedback.core import gemv, lean

torch.set_num_threads(1)
lib, block = gemv.library(), lean._silu_block()
print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}, block {block}")
PIECE = lean.SILU_GRAIN // 2  # PyTorch runs a piece this size in one part, as the compiled SiLU does
CHUNK = PIECE * 2048
differ, start = 0, time.perf_counter()
for first in range(0, 1 << 32, CHUNK):
    x = torch.arange(first, first + CHUNK, dtype=torch.int64).to(torch.int32).view(torch.float32)
    want = torch.cat([torch.nn.functional.silu(piece) for piece in x.split(PIECE)])
    got = x.clone()
    for piece in got.split(PIECE):
        lib.feedback_silu(piece.data_ptr(), piece.numel(), block)
    same = (got.view(torch.int32) == want.view(torch.int32)) | (got.isnan() & want.isnan())
    differ += int((~same).sum())
print(f"values whose bits differ: {differ} of {1 << 32} ({time.perf_counter() - start:.0f} s)")
