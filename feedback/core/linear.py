"""fp32 linear layers through oneDNN on CPU.

PyTorch's CPU build sends an fp32 `nn.Linear` to MKL's GEMM. On the development CPU (AMD EPYC,
AVX-512) that kernel costs about as much per row as a separate product for small batches: a bare
2-row decode step took 1.8-2.4 x the CPU time of a 1-row step, 16 rows 3.2-3.6 x. oneDNN's brgemm
kernel — the one `torch.compile`'s CPU backend calls for linear layers,
`torch.ops.mkldnn._linear_pointwise` — reads the weights once for the whole batch: 2 rows 1.4 x,
16 rows 1.7-2.5 x, and one row is no slower. Its arithmetic is fp32 (a plain call takes no bf16
down-conversion; `FEEDBACK_FAST_MATMUL` is what allows one); logits differ from MKL's by float
rounding only (at most 1.2e-4 over a prompt's vocabulary, the order of a different batch size).

`FEEDBACK_LINEAR=aten` keeps PyTorch's own kernel (what ran before, for comparison).
"""
from __future__ import annotations

import os

import torch
from torch import nn

LINEAR_ENV = "FEEDBACK_LINEAR"


class OneDnnLinear(nn.Linear):
    """An `nn.Linear` whose forward is oneDNN's fp32 product (same parameters, hooks and state)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.requires_grad:  # the fused op has no backward; autograd keeps PyTorch's own
            return super().forward(x)
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def wanted(device: torch.device) -> bool:
    """oneDNN's linear on CPU unless FEEDBACK_LINEAR=aten (or oneDNN is missing from this torch)."""
    choice = os.environ.get(LINEAR_ENV, "").strip().lower()
    return device.type == "cpu" and choice != "aten" and available()


def use_onednn(model: nn.Module) -> int:
    """Turn every plain fp32 `nn.Linear` of `model` into a `OneDnnLinear` in place (quantised or
    other linear subclasses are left alone); returns how many. Parameters stop requiring gradients:
    the engine only runs inference, and the fused op has no backward."""
    model.requires_grad_(False)
    changed = 0
    for module in model.modules():
        if type(module) is nn.Linear and module.weight.dtype == torch.float32 and module.weight.device.type == "cpu":
            module.__class__ = OneDnnLinear
            changed += 1
    return changed
