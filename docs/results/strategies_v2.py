"""Strategies v2 results for docs/results/RESULTS.md, after docs/results/tune_all.sh has tuned every hidden-state
strategy on builtin:dev and scored its best point once on builtin:test.

    python docs/results/strategies_v2.py defaults  # each strategy at its defaults on builtin:test (same settings)
    python docs/results/strategies_v2.py confirm   # exact-mode re-run of a recurrent strategy whose tuned test CI is below 0
    python docs/results/strategies_v2.py qa        # greedy accuracy + gold-answer PPL on the built-in 16 questions
    python docs/results/strategies_v2.py table     # the Markdown tables of RESULTS.md from docs/results/tune/

Nothing here is tuned on test: best points come from docs/results/tune/*/best.json (chosen on dev).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
TUNE = ROOT / "tune"
# tune folder -> (strategy, mode, fixed parameters of that tuning run)
PLAN = {
    "deep_cache": ("deep_cache", "parallel", {}),
    "anchor": ("anchor", "parallel", {}),
    "residual": ("residual", "jacobi", {}),
    "soft_token": ("soft_token", "jacobi", {}),
    "inner_loop-loop": ("inner_loop", "parallel", {"mode": "loop"}),
    "inner_loop-euler": ("inner_loop", "parallel", {"mode": "euler"}),
}
SCORING = {"max_tokens_per_doc": 256, "bootstrap": 1000, "seed": 0}


def _lm():
    from feedback.core.model import load_model

    return load_model("embedded", dtype="float32")


def _evaluate(lm, strategy: str, params: dict, mode: str, data: str = "builtin:test") -> dict:
    from feedback.eval import corpus
    from feedback.eval.perplexity import PPLConfig, evaluate

    cfg = PPLConfig(strategy, params, mode, passes=3, **SCORING)
    t = time.perf_counter()
    res = evaluate(lm, corpus.load(data), cfg)
    res["command"] = (f"python -m feedback ppl --strategy {strategy} --mode {mode} --data {data} --max-tokens 256 "
                      f"--bootstrap 1000 --seed 0 " + " ".join(f"--param {k}={v}" for k, v in params.items()))
    res["seconds"] = time.perf_counter() - t
    return res


def defaults() -> None:
    lm = _lm()
    for folder, (strategy, mode, fixed) in PLAN.items():
        out = TUNE / folder / "default_test.json"
        if out.exists():
            continue
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(_evaluate(lm, strategy, dict(fixed), mode), indent=1))
        print(folder, "default done", flush=True)


def confirm() -> None:
    from feedback.strategies import get_strategy

    lm = _lm()
    for folder, (strategy, mode, _) in PLAN.items():
        best = json.loads((TUNE / folder / "best.json").read_text())
        test = best.get("test")
        if not (get_strategy(strategy).recurrent and test and test["ci95"][1] < 0):
            continue
        out = TUNE / folder / "exact_test.json"
        if not out.exists():
            out.write_text(json.dumps(_evaluate(lm, strategy, best["best"]["params"], "exact"), indent=1))
        print(folder, "exact confirmation done", flush=True)


def qa() -> None:
    from feedback.core.records import RowSpec
    from feedback.eval.deepthink import load_questions
    from feedback.eval.qa import BUILTIN_QUESTIONS, evaluate_qa

    lm = _lm()
    rows = [RowSpec("baseline")]
    for folder, (strategy, _, _) in PLAN.items():
        saved = json.loads((TUNE / folder / "best.json").read_text())
        if saved["best"] is not None:  # the searched values and what that tuning run held fixed
            rows.append(RowSpec(folder, strategy, {**saved["header"]["fixed"], **saved["best"]["params"]}))
    rows += [RowSpec("restate", "restate", {}), RowSpec("restate-markers-only", "restate", {"max_tokens": 0})]
    res = evaluate_qa(lm, load_questions(BUILTIN_QUESTIONS), rows, max_new_tokens=64,
                      progress=lambda i, n: print(f"[{i}/{n}]", flush=True))
    (TUNE / "qa.json").write_text(json.dumps(res, indent=1))


def _ci(pair) -> str:
    return f"[{pair[0]:+.3f}, {pair[1]:+.3f}]"


def table() -> None:
    print("| strategy | setting | chosen on | mode | dev ΔPPL % (CI) | test ΔPPL % | test 95% CI | trials (complete / pruned / failed) |")
    print("|---|---|---|---|---|---|---|---|")
    for folder, (strategy, mode, fixed) in PLAN.items():
        best = json.loads((TUNE / folder / "best.json").read_text())
        trials = [json.loads(line) for line in (TUNE / folder / "trials.jsonl").read_text().splitlines()[1:]]
        states = [t.get("state") for t in trials]
        counts = f"{states.count('complete')} / {states.count('pruned')} / {states.count('failed')}"
        default = json.loads((TUNE / folder / "default_test.json").read_text())
        star = " ✱" if default["ci95"][1] < 0 else ""
        print(f"| {folder} | default{': ' + ', '.join(f'{k}={v}' for k, v in fixed.items()) if fixed else ''} | — | "
              f"{default['mode']} | — | {default['delta_pct']:+.3f}{star} | {_ci(default['ci95'])} | — |")
        b, t = best["best"], best.get("test")
        shown = {**best["header"]["fixed"], **b["params"]}
        params = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in shown.items())
        star = " ✱" if t and t["ci95"][1] < 0 else ""
        print(f"| {folder} | tuned: {params} | dev, trial {b['trial']} | {mode} | {b['delta_pct']:+.3f} "
              f"{_ci(b['ci95'])} | {t['delta_pct']:+.3f}{star} | {_ci(t['ci95'])} | {counts} |")
        exact = TUNE / folder / "exact_test.json"
        if exact.exists():
            e = json.loads(exact.read_text())
            print(f"| {folder} | tuned, exact mode | dev | exact | — | {e['delta_pct']:+.3f} | {_ci(e['ci95'])} | — |")
    qa_path = TUNE / "qa.json"
    if qa_path.exists():
        res = json.loads(qa_path.read_text())
        print(f"\n| row ({res['questions']} questions, greedy, ≤ {res['max_new_tokens']} tokens) | accuracy | "
              "gold-answer PPL | mean tokens |")
        print("|---|---|---|---|")
        for name, s in res["rows"].items():
            print(f"| {name} | {s['right']}/{res['questions']} ({s['accuracy']:.0%}) | {s['gold_ppl']:.2f} | "
                  f"{s['mean_tokens']:.1f} |")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT.parents[1]))
    {"defaults": defaults, "confirm": confirm, "qa": qa, "table": table}[sys.argv[1]]()
