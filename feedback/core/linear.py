"""fp32 linear layers on CPU through the kernel this machine runs fastest, measured.

PyTorch's CPU build sends an fp32 `nn.Linear` to MKL's GEMM. On the development CPU (AMD EPYC,
AVX-512) that kernel costs about as much per row as a separate product for small batches: a bare
2-row decode step took 1.8-2.4 x the CPU time of a 1-row step, 16 rows 3.2-3.6 x. oneDNN's brgemm
kernel — the one `torch.compile`'s CPU backend calls for linear layers,
`torch.ops.mkldnn._linear_pointwise` — reads the weights once for the whole batch: 2 rows 1.4 x,
16 rows 1.7-2.5 x, and one row is no slower. Its arithmetic is fp32 (a plain call takes no bf16
down-conversion; `FEEDBACK_FAST_MATMUL` is what allows one); logits differ from MKL's by float
rounding only (at most 1.2e-4 over a prompt's vocabulary, the order of a different batch size).

Which kernel is faster depends on the CPU and on the rows in hand: on an Intel Xeon (2 vCPU) MKL's
took 0.82 x oneDNN's CPU time at one row, and on the AMD EPYC a 1-row decode step with MKL's took
0.86-0.98 x the oneDNN step while two rows took 1.24-1.32 x. `FEEDBACK_LINEAR=measure` chooses by
measurement: for each shape of the model's fp32 linear layers both kernels are timed at 1, 2, 4
and 8 rows on this machine (`measure_kernels`), and each layer then calls the faster one for the
rows in hand (`MeasuredLinear`); the choice is cached per CPU model, thread count and torch version
under the model cache (`kernels/`). It is not the default: a row alone and the same row in a batch
then go through different kernels, whose rounding differs by more than the engine's exactness
checks allow (a row batched equals the row alone within 1e-5 on the test models; measured 1.0e-5
and, on the real model, 2.3e-4 against 2e-4), where oneDNN's kernel keeps them within it.

`FEEDBACK_LINEAR`: `onednn` (unset: every layer), `measure` (above), `aten` (PyTorch's own kernel:
what ran before oneDNN, for comparison).
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

LINEAR_ENV = "FEEDBACK_LINEAR"
CHOICES = ("onednn", "measure", "aten")
ROWS = (1, 2, 4, 8)  # the batch sizes timed; more rows take the 8-row choice (a prefill, a wide batch)


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _aten(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return nn.functional.linear(x, weight, bias)


KERNELS: dict[str, Callable] = {"onednn": _onednn, "aten": _aten}


class OneDnnLinear(nn.Linear):
    """An `nn.Linear` whose forward is oneDNN's fp32 product (same parameters, hooks and state)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.requires_grad:  # the fused op has no backward; autograd keeps PyTorch's own
            return super().forward(x)
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def setting(given: str | None = None) -> str:
    """The fp32 linear kernel: `given` (a `load_model` argument), else FEEDBACK_LINEAR, else onednn;
    one outside CHOICES refused naming where it came from and the choices."""
    from feedback.errors import FeedbackError

    where = "linear_kernel" if given else LINEAR_ENV
    value = (given or os.environ.get(LINEAR_ENV, "")).strip().lower() or "onednn"
    if value not in CHOICES:
        raise FeedbackError(f"{where} must be one of {', '.join(CHOICES)}; got {value!r}")
    return value


def wanted(device: torch.device, choice: bool | str | None = None) -> bool:
    """A kernel other than PyTorch's own on CPU, where oneDNN is in this torch: as `choice` says
    (a bool, or a FEEDBACK_LINEAR value), else (None) unless FEEDBACK_LINEAR=aten."""
    if choice is None:
        choice = setting()
    if isinstance(choice, str):
        choice = choice != "aten"
    return choice and device.type == "cpu" and available()


class MeasuredLinear(nn.Linear):
    """An `nn.Linear` whose product goes through the kernel measured fastest on this machine for its
    shape and the rows in hand (`kernels`: one per entry of ROWS; same parameters, hooks, state)."""

    kernels: tuple[Callable, ...]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.requires_grad:  # the fused op has no backward; autograd keeps PyTorch's own
            return super().forward(x)
        rows = x.numel() // self.in_features
        pick = 0 if rows <= 1 else 1 if rows <= 2 else 2 if rows <= 4 else 3
        return self.kernels[pick](x, self.weight, self.bias)


def _plain_fp32(model: nn.Module) -> list[nn.Linear]:
    return [
        m
        for m in model.modules()
        if type(m) in (nn.Linear, OneDnnLinear, MeasuredLinear)
        and not getattr(m, "folded", False)  # a part of a fused projection (core.lean), never called
        and m.weight.dtype == torch.float32
        and m.weight.device.type == "cpu"
    ]


def shape_key(module: nn.Linear) -> str:
    return f"{module.in_features}x{module.out_features}{'+bias' if module.bias is not None else ''}"


COLD_BYTES = 64 * 2**20  # weights cycled through while timing: more than a CPU's last-level cache


def _time(fn: Callable, x: torch.Tensor, weights: list[tuple], clock: Callable[[], float]) -> float:
    """Seconds a call takes: the best of 5 trials of enough calls to fill ~5 ms each, each call on
    the next of `weights` ((weight, bias) copies), so that, as in a decode step that reads every
    layer in turn, the weights come from memory rather than from a cache that kept them."""
    with torch.inference_mode():
        for w, b in weights[:2]:
            fn(x, w, b)
        start, calls = clock(), 0
        while clock() - start < 0.005 or calls < 2:
            w, b = weights[calls % len(weights)]
            fn(x, w, b)
            calls += 1
        best = float("inf")
        for _ in range(5):
            start = clock()
            for i in range(calls):
                w, b = weights[i % len(weights)]
                fn(x, w, b)
            best = min(best, (clock() - start) / calls)
        return best


def _cold_copies(module: nn.Linear) -> list[tuple]:
    """The module's (weight, bias), and copies of them up to COLD_BYTES in all (at most 64)."""
    size = module.weight.numel() * module.weight.element_size()
    n = max(1, min(64, -(-COLD_BYTES // size)))
    pairs = [(module.weight, module.bias)]
    for _ in range(n - 1):
        bias = None if module.bias is None else module.bias.detach().clone()
        pairs.append((module.weight.detach().clone(), bias))
    return pairs


def measure_kernels(
    modules: list[nn.Linear], clock: Callable[[], float] = time.process_time
) -> dict[str, dict[str, dict]]:
    """For each distinct shape among `modules` and each entry of ROWS: every kernel's seconds per
    call (CPU time of the process: every thread; best of 5 trials; weights read from memory, not
    from cache: `_time`) and the fastest. Returns {shape: {rows: {"kernel": name, "seconds": {name: s}}}}."""
    out: dict[str, dict[str, dict]] = {}
    for module in modules:
        key = shape_key(module)
        if key in out:
            continue
        out[key] = {}
        weights = _cold_copies(module)
        for rows in ROWS:
            x = torch.randn(rows, module.in_features)
            seconds = {name: _time(fn, x, weights, clock) for name, fn in KERNELS.items()}
            out[key][str(rows)] = {"kernel": min(seconds, key=seconds.get), "seconds": seconds}
    return out


def cpu_name() -> str:
    """The CPU this runs on, as /proc/cpuinfo names it (else what `platform` says)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "?"


def machine_key() -> str:
    """The CPU model, the threads torch uses and the torch version: what a measured choice holds for."""
    slug = re.sub(r"[^a-z0-9]+", "-", cpu_name().lower()).strip("-") or "cpu"
    return f"{slug}-t{torch.get_num_threads()}-torch{torch.__version__}"


def _cache_file() -> Path:
    from feedback.core.embedded import cache_root

    return cache_root() / "kernels" / f"{machine_key()}.json"


def chosen_kernels(modules: list[nn.Linear], clock: Callable[[], float] = time.process_time) -> dict:
    """The measured choice for these modules' shapes: read from this machine's cache file, the
    shapes it lacks measured now and written back (a failure to write is only a lost cache)."""
    path = _cache_file()
    try:
        known = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        known = {}
    missing = [m for m in modules if shape_key(m) not in known]
    if missing:
        known |= measure_kernels(missing, clock)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(known, indent=1), encoding="utf-8")
            os.replace(tmp, path)
        except OSError:
            pass
    return {shape_key(m): known[shape_key(m)] for m in modules}


def use_measured(model: nn.Module, choice: dict | None = None) -> dict:
    """Every plain fp32 CPU linear of `model` as a `MeasuredLinear` calling the kernel `choice`
    (None: `chosen_kernels`, measured or cached) names for its shape and rows; returns the choice.
    Parameters stop requiring gradients, as with `use_onednn`."""
    modules = _plain_fp32(model)
    choice = chosen_kernels(modules) if choice is None else choice
    model.requires_grad_(False)
    for module in modules:
        table = choice[shape_key(module)]
        module.__class__ = MeasuredLinear
        module.kernels = tuple(KERNELS[table[str(rows)]["kernel"]] for rows in ROWS)
    return choice


def kernel_summary(choice: dict) -> str:
    """One line: each shape's kernel per row count, e.g. "576x49152: onednn 1-8 rows"."""
    parts = []
    for shape, table in choice.items():
        names = [table[str(r)]["kernel"] for r in ROWS]
        if len(set(names)) == 1:
            parts.append(f"{shape}: {names[0]}")
        else:
            parts.append(f"{shape}: " + ", ".join(f"{n} at {r}" for r, n in zip(ROWS, names)))
    return "; ".join(parts)


def use_onednn(model: nn.Module) -> int:
    """Turn every plain fp32 CPU `nn.Linear` of `model` (`_plain_fp32`) into a `OneDnnLinear` in place
    (quantised or other linear subclasses are left alone); returns how many. Parameters stop
    requiring gradients: the engine only runs inference, and the fused op has no backward."""
    model.requires_grad_(False)
    modules = _plain_fp32(model)
    for module in modules:
        module.__class__ = OneDnnLinear
    return len(modules)


INT8_LABEL = "int8 weights, output head included (per-channel scales, bf16 activations; CPU)"
INT4_LABEL = "int4 weights (groups of 32, bf16 activations; int8 output head; CPU)"
INT4_GROUP = 32  # inputs per scale and offset: the block of the embedded GGUF's Q4_1 weights


class WeightOnlyLinear(nn.Module):
    """A linear layer whose weights are stored quantised, its product (`product`, a packed kernel)
    taken on bf16 activations, the result returned in the input's dtype. The fast kernels take
    bf16: fed fp32 they measured 4-10 x slower."""

    def __init__(self, source: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = source.in_features, source.out_features
        self.bias = (
            None if source.bias is None else nn.Parameter(source.bias.detach().clone(), requires_grad=False)
        )

    def product(self, flat: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        out = self.product(flat).reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        return out + self.bias if self.bias is not None else out


class Int8WeightLinear(WeightOnlyLinear):
    """Weights as int8 with one scale per output channel, products by
    `torch.ops.aten._weight_int8pack_mm` (the int8 weight-only kernel gpt-fast uses on CPU). A
    quarter of fp32's bytes read per step, and the kernel's cost hardly grows from one row to a few."""

    def __init__(self, source: nn.Linear):
        super().__init__(source)
        weight = source.weight.detach().float()
        scales = weight.abs().amax(dim=1).clamp_min(1e-12) / 127.0
        self.register_buffer("qweight", torch.round(weight / scales[:, None]).clamp(-128, 127).to(torch.int8))
        self.register_buffer("scales", scales.to(torch.bfloat16))

    def product(self, flat: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(flat, self.qweight, self.scales)


class Int4WeightLinear(WeightOnlyLinear):
    """Weights as 4-bit codes in groups of INT4_GROUP inputs, each group with its own scale and
    offset (min to max in 15 steps, as GGUF's Q4_1 stores them), products by
    `torch.ops.aten._weight_int4pack_mm_for_cpu`. An eighth of fp32's bytes. On the embedded model,
    whose weights are Q4_1 blocks of the same 32 inputs, the codes come back as they were shipped
    (only the scales and offsets are rounded to bf16)."""

    def __init__(self, source: nn.Linear):
        super().__init__(source)
        weight = source.weight.detach().float()
        groups = weight.reshape(self.out_features, -1, INT4_GROUP)
        low, high = groups.amin(dim=-1, keepdim=True), groups.amax(dim=-1, keepdim=True)
        scales = ((high - low) / 15).clamp_min(1e-12)
        codes = torch.round((groups - low) / scales).clamp(0, 15).reshape(self.out_features, -1)
        # the kernel computes (code - 8) * scale + offset: the offset is the value of code 8
        offsets = low + 8 * scales
        pairs = torch.cat([scales, offsets], dim=-1).transpose(0, 1).contiguous()  # [groups, out, 2]
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
        self.register_buffer("packed", packed)
        self.register_buffer("scales", pairs.to(torch.bfloat16))

    def product(self, flat: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, INT4_GROUP, self.scales)


def quantize(model: nn.Module, bits: int) -> int:
    """The model's linear layers quantised in place: the decoder's as `Int8WeightLinear` (bits 8) or
    `Int4WeightLinear` (bits 4; a layer whose inputs are not a multiple of INT4_GROUP stays int8),
    and the output head as `Int8WeightLinear`: in fp32 it was half of the bytes an int8 step read.
    A tied input embedding keeps its fp32 table (a step reads one row of it). Returns how many."""
    head = model.get_output_embeddings()
    targets = [(name, module) for name, module in model.named_modules() if type(module) is nn.Linear]
    for name, module in targets:
        four = bits == 4 and module is not head and module.in_features % INT4_GROUP == 0
        parent, _, attr = name.rpartition(".")
        setattr(
            model.get_submodule(parent) if parent else model,
            attr,
            Int4WeightLinear(module) if four else Int8WeightLinear(module),
        )
    return len(targets)
