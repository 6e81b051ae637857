"""The shared decode in-process (no HTTP): CPU per generated token of 8 two-row requests served one by
one, as one engine run of their 16 rows, and through the shared decode loop sent at once and 0.5 s
apart; with the loop thread's time per part (forwards, joins, cuts, token choice).

Run: OMP_WAIT_POLICY=PASSIVE PYTHONPATH=. .venv/bin/python docs/results/shared_decode_profile.py
"""
import time, threading, collections, os
import torch
from feedback.core.model import load_model
from feedback.core.engine import start_run, run_to_end
from feedback.core.records import RunConfig, RowSpec
import feedback.core.sharing as sh
from feedback.bench import CONCURRENCY_PROMPTS
lm = load_model("embedded")
acc = collections.defaultdict(float); cnt = collections.Counter()
def timed(name, fn):
    def w(*a, **k):
        t = time.thread_time(); 
        try: return fn(*a, **k)
        finally: acc[name] += time.thread_time() - t; cnt[name] += 1
    return w
D = sh.SharedDecoder
for n in ["_step", "_join", "_select", "_advance", "_take", "_drop_own"]:
    setattr(D, n, timed(n, getattr(D, n)))
import feedback.core.sharing
sh.shared_forward = timed("forward", sh.shared_forward)
sh.stack_rows = timed("stack_rows", sh.stack_rows)
def cfg(p): return RunConfig(prompt=p, max_new_tokens=64, rows=[RowSpec("baseline"), RowSpec("feedback", "residual")])
cfgs = [cfg(p) for p in CONCURRENCY_PROMPTS[:8]]
for c in cfgs[:2]: run_to_end(lm, c)
def shared(gap):
    d = sh.SharedDecoder(lm)
    runs = [start_run(lm, c) for c in cfgs]
    ts = []
    t0 = time.process_time()
    for r in runs:
        t = threading.Thread(target=lambda r=r: list(d.submit(r))); t.start(); ts.append(t); time.sleep(gap)
    for t in ts: t.join()
    cpu = time.process_time() - t0
    toks = sum(len(row.token_ids) for r in runs for row in r.result.rows)
    return cpu / toks * 1000
def one_by_one():
    t0 = time.process_time(); toks = 0
    for c in cfgs:
        res = run_to_end(lm, c); toks += sum(len(r.token_ids) for r in res.rows)
    return (time.process_time() - t0) / toks * 1000
def one_batch():
    rows = [RowSpec(f"{k}{i}", s, prompt=p) for i, p in enumerate(CONCURRENCY_PROMPTS[:8]) for k, s in (("b", None), ("f", "residual"))]
    t0 = time.process_time(); res = run_to_end(lm, RunConfig(prompt="", max_new_tokens=64, rows=rows))
    return (time.process_time() - t0) / sum(len(r.token_ids) for r in res.rows) * 1000
print("one_by_one", one_by_one())
print("one_batch", one_batch())
acc.clear(); cnt.clear()
print("shared together", shared(0.0)); print(dict(acc), dict(cnt))
acc.clear(); cnt.clear()
print("shared staggered", shared(0.5)); print(dict(acc), dict(cnt))
