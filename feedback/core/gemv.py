"""The engine's compiled decode kernels: fp32 products of a few rows (`gemv.c`), the quantised
modes' int4 and int8 products (`quant.c`), a decode step's RMS norms, rotary embedding, cache write
and attention (`attend.c`), and whole layers in one call (`layer.c`), built on this machine into one
library.

A decode step multiplies one row (or a few: a baseline and its feedback rows, several visitors) by
every weight matrix of the model, so it is bound by reading the weights, and PyTorch's fp32 kernels
read them slowly there. Measured on the development CPU (AMD EPYC, 1 thread, every linear layer of
the embedded model in turn, weights from memory; docs/results/gemv_kernels.txt): oneDNN's product
took 38.5 ms a step at 1 row and 49.0 at 2, MKL's 43.5 and 80.6; this kernel 22.4 and 24.8, at the
machine's copy rate. llama.cpp's fp32 kernel is the same idea.

Each output is one dot product summed in one fixed order (`dot.h`), so a row's result is
bit-for-bit the same alone or in any batch and at any thread count: the shared decode's rows equal
the rows run alone, not only to rounding. The attention kernel keeps that too (`kvcache`).

The kernels need Linux on an x86-64 CPU with AVX2 and FMA, and a C compiler (`$CC`, else `cc`) the
first time: the library is built into the model cache (`kernels/`) in about a second and loaded
with ctypes. Where any of that is missing the linear layers keep oneDNN's kernel, the decode steps
PyTorch's operations, and `why_not` says why. Threads come from OpenMP, the runtime PyTorch already
loaded, at PyTorch's thread count.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).parent
# compiled into one library
SOURCES = (HERE / "gemv.c", HERE / "attend.c", HERE / "layer.c", HERE / "quant.c")
HEADERS = (HERE / "dot.h", HERE / "kernels.h")
FLAGS = ("-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
LIBS = ("-lm",)  # after the sources, where the linker looks for what they need (SiLU's expf)
COMPILE_TIMEOUT_S = 120


def source_key() -> str:
    """What a built kernel depends on: its source and flags (12 hex digits)."""
    digest = hashlib.sha256(
        b"".join(p.read_bytes() for p in SOURCES + HEADERS) + " ".join(FLAGS + LIBS).encode()
    )
    return digest.hexdigest()[:12]


class Matrix(ctypes.Structure):
    """`struct feedback_matrix` (kernels.h): a linear layer's weights as the compiled step reads
    them, `kind` 0 fp32 (gemv.c), 4 int4 or 8 int8 (quant.c; `feedback.core.linear`'s quantised
    layers)."""

    _fields_ = [*((name, ctypes.c_void_p) for name in "w s z b".split()), ("kind", ctypes.c_long)]


class Layer(ctypes.Structure):
    """`struct feedback_layer` (layer.c): one decoder layer's weights and cache for a decode step."""

    _fields_ = [
        *((name, ctypes.c_void_p) for name in "norm_w post_norm_w".split()),
        *((name, Matrix) for name in "qkv o gate_up down".split()),
        *((name, ctypes.c_void_p) for name in "k v".split()),
        *((name, ctypes.c_long) for name in "kb kh vb vh".split()),
        *((name, ctypes.c_float) for name in "eps post_eps scale".split()),
    ]


class Step(ctypes.Structure):
    """`struct feedback_step` (layer.c): what every layer of one decode step shares."""

    _fields_ = [
        *((name, ctypes.c_long) for name in "rows width heads kv_heads d inter lanes silu_block".split()),
        *((name, ctypes.c_void_p) for name in "cos sin".split()),
        *((name, ctypes.c_long) for name in "cs at".split()),
        ("keep", ctypes.c_void_p),
        ("mb", ctypes.c_long),
        ("threads", ctypes.c_int),
    ]


def _unsupported() -> str:
    """Why this machine cannot run the kernel, or "" where it can."""
    if sys.platform != "linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return f"it needs Linux on x86-64 (this is {sys.platform} on {platform.machine()})"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return f"it needs a CPU with AVX2 and FMA (PyTorch finds {capability})"
    return ""


def _compiler() -> str | None:
    given = os.environ.get("CC", "").strip()
    return shutil.which(given) if given else shutil.which("cc") or shutil.which("gcc")


def _build(target: Path, compiler: str) -> str:
    """Compile SOURCES into `target` (written whole or not at all); "" or why it failed."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        done = subprocess.run(
            [compiler, *FLAGS, *map(str, SOURCES), *LIBS, "-o", tmp],
            capture_output=True,
            text=True,
            timeout=COMPILE_TIMEOUT_S,
        )
        if done.returncode != 0:
            lines = (done.stderr or done.stdout).strip().splitlines() or ["no message"]
            return f"{Path(compiler).name} failed: {lines[-1]}"
        os.replace(tmp, target)
        return ""
    except (OSError, subprocess.SubprocessError) as e:
        return f"{Path(compiler).name} failed: {e}"
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def find(folder: Path) -> tuple[ctypes.CDLL | None, str]:
    """The library built in `folder` (built there first where it is not), or None and why not."""
    reason = _unsupported()
    if reason:
        return None, reason
    target = folder / f"decode-{source_key()}.so"
    if not target.exists():
        compiler = _compiler()
        if compiler is None:
            return None, "no C compiler found (set CC, or install gcc)"
        reason = _build(target, compiler)
        if reason:
            return None, reason
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as e:
        return None, f"the built kernel did not load: {e}"
    fn = lib.feedback_gemv
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_int]
    fn.restype = None
    fn = lib.feedback_attend
    pointer, size = ctypes.c_void_p, ctypes.c_long
    fn.argtypes = [pointer, size, size] + [pointer, size, size, size] * 2 + [pointer, size, pointer, pointer]
    fn.argtypes += [size] * 5 + [ctypes.c_float, ctypes.c_int]
    fn.restype = None
    fn = lib.feedback_rope_append
    fn.argtypes = [pointer] * 3 + [size] + [pointer, pointer, size, size, pointer, size, size] + [size] * 4
    fn.restype = None
    fn = lib.feedback_rms_norm
    fn.argtypes = [pointer] * 3 + [size] * 2 + [ctypes.c_float, size]
    fn.restype = None
    fn = lib.feedback_silu
    fn.argtypes = [pointer, size, size]
    fn.restype = None
    fn = lib.feedback_gemv_ahead
    fn.argtypes = [size, size]
    fn.restype = None
    fn = lib.feedback_quant_ahead
    fn.argtypes = [size]
    fn.restype = None
    fn = lib.feedback_quant_wide
    fn.argtypes = [size]
    fn.restype = size
    fn = lib.feedback_quant_wide_usable
    fn.argtypes = []
    fn.restype = ctypes.c_int
    fn = lib.feedback_product
    fn.argtypes = [ctypes.POINTER(Matrix), pointer, pointer, size, size, size, pointer, ctypes.c_int]
    fn.restype = None
    fn = lib.feedback_product_scratch
    fn.argtypes = [size, size]
    fn.restype = size
    fn = lib.feedback_stack_scratch
    fn.argtypes = [ctypes.POINTER(Step)]
    fn.restype = size
    fn = lib.feedback_decoder_stack
    fn.argtypes = [
        ctypes.POINTER(Step),
        pointer,  # the first of the layers (`Layer` structures) to run
        size,
        pointer,
        pointer,
        pointer,
        ctypes.c_float,
        pointer,
    ]
    fn.restype = None
    return lib, ""


@functools.cache
def _loaded() -> tuple[ctypes.CDLL | None, str]:
    """This process's library (built once per cache, source and flags), or None and why not."""
    from feedback.core.embedded import cache_root

    return find(cache_root() / "kernels")


def available() -> bool:
    return _loaded()[0] is not None


def library() -> ctypes.CDLL | None:
    """The built library (gemv, and `attend.c`'s norm, rotary + cache write and attention), or None
    where it cannot be built here (`why_not`)."""
    return _loaded()[0]


def why_not() -> str:
    """Why the kernel is not in use here ("" where it is)."""
    return _loaded()[1]


def describe() -> str:
    """The fp32 decode product here, as `prepare` and `doctor` report it: "gemv", or "oneDNN (gemv:
    why not)"."""
    return f"oneDNN (gemv: {why_not()})" if why_not() else "gemv"


def set_ahead(one: int | None, two: int | None, quantized: int | None = None) -> None:
    """How far ahead (bytes; 0: not at all; None: left as it is) gemv's one-row and two-row loops and
    the quantised products (bytes of int4 codes) ask for the weights they will read: the same
    results, sooner or later by the CPU (`linear.choose_ahead`)."""
    lib = _loaded()[0]
    lib.feedback_gemv_ahead(-1 if one is None else one, -1 if two is None else two)
    lib.feedback_quant_ahead(-1 if quantized is None else quantized)


def wide_usable() -> bool:
    """Whether this CPU runs the quantised products' 512-bit loops (AVX-512 BW and VNNI)."""
    return bool(_loaded()[0].feedback_quant_wide_usable())


def set_wide(from_rows: int | None = None) -> int:
    """From how many rows (0: never) the quantised products take two groups of inputs an instruction
    (512-bit loops, where the CPU has AVX-512 BW and VNNI) instead of one (256-bit): the same bits
    either way, sooner or later by the CPU (`linear.choose_ahead`). None asks without setting;
    returns the setting in force."""
    return int(_loaded()[0].feedback_quant_wide(-1 if from_rows is None else from_rows))


def usable(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Weights (and bias) the kernel reads as they are: fp32, contiguous, in CPU memory."""
    return all(
        t is None or (t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous())
        for t in (weight, bias)
    )


def product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`nn.functional.linear(x, weight, bias)` for fp32 CPU tensors (`usable` weights), by the kernel."""
    out_features, in_features = weight.shape
    if not x.is_contiguous():  # a decode step's inputs are; the kernel reads rows of in_features
        x = x.contiguous()
    y = torch.empty(*x.shape[:-1], out_features, dtype=torch.float32)
    _loaded()[0].feedback_gemv(
        x.data_ptr(),
        weight.data_ptr(),
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        x.numel() // in_features,
        in_features,
        out_features,
        torch.get_num_threads(),
    )
    return y


def quantized_product(matrix: Matrix, x: torch.Tensor, out_features: int) -> torch.Tensor:
    """A quantised linear layer's product (`matrix`: its weights, `feedback.core.linear`) for fp32
    CPU rows `x`, by the compiled int4 or int8 kernel."""
    lib = _loaded()[0]
    in_features = x.shape[-1]
    if not x.is_contiguous():
        x = x.contiguous()
    rows = x.numel() // in_features
    y = torch.empty(*x.shape[:-1], out_features, dtype=torch.float32)
    scratch = torch.empty(lib.feedback_product_scratch(rows, in_features))
    lib.feedback_product(
        matrix, x.data_ptr(), y.data_ptr(), rows, in_features, out_features, scratch.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    return y
