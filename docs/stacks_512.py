"""The "Stacks, 512-token documents" results of docs/RESULTS.md: inner_loop, deep_cache and their
stack (inner_loop then deep_cache) tuned on builtin:dev at 512 tokens per document, each best point
scored once on builtin:test, the defaults scored on test, then key-fact recall and calibration for
the baseline, tuned inner_loop and the tuned stack.

    python docs/stacks_512.py tune       # the three searches (resumable: finished trials are read back)
    python docs/stacks_512.py defaults   # each at its defaults on builtin:test
    python docs/stacks_512.py recall     # the recall grid, three rows in one run per prompt
    python docs/stacks_512.py calibrate  # calibration, tuned inner_loop and the tuned stack against the baseline
    python docs/stacks_512.py table      # the Markdown tables, from docs/tune512/

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
RECALL = ["--items", "2", "--lengths", "256,1024,2048", "--depths", "0,50,100", "--seed", "0"]


def _run(args: list[str]) -> None:
    print("+", shlex.join(["python", *args[1:]]), flush=True)
    subprocess.run(args, check=True, cwd=ROOT.parent)


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


def _row(name: str, folder: str) -> str:
    strategy = PLAN[folder][0]
    return ",".join([f"{name}:{strategy}", *(f"{k}={v}" for k, v in _best(folder).items())])


def recall() -> None:
    out = OUT / "recall.json"
    if not out.exists():
        _run([PY, "-m", "feedback", "recall", *RECALL, "--row", _row("inner_loop_tuned", "inner_loop"),
              "--row", _row("stack_tuned", "stack"), "--out", str(out), "--html", str(OUT / "recall.html")])


def calibrate() -> None:
    for folder in ("inner_loop", "stack"):
        out = OUT / folder / "calibration.json"
        if not out.exists():
            strategy = PLAN[folder][0]
            _run([PY, "-m", "feedback", "calibrate", "--strategy", strategy, *_params(_best(folder)),
                  "--out", str(out)])


def _ci(lo: float, hi: float) -> str:
    return f"[{lo:+.3f}, {hi:+.3f}]"


def _setting(values: dict) -> str:
    return ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in values.items())


def table() -> None:
    print("| strategy | setting | mode | dev ΔPPL % [95% CI] | test ΔPPL % | test 95% CI | trials (complete / pruned) "
          "| extra layer passes per token |")
    print("|---|---|---|---|---|---|---|---|")
    for folder, (strategy, fixed, _, _) in PLAN.items():
        default = json.loads((OUT / folder / "default_test.json").read_text())
        print(f"| {strategy} | defaults{', ' + _setting(fixed) if fixed else ''} | {default['mode']} | — | "
              f"{default['delta_pct']:+.3f} | {_ci(*default['ci95'])} | — | {_passes(strategy, default['config']['params'])} |")
        best = json.loads((OUT / folder / "best.json").read_text())
        trials = [json.loads(line) for line in (OUT / folder / "trials.jsonl").read_text().splitlines()[1:]]
        states = [t.get("state") for t in trials]
        dev, test = best["best"], best["test"]
        print(f"| {strategy} | tuned: {_setting(dev['params'])} | {test['mode']} | {dev['delta_pct']:+.3f} "
              f"{_ci(*dev['ci95'])} | {test['delta_pct']:+.3f} | {_ci(*test['ci95'])} | "
              f"{states.count('complete')} / {states.count('pruned')} | {_passes(strategy, dev['strategy_params'])} |")


def _passes(strategy: str, params: dict) -> int:
    from feedback.strategies import build_strategy

    return build_strategy(strategy, params, 30).extra_layer_passes()


if __name__ == "__main__":
    steps = {"tune": tune, "defaults": defaults, "recall": recall, "calibrate": calibrate, "table": table}
    if len(sys.argv) < 2 or any(a not in steps for a in sys.argv[1:]):
        sys.exit(f"usage: python docs/stacks_512.py {{{'|'.join(steps)}}} ...")
    for step in sys.argv[1:]:
        steps[step]()
