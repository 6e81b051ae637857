"""The engine's pair against one row: a decode step of a baseline and a feedback row (residual,
the strategy hooking its layers) ÷ a step of the baseline alone, CPU time after the first step, the
two in turn over 5 rounds of 32 tokens, for exact fp32 and the int4 and int8 modes (decode steps
at each model's decode threads; FEEDBACK_THREADS=1 for one thread).

Run (its output is pair_engine.txt):
  OMP_WAIT_POLICY=PASSIVE PYTHONPATH=. .venv/bin/python docs/results/pair_engine.py
"""

from feedback.bench import _engine_step_s, ratio
from feedback.core import linear
from feedback.core.model import load_model
from feedback.core.records import RowSpec

BASE, FEEDBACK = RowSpec("baseline"), RowSpec("feedback", "residual", {})


def pair_ratio(lm):
    _engine_step_s(lm, [BASE, FEEDBACK], 4)  # warm-up
    return ratio(lambda: _engine_step_s(lm, [BASE, FEEDBACK], 32), lambda: _engine_step_s(lm, [BASE], 32), 5)


print(f"CPU {linear.cpu_name()}")
for label, kwargs in (("fp32", {}), ("int4", {"load_in_4bit": True}), ("int8", {"load_in_8bit": True})):
    r = pair_ratio(load_model("embedded", dtype="float32", **kwargs))
    print(
        f"{label}: pair ÷ row {r.median:.3f} [{r.low:.3f}-{r.high:.3f}], {r.a * 1e3:.1f} / {r.b * 1e3:.1f} ms"
    )
