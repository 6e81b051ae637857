"""A bare 1-row decode step (ms, wall time, best of 3 runs of 24 tokens) in a fresh process per
setting: 1 and 2 threads x OpenMP wait policies (PASSIVE, PASSIVE with libgomp spinning 10^4 or
10^5 times before sleeping, ACTIVE), on the machine as it is and beside a CPU hog (one process
spinning on one core), with the linear kernels the engine chooses (gemv for decode rows here).
The thread count is forced (FEEDBACK_DECODE_THREADS) so each line measures what it says.

Run: PYTHONPATH=. .venv/bin/python docs/results/busy_threads.py
"""
import os
import subprocess
import sys

from feedback.bench import HOG


def step(threads, env, tokens=24):
    code = ("import torch, time; from feedback.core.model import load_model; from feedback.bench import _raw_step_s; "
            f"torch.set_num_threads({threads}); lm = load_model('embedded', dtype='float32'); _raw_step_s(lm, 1, 4); "
            f"print(min(_raw_step_s(lm, 1, {tokens}, time.perf_counter) for _ in range(3)) * 1e3)")
    e = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    e |= env | {"FEEDBACK_DECODE_THREADS": str(threads)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=e)
    return float(out.stdout.strip().splitlines()[-1])


envs = {
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "passive+spin1e4": {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "10000"},
    "passive+spin1e5": {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "100000"},
    "active": {"OMP_WAIT_POLICY": "ACTIVE"},
}
for cond in ("quiet", "hog"):
    hog = subprocess.Popen([sys.executable, "-c", HOG]) if cond == "hog" else None
    try:
        for t in (1, 2):
            print(cond, f"{t} thread(s)", {k: round(step(t, e), 1) for k, e in envs.items()}, flush=True)
    finally:
        if hog:
            hog.kill()
            hog.wait()
