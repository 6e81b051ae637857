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


def wanted(device: torch.device, choice: bool | None = None) -> bool:
    """oneDNN's linear on CPU where oneDNN is in this torch: as `choice` says, else (None) unless
    FEEDBACK_LINEAR=aten."""
    if choice is None:
        choice = os.environ.get(LINEAR_ENV, "").strip().lower() != "aten"
    return choice and device.type == "cpu" and available()


def use_onednn(model: nn.Module) -> int:
    """Turn every plain fp32 `nn.Linear` of `model` into a `OneDnnLinear` in place (quantised or
    other linear subclasses are left alone); returns how many. Parameters stop requiring gradients:
    the engine only runs inference, and the fused op has no backward."""
    model.requires_grad_(False)
    changed = 0
    for module in model.modules():
        if (
            type(module) is nn.Linear
            and module.weight.dtype == torch.float32
            and module.weight.device.type == "cpu"
        ):
            module.__class__ = OneDnnLinear
            changed += 1
    return changed


INT8_LABEL = "int8 weights (per-channel scales, bf16 activations; CPU)"


class Int8WeightLinear(nn.Module):
    """A linear layer whose weights are int8 with one scale per output channel, its products taken
    by `torch.ops.aten._weight_int8pack_mm` (the int8 weight-only kernel gpt-fast uses on CPU) on
    bf16 activations; the result goes back to the input's dtype. A quarter of fp32's bytes read
    per step, and the kernel's cost hardly grows from one row to a few."""

    def __init__(self, source: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = source.in_features, source.out_features
        weight = source.weight.detach().float()
        scales = weight.abs().amax(dim=1).clamp_min(1e-12) / 127.0
        self.register_buffer("qweight", torch.round(weight / scales[:, None]).clamp(-128, 127).to(torch.int8))
        self.register_buffer("scales", scales.to(torch.bfloat16))
        self.bias = (
            None if source.bias is None else nn.Parameter(source.bias.detach().clone(), requires_grad=False)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        out = torch.ops.aten._weight_int8pack_mm(flat, self.qweight, self.scales)
        out = out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        return out + self.bias if self.bias is not None else out


def quantize_int8(model: nn.Module) -> int:
    """The decoder's linear layers as `Int8WeightLinear` (the output head stays fp32: the logits keep
    their precision, and whatever reads the head's weight still finds it). Returns how many changed."""
    head = model.get_output_embeddings()
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if type(module) is nn.Linear and module is not head
    ]
    for name, module in targets:
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, Int8WeightLinear(module))
    return len(targets)
