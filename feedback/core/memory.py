"""Memory readings: process RSS always; CUDA allocated/reserved/peak when a GPU is in use."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import psutil
import torch

_MB = 1024 * 1024


@dataclass
class MemorySample:
    t: float  # seconds since the run started
    rss_mb: float
    cuda_allocated_mb: float | None = None
    cuda_reserved_mb: float | None = None
    cuda_peak_mb: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def sample(t0: float | None = None, device: torch.device | None = None) -> MemorySample:
    """One reading; CUDA figures only when `device` is a CUDA device."""
    s = MemorySample(
        t=0.0 if t0 is None else time.perf_counter() - t0, rss_mb=psutil.Process().memory_info().rss / _MB
    )
    if device is not None and device.type == "cuda":
        s.cuda_allocated_mb = torch.cuda.memory_allocated(device) / _MB
        s.cuda_reserved_mb = torch.cuda.memory_reserved(device) / _MB
        s.cuda_peak_mb = torch.cuda.max_memory_allocated(device) / _MB
    return s
