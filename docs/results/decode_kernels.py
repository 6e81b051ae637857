"""What each compiled decode kernel beside the products saves: the engine's one-row greedy step on
the embedded model (64 tokens of the bench prompt, CPU time a step after the first, decode steps at
1 thread), with every kernel in use against the same step with one of them turned off, and against
a model loaded where the library cannot be built (oneDNN's products, PyTorch's ops: a machine
without a C compiler). One run of each in turn per round; median over the rounds of each ratio.

- stack: every layer and the final norm in one call a step (`LeanLlamaModel._decode_stack`); off,
  each layer takes a call of its own;
- silu: the MLP half compiled (its SiLU in PyTorch's rounding, `lean._silu_block` 0 turns it off),
  and so the model-wide call; off, a layer's call is its attention half;
- layer: a layer's own call (`LeanLlamaLayer._decode`); off with the stack, every part op by op;
- attention: the attention of one query a row (`kvcache.compiled_attention`), with the calls above,
  which include it;
- rope + cache: the rotation of q and k with the cache write (`kvcache.rope_append`), with the calls;
- norm: the RMS norm in PyTorch's order (`lean._norm_lanes` 0 turns it off, and the calls with it).

Run (its output is decode_kernels.txt):
  OMP_WAIT_POLICY=PASSIVE FEEDBACK_THREADS=1 PYTHONPATH=. python docs/results/decode_kernels.py [rounds]
"""

import statistics
import sys

from feedback.bench import _engine_run
from feedback.core import gemv, kvcache, lean, linear
from feedback.core.model import load_model

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 8
real = {
    "stack": (lean.LeanLlamaModel, "_decode_stack"),
    "silu": (lean, "_silu_block"),
    "layer": (lean.LeanLlamaLayer, "_decode"),
    "attention": (kvcache, "compiled_attention"),
    "rope": (kvcache, "rope_append"),
    "norm": (lean, "_norm_lanes"),
}
saved = {name: getattr(owner, attr) for name, (owner, attr) in real.items()}
off = {
    "stack": lambda *a: None,
    "silu": lambda: 0,
    "layer": lambda *a: (None, False),
    "attention": lambda *a: None,
    "rope": lambda *a: None,
    "norm": lambda *a: 0,
}


def using(*turned_off: str) -> None:
    for name, (owner, attr) in real.items():
        setattr(owner, attr, off[name] if name in turned_off else saved[name])


loaded = gemv._loaded
lm = load_model("embedded")
gemv._loaded = lambda: (None, "turned off for this comparison")  # the second model: no library
bare = load_model("embedded")
gemv._loaded = loaded
print(f"CPU {linear.cpu_name()}; with the library: {linear.kernel_summary(lm.kernels)}")
print(f"without it: {linear.kernel_summary(bare.kernels, 'onednn')} products, PyTorch's ops")

variants = {
    "every kernel": (lm, ()),
    "one call a layer": (lm, ("stack",)),
    "MLP op by op": (lm, ("silu",)),
    "no layer calls": (lm, ("stack", "layer")),
    "attention off": (lm, ("attention", "stack", "layer")),
    "rope + cache off": (lm, ("rope", "stack", "layer")),
    "norm off": (lm, ("norm",)),
    "no library": (bare, ()),
}
for model, _ in variants.values():
    _engine_run(model, 4)  # warm-up
seconds: dict[str, list[float]] = {name: [] for name in variants}
for _ in range(ROUNDS):
    for name, (model, turned_off) in variants.items():
        using(*turned_off)
        if model is bare:
            gemv._loaded = lambda: (None, "turned off for this comparison")
        seconds[name].append(_engine_run(model, 64)[0])
        gemv._loaded = loaded
using()
base = seconds["every kernel"]
for name, values in seconds.items():
    ratios = [v / b for v, b in zip(values, base)]
    ms = statistics.median(values) * 1e3
    print(f"{name:18} {ms:6.2f} ms a step; ÷ every kernel {statistics.median(ratios):.3f} ", end="")
    print(f"[{min(ratios):.3f}–{max(ratios):.3f}]")
