"""What the loader's measured choices see on this machine (`feedback.core.linear`): the embedded
model's products with and without asking for weights ahead, the quantised ones also by 256-bit and
512-bit loops (`choose_ahead`), the fused gate/up product alone by gemv and by oneDNN (the
per-product choice), and decode steps with the decoder's products compiled against PyTorch's
kernels (`use_step_kernels`) for exact fp32, int4 and int8. CPU time at 1 thread; the variants of
each line in turn, the best of 5 rounds.

Run (its output is compiled_choices.txt):
  OMP_WAIT_POLICY=PASSIVE PYTHONPATH=. .venv/bin/python docs/results/compiled_choices.py
"""

import time

import torch

from feedback.core import gemv, linear
from feedback.core.model import _engine_step_seconds, decoder_layers, load_model

torch.set_num_threads(1)
ROUNDS = 5
clock = time.process_time


def best(variants: dict) -> dict:
    """Each variant's best time over ROUNDS, the variants in turn each round (ms)."""
    out = dict.fromkeys(variants, float("inf"))
    for _ in range(ROUNDS):
        for name, run in variants.items():
            start = clock()
            run()
            out[name] = min(out[name], (clock() - start) * 1e3)
    return out


def ahead(bytes_ahead: int, run):
    def go():
        gemv.set_ahead(bytes_ahead, bytes_ahead, bytes_ahead)
        run()

    return go


print(f"CPU {linear.cpu_name()}, 1 thread, best of {ROUNDS} rounds, ms of CPU")
fp32 = load_model("embedded", dtype="float32")
products = [m for m in decoder_layers(fp32.model).modules() if type(m) is linear.GemvLinear]
with torch.inference_mode():
    for rows in (1, 2):
        xs = {m.in_features: torch.randn(rows, m.in_features) for m in products}

        def decoder(xs=xs):
            for m in products:
                gemv.product(xs[m.in_features], m.weight, None)

        t = best({n: ahead(n, decoder) for n in (0, linear.AHEAD_BYTES)})
        far, on = linear.AHEAD_BYTES, t[linear.AHEAD_BYTES]
        print(f"fp32 decoder products, {rows} row(s): not ahead {t[0]:.2f}, {far} B ahead {on:.2f}")
    gate_up = fp32.layers[0].gate_up
    x = torch.randn(1, gate_up.in_features)
    weights = linear._cold_copies(gate_up)
    t = {n: linear._time(fn, x, weights, clock) * 1e6 for n, fn in linear.KERNELS.items()}
    print(f"gate/up product alone, 1 row, from memory: gemv {t['gemv']:.0f} µs, oneDNN {t['onednn']:.0f} µs")

for label, kwargs in (("fp32", {}), ("int4", {"load_in_4bit": True}), ("int8", {"load_in_8bit": True})):
    lm = fp32 if label == "fp32" else load_model("embedded", dtype="float32", **kwargs)
    decoder = list(decoder_layers(lm.model).modules())
    if label != "fp32":
        quantized = [m for m in decoder if isinstance(m, linear.WeightOnlyLinear)]
        head = lm.model.get_output_embeddings()
        far = linear.QUANTIZED_AHEAD_BYTES
        with torch.inference_mode():
            for name, mods, rows in (
                ("decoder products", quantized, 1),
                ("decoder products", quantized, 2),
                ("output head", [head], 1),
            ):
                xs = {m.in_features: torch.randn(rows, m.in_features) for m in mods}
                mats = [(m.matrix(), m.in_features, m.out_features) for m in mods]

                def compiled(xs=xs, mats=mats):
                    for mat, i, o in mats:
                        gemv.quantized_product(mat, xs[i], o)

                def packed(xs=xs, mods=mods):
                    for m in mods:
                        m.packed(xs[m.in_features].to(torch.bfloat16))

                def wide(from_rows, run):
                    def go():
                        gemv.set_wide(from_rows)
                        run()

                    return go

                variants = {
                    "256 not ahead": wide(0, ahead(0, compiled)),
                    "256": wide(0, ahead(far, compiled)),
                }
                if gemv.wide_usable():
                    variants["512"] = wide(1, ahead(far, compiled))
                t = best({**variants, "packed": packed})
                loops = ", ".join(f"{k}-bit {t[k]:.2f}" for k in variants if k != "256 not ahead")
                print(
                    f"{label} {name}, {rows} row(s): compiled 256-bit not ahead {t['256 not ahead']:.2f}, "
                    f"{far} B ahead: {loops}; PyTorch's packed {t['packed']:.2f}"
                )
    linear.choose_ahead(decoder)  # as the loader leaves it
    modules = [m for m in decoder if type(m) is linear.GemvLinear or isinstance(m, linear.WeightOnlyLinear)]
    chosen = linear.measure_step_kernels(modules, _engine_step_seconds(lm.model))
    linear.use_step_kernels(modules, _engine_step_seconds(lm.model))  # back to the remembered choice
    steps = ", ".join(
        f"{rows} row(s) {s['compiled'] * 1e3:.1f} / {s['pytorch'] * 1e3:.1f}"
        for rows, s in chosen["seconds"].items()
    )
    rows = chosen["compiled_rows"]
    print(f"{label} decode step, compiled / PyTorch's kernels: {steps}; compiled to {rows} rows")
