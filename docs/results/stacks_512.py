"""The "Stacks, 512-token documents" results of docs/results/RESULTS.md: inner_loop, deep_cache and their
stack (inner_loop then deep_cache) tuned on builtin:dev at 512 tokens per document, each best point
scored once on builtin:test, the defaults scored on test, then key-fact recall and calibration for
the baseline, tuned inner_loop and the tuned stack.

    python docs/results/stacks_512.py tune       # the three searches (resumable: finished trials are read back)
    python docs/results/stacks_512.py defaults   # each at its defaults on builtin:test
    python docs/results/stacks_512.py composed   # the stack of the two separately tuned settings, on dev and on test
    python docs/results/stacks_512.py recall     # the recall grid, three rows in one run per prompt
    python docs/results/stacks_512.py calibrate  # calibration, tuned inner_loop and the stack against the baseline
(the stack carried to recall and calibration is the joint search's best or the composed setting,
whichever is lower on dev)
    python docs/results/stacks_512.py table      # the Markdown tables, from docs/results/tune512/

Every step runs the project's own commands (`python -m feedback tune|ppl|recall|calibrate`) and
prints each one before it runs. Nothing is chosen on test.
"""
from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
OUT = ROOT / "tune512"
PY = sys.executable
COMMON = ["--data", "builtin:dev", "--max-tokens", "512", "--bootstrap", "1000", "--seed", "0"]
# folder -> (strategy, fixed parameters, trial cap, time budget in seconds): the searches stop at
# whichever comes first; inner_loop's trials cost more the more layers and loops they try.
PLAN = {
    "inner_loop": ("inner_loop", {"mode": "loop"}, 40, 1200),
    "deep_cache": ("deep_cache", {}, 24, 600),
    "stack": ("inner_loop+deep_cache", {"inner_loop.mode": "loop"}, 40, 1500),
}
# four items: one of each kind (number, name, date, two-hop); two (number and name) were all right at every cell
RECALL = ["--items", "4", "--lengths", "256,1024,2048", "--depths", "0,50,100", "--seed", "0"]


def _run(args: list[str]) -> None:
    print("+", shlex.join(["python", *args[1:]]), flush=True)
    subprocess.run(args, check=True, cwd=ROOT.parents[1])


def _params(values: dict) -> list[str]:
    return [f"--param={k}={v}" for k, v in values.items()]


def _best(folder: str) -> dict:
    """The tuned point's every parameter (chosen on dev) from best.json."""
    return json.loads((OUT / folder / "best.json").read_text())["best"]["strategy_params"]


def tune() -> None:
    for folder, (strategy, fixed, trials, seconds) in PLAN.items():
        _run([PY, "-m", "feedback", "tune", "--strategy", strategy, *_params(fixed), *COMMON, "--trials", str(trials),
              "--timeout", str(seconds), "--out-dir", str(OUT / folder)])


def defaults() -> None:
    for folder, (strategy, fixed, _, _) in PLAN.items():
        out = OUT / folder / "default_test.json"
        if not out.exists():
            _run([PY, "-m", "feedback", "ppl", "--strategy", strategy, *_params(fixed), "--data", "builtin:test",
                  "--max-tokens", "512", "--bootstrap", "1000", "--seed", "0", "--out", str(out)])


def _composed_params() -> dict:
    """The stack of the two members as each was tuned alone (each chosen on dev)."""
    return ({f"inner_loop.{k}": v for k, v in _best("inner_loop").items()}
            | {f"deep_cache.{k}": v for k, v in _best("deep_cache").items()})


def composed() -> None:
    """The composed stack scored on dev and on test (a joint search of ten parameters in the time
    given may not reach the region each member's own search found)."""
    for split in ("dev", "test"):
        out = OUT / "stack" / f"composed_{split}.json"
        if not out.exists():
            _run([PY, "-m", "feedback", "ppl", "--strategy", "inner_loop+deep_cache", *_params(_composed_params()),
                  "--data", f"builtin:{split}", "--max-tokens", "512", "--bootstrap", "1000", "--seed", "0",
                  "--out", str(out)])


def stack_choice() -> tuple[str, dict]:
    """The stack carried on to recall and calibration, chosen on dev: the joint search's best trial
    or the composed setting, whichever has the lower dev ΔPPL."""
    joint = json.loads((OUT / "stack" / "best.json").read_text())["best"]
    mixed = json.loads((OUT / "stack" / "composed_dev.json").read_text())
    if mixed["delta_pct"] < joint["delta_pct"]:
        return "composed", _composed_params()
    return "joint", joint["strategy_params"]


def stack_vs_inner_loop() -> dict:
    """The carried stack against tuned inner_loop alone on test, paired over the same documents:
    ΔPPL % of the stack relative to inner_loop and its 95% CI (documents resampled, as `ppl` does)."""
    import math

    import numpy as np

    sys.path.insert(0, str(ROOT.parents[1]))
    from feedback.eval.perplexity import paired_bootstrap

    choice = stack_choice()[0]
    stack = json.loads((OUT / "stack" / ("composed_test.json" if choice == "composed" else "best.json")).read_text())
    stack = stack if choice == "composed" else stack["test"]
    alone = json.loads((OUT / "inner_loop" / "best.json").read_text())["test"]
    diffs = []
    for a, b in zip(stack["per_doc"], alone["per_doc"], strict=True):
        assert a["name"] == b["name"] and a["tokens"] == b["tokens"]
        diffs.append(np.full(a["tokens"], math.log(a["feedback_ppl"]) - math.log(b["feedback_ppl"])))
    mean = sum(d.sum() for d in diffs) / sum(d.size for d in diffs)
    lo, hi, _ = paired_bootstrap(diffs, 1000, 0)
    pct = lambda x: 100 * math.expm1(x)  # noqa: E731
    return {"stack": choice, "delta_pct": pct(mean), "ci95": [pct(lo), pct(hi)]}


def _row(name: str, strategy: str, params: dict) -> str:
    return ",".join([f"{name}:{strategy}", *(f"{k}={v}" for k, v in params.items())])


def recall() -> None:
    out = OUT / "recall.json"
    if not out.exists():
        _run([PY, "-m", "feedback", "recall", *RECALL,
              "--row", _row("inner_loop_tuned", "inner_loop", _best("inner_loop")),
              "--row", _row("stack_tuned", "inner_loop+deep_cache", stack_choice()[1]),
              "--out", str(out), "--html", str(OUT / "recall.html")])


def calibrate() -> None:
    for folder, (strategy, params) in (("inner_loop", ("inner_loop", _best("inner_loop"))),
                                       ("stack", ("inner_loop+deep_cache", stack_choice()[1]))):
        out = OUT / folder / "calibration.json"
        if not out.exists():
            _run([PY, "-m", "feedback", "calibrate", "--strategy", strategy, *_params(params), "--out", str(out)])


def _ci(lo: float, hi: float) -> str:
    return f"[{lo:+.3f}, {hi:+.3f}]"


def _setting(values: dict) -> str:
    return ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in values.items())


def table() -> None:
    print("| strategy | setting | chosen on | mode | dev ΔPPL % [95% CI] | test ΔPPL % | test 95% CI | trials "
          "(complete / pruned) | extra layer passes per token |")
    print("|---|---|---|---|---|---|---|---|---|")
    for folder, (strategy, fixed, _, _) in PLAN.items():
        default = json.loads((OUT / folder / "default_test.json").read_text())
        print(f"| {strategy} | defaults{' (' + _setting(fixed) + ')' if fixed else ''} | — | {default['mode']} | — | "
              f"{default['delta_pct']:+.3f} | {_ci(*default['ci95'])} | — | "
              f"{_passes(strategy, default['config']['params'])} |")
        best = json.loads((OUT / folder / "best.json").read_text())
        trials = [json.loads(line) for line in (OUT / folder / "trials.jsonl").read_text().splitlines()[1:]]
        states = [t.get("state") for t in trials]
        dev, test = best["best"], best["test"]
        print(f"| {strategy} | tuned: {_setting(dev['params'])} | dev, trial {dev['trial']} | {test['mode']} | "
              f"{dev['delta_pct']:+.3f} {_ci(*dev['ci95'])} | {test['delta_pct']:+.3f} | {_ci(*test['ci95'])} | "
              f"{states.count('complete')} / {states.count('pruned')} | {_passes(strategy, dev['strategy_params'])} |")
    dev, test = (json.loads((OUT / "stack" / f"composed_{s}.json").read_text()) for s in ("dev", "test"))
    print(f"| inner_loop+deep_cache | composed: each member at its own tuned setting | dev (each member) | "
          f"{test['mode']} | {dev['delta_pct']:+.3f} {_ci(*dev['ci95'])} | {test['delta_pct']:+.3f} | "
          f"{_ci(*test['ci95'])} | — | {_passes('inner_loop+deep_cache', _composed_params())} |")
    print(f"\nstack carried to recall and calibration (lower dev ΔPPL): {stack_choice()[0]}")
    pair = stack_vs_inner_loop()
    print(f"that stack ÷ tuned inner_loop alone on test: ΔPPL {pair['delta_pct']:+.3f} % {_ci(*pair['ci95'])}")


def _passes(strategy: str, params: dict) -> int:
    sys.path.insert(0, str(ROOT.parents[1]))  # the repository's package, run as a script
    from feedback.strategies import build_strategy

    return build_strategy(strategy, params, 30).extra_layer_passes()


if __name__ == "__main__":
    steps = {"tune": tune, "defaults": defaults, "composed": composed, "recall": recall, "calibrate": calibrate,
             "table": table}
    if len(sys.argv) < 2 or any(a not in steps for a in sys.argv[1:]):
        sys.exit(f"usage: python docs/results/stacks_512.py {{{'|'.join(steps)}}} ...")
    for step in sys.argv[1:]:
        steps[step]()
