"""model.generate's decode step against the engine's, as the bench's baseline_vs_generate measures it:
CPU time, in-process, the two in turn over 4 rounds, 64 greedy tokens, the prefill and first token left
out of both; and whether their tokens agree. Twice: generate on the engine's own loaded model (the
lean layers too: the loops compared), and generate on a model with transformers' own layers
(`lean_layers=False`: what a user of transformers runs).

Run: OMP_WAIT_POLICY=PASSIVE PYTHONPATH=. .venv/bin/python docs/results/generate_decode.py
"""
from feedback.bench import _engine_run, _generate_run, ratio
from feedback.core.model import load_model
lm = load_model("embedded", dtype="float32")
stock = load_model("embedded", dtype="float32", lean_layers=False)
for label, gen_lm in (("same model", lm), ("transformers' layers", stock)):
    g, e = [], []
    def side(fn, model, seen):
        c, ids = fn(model, 64); seen.append(ids); return c
    r = ratio(lambda: side(_generate_run, gen_lm, g), lambda: side(_engine_run, lm, e), 4)
    print(label, r, "same tokens:", g[0] == e[0], flush=True)
