"""Final runs for docs/results/RESULTS.md: each strategy at its default and at its best dev-sweep setting,
evaluated once on builtin:test, plus the parallel-vs-exact speed measurement.

    python docs/results/results.py run      # after the sweeps of docs/results/experiments.sh; writes docs/results/*.json
    python docs/results/results.py confirm  # exact-mode re-run of recurrent strategies whose best CI is below 0
    python docs/results/results.py table    # prints the Markdown tables of RESULTS.md from those files

The best setting is read from the dev sweeps' CSVs (lowest ΔPPL %), never from the test split.
Each run is also printed as the equivalent `python -m feedback ppl` command.
"""
from __future__ import annotations

import csv
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
SWEEPS = ROOT / "sweeps"
RESULTS = ROOT  # the JSON files sit beside this script (docs/results/)
COMMON = {"max_tokens_per_doc": 512, "bootstrap": 2000, "seed": 0}
# strategy -> ([(dev sweep folder, the parameters that sweep held fixed)], mode, jacobi passes)
PLAN = {
    "residual": ([("residual-dev", {})], "jacobi", 3),
    "soft_token": ([("soft_token-dev", {})], "jacobi", 3),
    "deep_cache": ([("deep_cache-dev", {"theta": 50.0}), ("deep_cache-dev-high-gate", {"theta": 50.0}),
                    ("deep_cache-dev-confidence-gate", {"theta": 50.0, "gate": 0.9})], "parallel", 1),
    "anchor": ([("anchor-dev", {})], "parallel", 1),
}
NON_PARAM = {"delta_pct", "ci95_low", "ci95_high", "ci95_width", "baseline_ppl", "feedback_ppl", "mode", "tokens",
             "wall_seconds"}


def best_dev_point(strategy: str) -> tuple[dict, float]:
    """The lowest-ΔPPL point over the strategy's dev sweeps, with the parameters each sweep fixed."""
    candidates = []
    for folder, fixed in PLAN[strategy][0]:
        with open(SWEEPS / folder / "sweep.csv", newline="") as f:
            for row in csv.DictReader(f):
                grid = {k: float(v) if "." in v or "e" in v else int(v) for k, v in row.items() if k not in NON_PARAM}
                candidates.append(({**fixed, **grid}, float(row["delta_pct"])))
    return min(candidates, key=lambda c: c[1])


def _command(strategy: str | None, params: dict, mode: str, passes: int, data: str = "builtin:test",
             extra: str = " --max-tokens 512") -> str:
    parts = [f"python -m feedback ppl --data {data}"]
    if strategy:
        parts.append(f"--strategy {strategy} --mode {mode}" + (f" --passes {passes}" if mode == "jacobi" else ""))
        parts += [f"--param {k}={v}" for k, v in params.items()]
    return " ".join(parts) + extra


def run() -> None:
    from feedback import corpus
    from feedback.model import load_model
    from feedback.perplexity import PPLConfig, evaluate

    lm = load_model()
    RESULTS.mkdir(exist_ok=True)
    test = corpus.load("builtin:test")
    cache: dict = {}

    def save(name: str, cfg: PPLConfig, command: str, docs=test, shared_baseline: bool = True) -> dict:
        print(f"$ {command}", flush=True)
        res = evaluate(lm, docs, cfg, baseline_cache=cache if shared_baseline else None) | {"command": command}
        (RESULTS / f"{name}.json").write_text(json.dumps(res, indent=1))
        print(f"  -> ΔPPL {res.get('delta_pct', 0):+.3f}% {res.get('ci95')} ({res['wall_seconds']:.1f} s)",
              flush=True)
        return res

    t = time.perf_counter()
    save("baseline", PPLConfig(**COMMON), _command(None, {}, "parallel", 1), test)
    (RESULTS / "baseline_seconds.txt").write_text(f"{time.perf_counter() - t:.3f}\n")
    for strategy, (_, mode, passes) in PLAN.items():
        save(f"{strategy}-default", PPLConfig(strategy, {}, mode, max(passes, 2), **COMMON),
             _command(strategy, {}, mode, passes))
        params, dev_delta = best_dev_point(strategy)
        print(f"  best on dev: {params} (ΔPPL {dev_delta:+.3f}% on dev)")
        save(f"{strategy}-best", PPLConfig(strategy, params, mode, max(passes, 2), **COMMON),
             _command(strategy, params, mode, passes))
    # parallel vs exact speed for a non-recurrent strategy on the same tokens
    dev = corpus.load("builtin:dev")[:3]
    speed = {}
    for mode in ("parallel", "exact"):
        cfg = PPLConfig("deep_cache", {"lam": 0.05}, mode, max_tokens_per_doc=256, bootstrap=0)
        res = save(f"speed-{mode}", cfg, _command("deep_cache", {"lam": 0.05}, mode, 1, "builtin:dev",
                                                  " --max-docs 3 --max-tokens 256 --bootstrap 0"), dev,
                   shared_baseline=False)
        speed[mode] = res["tokens"] / res["wall_seconds"]
    (RESULTS / "speed.json").write_text(json.dumps(speed | {"ratio": speed["parallel"] / speed["exact"]}))


def confirm() -> None:
    """Re-run, in exact mode, every recurrent strategy whose best (jacobi) test result has a CI
    below zero: the approximation must not be what makes it look better."""
    from feedback import corpus
    from feedback.model import load_model
    from feedback.perplexity import PPLConfig, evaluate

    lm = load_model()
    test = corpus.load("builtin:test")
    for strategy, (_, mode, _) in PLAN.items():
        best = json.loads((RESULTS / f"{strategy}-best.json").read_text())
        if mode != "jacobi" or best["ci95"][1] >= 0:
            continue
        params = best["config"]["params"]
        command = _command(strategy, params, "exact", 1)
        print(f"$ {command}", flush=True)
        res = evaluate(lm, test, PPLConfig(strategy, params, "exact", **COMMON)) | {"command": command}
        (RESULTS / f"{strategy}-best-exact.json").write_text(json.dumps(res, indent=1))
        print(f"  -> ΔPPL {res['delta_pct']:+.3f}% {res['ci95']} ({res['wall_seconds']:.1f} s)", flush=True)


def table() -> None:
    base = json.loads((RESULTS / "baseline.json").read_text())
    base_s = float((RESULTS / "baseline_seconds.txt").read_text())
    print(f"Baseline PPL on builtin:test: **{base['baseline_ppl']:.3f}** "
          f"({base['documents']} documents, {base['tokens']} tokens, {base_s:.1f} s).\n")
    print("| strategy | setting | chosen on | mode | feedback PPL | ΔPPL % | 95% CI (%) | wall time ÷ baseline |")
    print("|---|---|---|---|---|---|---|---|")
    for strategy in PLAN:
        for kind in ("default", "best"):
            r = json.loads((RESULTS / f"{strategy}-{kind}.json").read_text())
            params = ", ".join(f"{k}={v}" for k, v in r["config"]["params"].items())
            mode = r["mode"] + (f" (approx., P={r['passes']})" if r["approximate"] else "")
            lo, hi = r["ci95"]
            star = " ✱" if hi < 0 else ""
            print(f"| {strategy} | {kind}: {params} | {'—' if kind == 'default' else 'dev sweep'} | {mode} | "
                  f"{r['feedback_ppl']:.3f} | {r['delta_pct']:+.3f}{star} | [{lo:+.3f}, {hi:+.3f}] | "
                  f"{r['wall_seconds'] / base_s:.2f} |")
    for path in sorted(RESULTS.glob("*-best-exact.json")):
        r = json.loads(path.read_text())
        lo, hi = r["ci95"]
        params = ", ".join(f"{k}={v}" for k, v in r["config"]["params"].items())
        print(f"\nExact-mode confirmation of {path.name.split('-best')[0]} ({params}): feedback PPL "
              f"{r['feedback_ppl']:.3f}, ΔPPL **{r['delta_pct']:+.3f} %**, 95% CI [{lo:+.3f}, {hi:+.3f}] "
              f"({r['wall_seconds']:.0f} s).")
    speed = json.loads((RESULTS / "speed.json").read_text())
    print(f"\nParallel vs exact (deep_cache, 3 dev documents × 256 tokens, baseline included in both): parallel "
          f"{speed['parallel']:.0f} tokens/s, exact {speed['exact']:.1f} tokens/s, ratio **{speed['ratio']:.0f}×**.")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT.parents[1]))
    {"run": run, "confirm": confirm, "table": table}[sys.argv[1] if len(sys.argv) > 1 else "table"]()
