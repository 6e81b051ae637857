"""fp32 linear layers on CPU through the kernel this machine runs fastest, measured, and exact.

Three kernels can take an fp32 `nn.Linear` on CPU:
- `gemv` (`feedback.core.gemv`): a plain streaming kernel compiled here, one fixed-order dot product
  per output, so a row's result is bit-for-bit the same alone or in any batch. Built for few rows:
  its cost grows with every row, where a GEMM's hardly does.
- `onednn`: oneDNN's brgemm kernel (`torch.ops.mkldnn._linear_pointwise`, the one `torch.compile`'s
  CPU backend calls), which reads the weights once for a whole batch and keeps a row batched within
  float rounding of the row alone (1e-5 on the test models).
- `aten`: PyTorch's own (MKL's GEMM), for comparison: on the development CPU (AMD EPYC) it costs
  about a separate product per row (2 rows 1.8-2.4 x one row).

Measured there (1 thread, every linear layer of the embedded model in turn, weights read from
memory; docs/results/gemv_kernels.txt): a step's products took 22.4 ms by gemv, 38.5 by oneDNN, 43.5
by MKL at one row; 24.8 / 49.0 / 80.6 at two; at 8 rows gemv was 0.89 x oneDNN and at 16 rows 1.4 x
it. The ordering is the CPU's: on an Intel Xeon MKL's product took 0.82 x oneDNN's at one row.

So by default (`auto`) the choice is measured on this machine, per weight shape: gemv and oneDNN are
timed at 1, 2, 4, 8 and 16 rows (`measure_kernels`; CPU time, weights cycled through more than a
last-level cache) and a layer then takes gemv up to the most rows at which it was faster at every
measured count, oneDNN above (`GemvLinear.gemv_rows`). The decoder's layers are chosen by the whole
decode step instead (`use_step_kernels`): with all of a layer's products compiled the layer runs in
compiled calls (`core.lean`), which a product timed alone does not show, so the step is timed with
them and without. The quantised modes' layers (`Int8WeightLinear`, `Int4WeightLinear`) are chosen
the same way, between their compiled products (`feedback/core/quant.c`) and PyTorch's packed ones. A
prefill, and a batch past that size, go to oneDNN. Every row count up to the crossover runs the same
kernel, so the shared decode of a few rows stays bit-for-bit the rows alone. Layers under
SMALL_BYTES of weights are not timed: a product that small costs microseconds either way, and gemv
keeps it batch-exact. The choice is cached per CPU model, thread count, torch version and kernel
source under the model cache (`kernels/`); delete that folder to measure again. Where gemv cannot be
built (`feedback.core.gemv.why_not`: no C compiler, not x86-64 with AVX2), `auto` is oneDNN
everywhere. Whether the compiled products ask for their weights ahead of their reads is timed once
per machine too (`choose_ahead`): it paid on an Intel Xeon and cost on an AMD EPYC; so is whether
the quantised products run 512-bit loops where the CPU has AVX-512 (the same bits either way).

`FEEDBACK_LINEAR`: `auto` (unset), `gemv` (gemv up to GEMV_MAX_ROWS rows for every layer, not
measured; refused where it cannot be built), `onednn`, `aten`.
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

from feedback.core import gemv

LINEAR_ENV = "FEEDBACK_LINEAR"
CHOICES = ("auto", "gemv", "onednn", "aten")
ROWS = (1, 2, 4, 8, 16)  # the batch sizes timed
GEMV_MAX_ROWS = ROWS[-1]  # more rows than this always take oneDNN (a prefill, a wide batch)
SMALL_BYTES = 2**20  # layers with fewer weight bytes take gemv untimed (above)


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


KERNELS: dict[str, Callable] = {"gemv": gemv.product, "onednn": _onednn}  # the candidates timed


class OneDnnLinear(nn.Linear):
    """An `nn.Linear` whose forward is oneDNN's fp32 product (same parameters, hooks and state)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.requires_grad:  # the fused op has no backward; autograd keeps PyTorch's own
            return super().forward(x)
        return _onednn(x, self.weight, self.bias)


class GemvLinear(nn.Linear):
    """An `nn.Linear` whose product is gemv's for up to `gemv_rows` rows and oneDNN's above (same
    parameters, hooks and state)."""

    gemv_rows: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.requires_grad:  # neither kernel has a backward; autograd keeps PyTorch's own
            return super().forward(x)
        if x.dtype == torch.float32 and x.numel() <= self.gemv_rows * self.in_features:
            return gemv.product(x, self.weight, self.bias)
        return _onednn(x, self.weight, self.bias)

    def matrix(self) -> gemv.Matrix:
        """The weights as the compiled decode step reads them."""
        return gemv.Matrix(w=self.weight.data_ptr(), b=_bias_ptr(self), kind=0)


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def setting(given: str | None = None) -> str:
    """The fp32 linear kernel: `given` (a `load_model` argument), else FEEDBACK_LINEAR, else auto;
    one outside CHOICES refused naming where it came from and the choices."""
    from feedback.errors import FeedbackError

    where = "linear_kernel" if given else LINEAR_ENV
    value = (given or os.environ.get(LINEAR_ENV, "")).strip().lower() or "auto"
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


def _plain_fp32(model: nn.Module) -> list[nn.Linear]:
    return [
        m
        for m in model.modules()
        if type(m) in (nn.Linear, OneDnnLinear, GemvLinear)
        and not getattr(m, "folded", False)  # a part of a fused projection (core.lean), never called
        and m.weight.dtype == torch.float32
        and m.weight.device.type == "cpu"
    ]


def shape_key(module: nn.Linear) -> str:
    return f"{module.in_features}x{module.out_features}{'+bias' if module.bias is not None else ''}"


def _small(module: nn.Linear) -> bool:
    return module.in_features * module.out_features * 4 < SMALL_BYTES


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
    pairs = [(module.weight.detach(), None if module.bias is None else module.bias.detach())]
    for _ in range(n - 1):
        bias = None if module.bias is None else module.bias.detach().clone()
        pairs.append((module.weight.detach().clone(), bias))
    return pairs


def gemv_rows(seconds: dict[str, dict[str, float]]) -> int:
    """The most rows of ROWS up to which gemv was faster at every measured count (0: not at one)."""
    most = 0
    for rows in ROWS:
        s = seconds[str(rows)]
        if s["gemv"] >= s["onednn"]:
            break
        most = rows
    return most


def measure_kernels(
    modules: list[nn.Linear], clock: Callable[[], float] = time.process_time
) -> dict[str, dict]:
    """For each distinct shape among `modules`: every kernel's seconds per call at each of ROWS (CPU
    time of the process: every thread; best of 5 trials; weights read from memory, not from cache:
    `_time`) and the rows gemv then takes (`gemv_rows`).
    Returns {shape: {"gemv_rows": n, "seconds": {rows: {kernel: s}}}}."""
    out: dict[str, dict] = {}
    for module in modules:
        key = shape_key(module)
        if key in out:
            continue
        weights = _cold_copies(module)
        seconds = {}
        for rows in ROWS:
            x = torch.randn(rows, module.in_features)
            seconds[str(rows)] = {name: _time(fn, x, weights, clock) for name, fn in KERNELS.items()}
        out[key] = {"gemv_rows": gemv_rows(seconds), "seconds": seconds}
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
    """The CPU model, the threads torch uses, the torch version and gemv's source: what a measured
    choice holds for."""
    slug = re.sub(r"[^a-z0-9]+", "-", cpu_name().lower()).strip("-") or "cpu"
    return f"{slug}-t{torch.get_num_threads()}-torch{torch.__version__}-gemv{gemv.source_key()}"


def cache_file(name: str) -> Path:
    """This machine's file `name`-<machine_key>.json in the model cache's `kernels/`."""
    from feedback.core.embedded import cache_root

    return cache_root() / "kernels" / f"{name}{machine_key()}.json"


def remembered(path: Path, keys: list[str], measure: Callable[[list[str]], dict]) -> dict:
    """{key: entry} for `keys`, read from the JSON file `path`; the keys it lacks `measure`d now
    and written back (whole or not at all: a failure to write only loses the cache)."""
    try:
        known = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        known = {}
    missing = [k for k in keys if k not in known]
    if missing:
        known |= measure(missing)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(known, indent=1), encoding="utf-8")
            os.replace(tmp, path)
        except OSError:
            pass
    return {k: known[k] for k in keys}


def chosen_kernels(modules: list[nn.Linear], clock: Callable[[], float] = time.process_time) -> dict:
    """The measured choice for these modules' shapes (SMALL_BYTES ones: gemv up to GEMV_MAX_ROWS,
    untimed), remembered per machine (`remembered`)."""
    small = {shape_key(m): {"gemv_rows": GEMV_MAX_ROWS, "seconds": None} for m in modules if _small(m)}
    timed = {shape_key(m): m for m in modules if not _small(m)}
    measured = remembered(
        cache_file(""), list(timed), lambda keys: measure_kernels([timed[k] for k in keys], clock)
    )
    return small | measured


def use_kernels(
    model: nn.Module, choice: str, measured: dict | None = None, stepped: list[nn.Module] = ()
) -> dict | None:
    """Every plain fp32 CPU `nn.Linear` of `model` (`_plain_fp32`; quantised or other linear
    subclasses are left alone) through the kernels `choice` (a FEEDBACK_LINEAR value) names, in
    place. `auto`: `GemvLinear`s with the rows measured here per shape (`measured`, else
    `chosen_kernels`), or `OneDnnLinear`s where gemv cannot be built; those among `stepped` (the
    decoder's, whose rows a decode step's timing chooses next: `use_step_kernels`) become
    `GemvLinear`s untimed, at 0 rows until then. `gemv`: `GemvLinear`s to GEMV_MAX_ROWS rows;
    `onednn`: `OneDnnLinear`s; `aten`: no change. Returns {shape: {"gemv_rows": n, ...}} for the
    layers timed or forced here, else None. Parameters stop requiring gradients: the engine only
    runs inference, and neither kernel has a backward."""
    from feedback.errors import FeedbackError

    if choice == "aten":
        return None
    model.requires_grad_(False)
    modules = _plain_fp32(model)
    if choice == "gemv" and not gemv.available():
        raise FeedbackError(f"linear_kernel gemv cannot run here: {gemv.why_not()}")
    exact = [m for m in modules if gemv.usable(m.weight, m.bias)]
    if choice == "onednn" or not exact or not gemv.available():
        for module in modules:
            module.__class__ = OneDnnLinear
        return None
    later = {id(m) for m in stepped} if choice == "auto" else set()
    if choice == "gemv":
        table = {shape_key(m): {"gemv_rows": GEMV_MAX_ROWS, "seconds": None} for m in exact}
    else:
        timed = [m for m in exact if id(m) not in later]
        table = measured if measured is not None else chosen_kernels(timed) if timed else {}
    takes = {id(m) for m in exact}
    for module in modules:
        if id(module) in later and id(module) in takes:
            module.__class__, module.gemv_rows = GemvLinear, 0
            continue
        rows = table[shape_key(module)]["gemv_rows"] if id(module) in takes else 0
        module.__class__ = GemvLinear if rows else OneDnnLinear
        module.gemv_rows = rows
    return table or None


def kernel_summary(choice: dict | None, setting_name: str = "") -> str:
    """One line: each shape's kernel by rows, e.g. "576x49152: gemv to 8 rows, oneDNN above"; for no
    table, the setting (and why gemv is not in use, where it is not)."""
    if not choice:
        why = gemv.why_not()
        name = setting_name or setting()
        return f"{'onednn' if name == 'auto' else name}" + (f" (gemv: {why})" if why else "")
    parts = []
    for shape, entry in choice.items():
        if "quantized" in entry:  # asking for weights ahead (`choose_ahead`): what was timed
            said = {
                k: f"{entry[k]} B ahead" if entry[k] else "not ahead" for k in ("one", "two", "quantized")
            }
            timed = entry.get("seconds") or {}
            loops = [f"{said['one']} at one row, {said['two']} at two"] if "gemv 1" in timed else []
            rows = entry.get("wide_from", 0)
            width = f"512-bit from {rows} row{'s' if rows > 1 else ''}" if rows else "256-bit"
            loops += (
                [f"{said['quantized']} by the quantised products ({width})"] if "quantized 1" in timed else []
            )
            parts.append("weights asked for " + ", ".join(loops))
            continue
        if "compiled_rows" in entry:  # the decoder's (`use_step_kernels`): one for all its layers
            rows = entry["compiled_rows"]
            parts.append(
                "decoder layers: "
                + ("PyTorch's kernels" if not rows else f"compiled to {rows} rows, PyTorch's kernels above")
            )
            continue
        rows = entry["gemv_rows"]
        parts.append(f"{shape}: " + ("oneDNN" if not rows else f"gemv to {rows} rows, oneDNN above"))
    return "; ".join(parts)


INT8_LABEL = "int8 weights, output head included (per-channel scales, bf16 activations; CPU)"
INT4_LABEL = "int4 weights (groups of 32, bf16 activations; int8 output head; CPU)"
INT4_GROUP = 32  # inputs per scale and offset: the block of the embedded GGUF's Q4_1 weights


class WeightOnlyLinear(nn.Module):
    """A linear layer whose weights are stored quantised, its product taken on bf16 activations and
    rounded to bf16 (then the bias added in the input's dtype): a packed PyTorch kernel (`packed`)
    for a prefill or a wide batch, and for a decode step's rows the compiled kernel of
    `feedback.core.quant.c` (`compiled`) in the same numerics, which reads each code once where the
    packed kernels are bound by arithmetic at one row. Up to `compiled_rows` rows (0: never) the
    compiled one, so a row's result is the same alone or among a decode step's rows. The packed
    kernels take bf16: fed fp32 they measured 4-10 x slower."""

    kind = 0  # feedback.core.gemv.Matrix's kind
    compiled_rows = 0  # set by use_step_kernels

    def __init__(self, source: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = source.in_features, source.out_features
        self.bias = (
            None if source.bias is None else nn.Parameter(source.bias.detach().clone(), requires_grad=False)
        )

    def packed(self, flat: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def matrix(self) -> gemv.Matrix:
        """The weights as the compiled kernels read them."""
        raise NotImplementedError

    def read(self, rows: int) -> list[torch.Tensor]:
        """The tensors a product of `rows` rows reads (a layout the other kernel reads left out)."""
        return [t for t in (*self.buffers(recurse=False), self.bias) if t is not None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() <= self.compiled_rows * self.in_features and x.dtype == torch.float32:
            return gemv.quantized_product(self.matrix(), x, self.out_features)
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        out = self.packed(flat).reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        return out + self.bias if self.bias is not None else out


def _bf16_bits(values: torch.Tensor) -> torch.Tensor:
    """bf16 values' raw 16-bit patterns, flat, with 8 zero patterns after the last (the compiled
    int4 kernel reads scales 8 at a time, past a row's last group)."""
    flat = values.to(torch.bfloat16).contiguous().view(torch.int16).reshape(-1)
    return torch.cat([flat, flat.new_zeros(8)])


class Int8WeightLinear(WeightOnlyLinear):
    """Weights as int8 with one scale per output channel, products by
    `torch.ops.aten._weight_int8pack_mm` (the int8 weight-only kernel gpt-fast uses on CPU) or the
    compiled int8 kernel, which reads the same codes and scales. A quarter of fp32's bytes."""

    kind = 8

    def __init__(self, source: nn.Linear):
        super().__init__(source)
        weight = source.weight.detach().float()
        scales = weight.abs().amax(dim=1).clamp_min(1e-12) / 127.0
        self.register_buffer("qweight", torch.round(weight / scales[:, None]).clamp(-128, 127).to(torch.int8))
        self.register_buffer("scales", scales.to(torch.bfloat16))

    def packed(self, flat: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(flat, self.qweight, self.scales)

    def matrix(self) -> gemv.Matrix:
        return gemv.Matrix(
            w=self.qweight.data_ptr(), s=self.scales.data_ptr(), b=_bias_ptr(self), kind=self.kind
        )


class Int4WeightLinear(WeightOnlyLinear):
    """Weights as 4-bit codes in groups of INT4_GROUP inputs, each group with its own scale and
    offset (min to max in 15 steps, as GGUF's Q4_1 stores them), products by
    `torch.ops.aten._weight_int4pack_mm_for_cpu` or the compiled int4 kernel. An eighth of fp32's
    bytes, held twice: packed for PyTorch's kernel and laid out for the compiled one (`codes`: a
    group's 16 bytes hold input j's code in byte j's low half, input j + 16's in its high half). On
    the embedded model, whose weights are Q4_1 blocks of the same 32 inputs, the codes come back as
    they were shipped (only the scales and offsets are rounded to bf16)."""

    kind = 4

    def __init__(self, source: nn.Linear):
        super().__init__(source)
        weight = source.weight.detach().float()
        groups = weight.reshape(self.out_features, -1, INT4_GROUP)
        low, high = groups.amin(dim=-1, keepdim=True), groups.amax(dim=-1, keepdim=True)
        scales = ((high - low) / 15).clamp_min(1e-12)
        codes = torch.round((groups - low) / scales).clamp(0, 15).to(torch.uint8)
        # the kernels compute (code - 8) * scale + offset: the offset is the value of code 8
        offsets = low + 8 * scales
        pairs = torch.cat([scales, offsets], dim=-1).transpose(0, 1).contiguous()  # [groups, out, 2]
        flat = codes.reshape(self.out_features, -1).to(torch.int32)
        self.register_buffer("packed_weight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(flat, 1))
        self.register_buffer("scales", pairs.to(torch.bfloat16))
        half = INT4_GROUP // 2
        self.register_buffer(
            "codes", (codes[..., :half] | (codes[..., half:] << 4)).reshape(self.out_features, -1)
        )
        self.register_buffer("group_scales", _bf16_bits(scales))
        self.register_buffer("group_offsets", _bf16_bits(offsets))

    def packed(self, flat: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed_weight, INT4_GROUP, self.scales)

    def read(self, rows: int) -> list[torch.Tensor]:
        compiled = rows <= self.compiled_rows
        names = ("codes", "group_scales", "group_offsets") if compiled else ("packed_weight", "scales")
        return [getattr(self, n) for n in names] + ([self.bias] if self.bias is not None else [])

    def matrix(self) -> gemv.Matrix:
        return gemv.Matrix(
            w=self.codes.data_ptr(),
            s=self.group_scales.data_ptr(),
            z=self.group_offsets.data_ptr(),
            b=_bias_ptr(self),
            kind=self.kind,
        )


def _bias_ptr(module: nn.Module) -> int | None:
    return None if module.bias is None else module.bias.data_ptr()


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


STEP_TRIALS = 2  # timings of a decode step per choice and row count (`measure_step_kernels`), the best kept


def compiled_rows(module: nn.Module) -> int:
    """The most rows a compiled kernel takes of this linear layer's product (0: none): gemv's for a
    `GemvLinear`, quant.c's for a quantised layer."""
    if type(module) is GemvLinear:
        return module.gemv_rows
    return module.compiled_rows if isinstance(module, WeightOnlyLinear) else 0


def _set_compiled_rows(modules: list[nn.Module], rows: int) -> None:
    for module in modules:
        if type(module) is GemvLinear:
            module.gemv_rows = rows
        else:
            module.compiled_rows = rows


def _product_name(module: nn.Module) -> str:
    """A linear layer's kind and shape, as a measured choice's key names it: "int4 576x960+bias"."""
    kind = {Int4WeightLinear: "int4", Int8WeightLinear: "int8"}.get(type(module), "fp32")
    return f"{kind} {module.in_features}x{module.out_features}" + ("+bias" if module.bias is not None else "")


def step_key(modules: list[nn.Module]) -> str:
    """What a decoder's measured choice holds for: each distinct kind and shape of its products."""
    return "decoder " + "; ".join(sorted({_product_name(m) for m in modules}))


def measure_step_kernels(modules: list[nn.Module], step_seconds: Callable[[int], float]) -> dict:
    """A decode step timed at each of ROWS rows (`step_seconds(rows)`: a bare step on the engine's
    cache) with the decoder's products (`modules`) compiled, against the same step with PyTorch's
    kernels (oneDNN's for fp32, the packed ones for the quantised modes), each count's two in turn,
    STEP_TRIALS times, the best of each kept. The choice is the step's, not a product's: with every
    product of a layer compiled, the layer runs in compiled calls (`core.lean`) and the step spares
    the Python between its operations, which a product timed alone does not show (on an Intel Xeon
    the loader's timing of the fp32 gate/up product alone was a tie, 308 against 310 µs, while a
    one-row step with the decoder compiled took 47.7 ms against 68.0: compiled_choices.txt in
    docs/results). Counts past the first where PyTorch's kernels were as fast are not timed.
    Returns {"compiled_rows": n, "seconds": {rows: {"compiled": s, "pytorch": s}}}."""
    seconds: dict[str, dict[str, float]] = {}
    most = 0
    try:
        for rows in ROWS:
            best = {"compiled": float("inf"), "pytorch": float("inf")}
            for _ in range(STEP_TRIALS):
                for name, n in (("compiled", rows), ("pytorch", 0)):
                    _set_compiled_rows(modules, n)
                    best[name] = min(best[name], step_seconds(rows))
            seconds[str(rows)] = best
            if best["compiled"] >= best["pytorch"]:
                break
            most = rows
    finally:
        _set_compiled_rows(modules, 0)
    return {"compiled_rows": most, "seconds": seconds}


def use_step_kernels(modules: list[nn.Module], step_seconds: Callable[[int], float]) -> dict | None:
    """The decoder's products (`modules`: its `GemvLinear`s, or its quantised layers) take the
    compiled kernels for up to the most rows at which a decode step was faster with them at every
    count (`measure_step_kernels`, remembered per machine and decoder shapes beside the products'
    choice; a decoder whose products are all under SMALL_BYTES of fp32 weights takes them untimed,
    up to GEMV_MAX_ROWS), PyTorch's kernels above. None where there is nothing to choose (no such
    product, or the library cannot be built here: the quantised layers keep the packed kernels).
    Returns {key: {"compiled_rows": n, "seconds": ...}}."""
    modules = [m for m in modules if type(m) is GemvLinear or isinstance(m, WeightOnlyLinear)]
    if not modules or not gemv.available():
        return None
    key = step_key(modules)
    if all(_small(m) for m in modules):
        entry = {"compiled_rows": GEMV_MAX_ROWS, "seconds": None}
    else:
        with torch.inference_mode():
            entry = remembered(
                cache_file("steps-"),
                [key],
                lambda keys: {keys[0]: measure_step_kernels(modules, step_seconds)},
            )[key]
    _set_compiled_rows(modules, entry["compiled_rows"])
    return {key: entry}


AHEAD_BYTES = 2048  # how far ahead gemv may ask for weights (`choose_ahead`)
QUANTIZED_AHEAD_BYTES = 4096  # how far ahead in int4 codes the quantised products may (quant.c)
AHEAD_TRIALS = 3


def _best(run: Callable[[], None], variants: dict, clock: Callable[[], float]) -> dict:
    """`run`'s best time of AHEAD_TRIALS under each variant (a function that sets it in the library),
    the variants in turn."""
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(AHEAD_TRIALS):
        for name, apply in variants.items():
            apply()
            start = clock()
            run()
            best[name] = min(best[name], clock() - start)
    return best


def measure_ahead(
    weights: list[torch.Tensor], quantized: list[nn.Module], clock: Callable[[], float] = time.process_time
) -> dict:
    """A decoder's products in turn (read from memory, as a step reads them) timed with the weights
    asked for ahead and without: gemv's at one and at two rows (its two loops: `weights`, fp32) and
    the quantised ones (`quantized`) at one row; then, where the CPU has them, the quantised products'
    512-bit loops against their 256-bit ones at one row and, where not faster there, at two. Returns
    {"one": bytes, "two": bytes, "quantized": bytes, "wide_from": rows, "seconds": {...}}: the
    distance where asking ahead was faster, else 0, and the rows from which the 512-bit loops were
    (0: never); set in the library. None of it changes a result."""
    out: dict = {"one": 0, "two": 0, "quantized": 0, "wide_from": 0, "seconds": {}}
    with torch.inference_mode():
        for rows, loop in ((1, "one"), (2, "two")) if weights else ():
            inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
            best = _best(
                lambda inputs=inputs: [gemv.product(inputs[w.shape[1]], w, None) for w in weights],
                {n: lambda n=n: gemv.set_ahead(n, n) for n in (0, AHEAD_BYTES)},
                clock,
            )
            out[loop] = min(best, key=best.get)
            out["seconds"][f"gemv {rows}"] = {str(k): v for k, v in best.items()}
        if quantized:
            products = [(m.matrix(), m.in_features, m.out_features) for m in quantized]

            def run(rows: int) -> Callable[[], None]:
                inputs = {m.in_features: torch.randn(rows, m.in_features) for m in quantized}
                return lambda: [gemv.quantized_product(mat, inputs[i], o) for mat, i, o in products]

            def narrow(n: int) -> Callable[[], None]:
                return lambda: (gemv.set_ahead(None, None, n), gemv.set_wide(0))

            best = _best(run(1), {n: narrow(n) for n in (0, QUANTIZED_AHEAD_BYTES)}, clock)
            out["quantized"] = min(best, key=best.get)
            out["seconds"]["quantized 1"] = {str(k): v for k, v in best.items()}
            for rows in (1, 2) if gemv.wide_usable() else ():
                widths = {
                    w: lambda w=w: (gemv.set_ahead(None, None, out["quantized"]), gemv.set_wide(w))
                    for w in (0, rows)
                }
                best = _best(run(rows), widths, clock)
                out["seconds"][f"512-bit {rows}"] = {"256": best[0], "512": best[rows]}
                if best[rows] < best[0]:
                    out["wide_from"] = rows
                    break
    _apply_ahead(out)
    return out


def _apply_ahead(entry: dict) -> None:
    """Sets what `entry` timed, and only that: a process can hold an fp32 model and a quantised one,
    each with its own products' entry."""
    timed = entry.get("seconds") or {}
    gemv_timed, quantized_timed = "gemv 1" in timed, "quantized 1" in timed
    gemv.set_ahead(
        entry["one"] if gemv_timed else None,
        entry["two"] if gemv_timed else None,
        entry["quantized"] if quantized_timed else None,
    )
    if quantized_timed:
        gemv.set_wide(entry.get("wide_from", 0))


def choose_ahead(modules: list[nn.Module], clock: Callable[[], float] = time.process_time) -> dict | None:
    """Whether the compiled products ask for weights ahead of their reads — gemv in its one-row and
    its two-row loop, the quantised modes' kernels — and whether the quantised ones take 256-bit or
    512-bit loops, timed on the decoder's products (`modules`; `measure_ahead`) and remembered per
    machine and shapes; set in the library. It changes no result. None (nothing set) where the
    library cannot run here or the products are all under SMALL_BYTES of fp32 weights (they stay in
    cache)."""
    fp32 = [
        m
        for m in modules
        if type(m) in (nn.Linear, GemvLinear, OneDnnLinear)
        and not getattr(m, "folded", False)
        and gemv.usable(m.weight, None)
    ]
    quantized = [m for m in modules if isinstance(m, WeightOnlyLinear)]
    if not gemv.available() or all(_small(m) for m in fp32 + quantized):
        return None
    weights = [m.weight.detach() for m in fp32]
    key = "ahead " + "; ".join(sorted({_product_name(m) for m in fp32 + quantized}))
    entry = remembered(
        cache_file("ahead-"), [key], lambda keys: {keys[0]: measure_ahead(weights, quantized, clock)}
    )[key]
    _apply_ahead(entry)
    return entry
