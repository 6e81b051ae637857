"""model.generate's decode step against the engine's, as the bench's baseline_vs_generate measures it:
CPU time, in-process, the two in turn over 4 rounds, 64 greedy tokens, the prefill and first token left
out of both; and whether their tokens agree.

Run: OMP_WAIT_POLICY=PASSIVE PYTHONPATH=. .venv/bin/python docs/results/generate_decode.py
"""
from feedback.bench import _engine_run, _generate_run, ratio
from feedback.core.model import load_model
lm = load_model("embedded", dtype="float32")
g, e = [], []
def side(fn, seen):
    c, ids = fn(lm, 64); seen.append(ids); return c
r = ratio(lambda: side(_generate_run, g), lambda: side(_engine_run, e), 4)
print(r, g[0] == e[0])
