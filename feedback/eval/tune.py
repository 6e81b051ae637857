"""Tuning: search a strategy's parameters for the lowest ΔPPL on a dev corpus, then score the best
point once on a held-out test corpus.

Search space. Taken from the strategy's `Param` schema: every parameter with `p.tunable` is searched
(a layer index over every layer, as an integer; other numbers over `p.search_range(num_layers)`, on
a log scale where `p.log`; a parameter with `choices` categorically over `p.search`), unless the user
fixes it (`fixed`, `--param NAME=VALUE`); every other parameter keeps its default.

Objective. ΔPPL % of the strategy against the baseline over the dev documents, computed as
`feedback.eval.perplexity.evaluate` computes it (the same `document_ids`, `token_nlls`, paired bootstrap
and settings, `PPLConfig`); the baseline's NLLs are computed once and reused by every trial
(`baseline_cache`). Lower is better.

Sampler. Optuna's TPE. Its random generator is seeded from (seed, trial number) before each trial,
so a trial's parameters depend only on the seed and the trials before it: the same seed gives the
same trials, and a resumed run samples exactly what an uninterrupted one would have.

Pruning ("clearly worse than the median"). Every trial first scores the first third of the dev
documents (at least one; all of them when there are fewer than two) and reports that subset's ΔPPL
and its 95% CI. Once `PRUNE_STARTUP` trials have completed, a trial is pruned when the lower end
of its subset CI lies above the median subset ΔPPL of the completed trials: even the favourable end
of what its first documents allow is worse than a typical finished trial. Pruned trials cost about a
third of a full one; a trial whose interval still reaches the median is always scored in full, so a
setting is dropped on evidence, not on one noisy number (Optuna's MedianPruner would prune on the
point estimate alone). With no bootstrap (`bootstrap=0`) the point estimate stands in for the bound.

Log and resume. Every finished, pruned or failed trial is appended as one JSON line to
`OUT_DIR/trials.jsonl`, after a header line that names the strategy, fixed parameters, search space,
model, dev corpus (fingerprint) and scoring settings. Rerunning with the same out-dir re-adds the
logged trials to the study and continues up to the requested total; a header that differs is
refused, naming the first difference.

Test once. After the search, the best completed dev trial (settings with strength 0, i.e. the
baseline again, left out) is scored once on the test corpus with `evaluate`, as
`python -m feedback ppl` scores it, and written to `OUT_DIR/best.json` with the dev trial. A rerun
whose best trial is unchanged reuses that result instead of scoring the test corpus again; the file
counts how many different best points the test corpus has scored. The search never sees test
numbers.
"""
from __future__ import annotations

import dataclasses
import json
import math
import threading
import time
import warnings
from pathlib import Path
from statistics import median
from typing import Any, Callable

import numpy as np
import optuna
import plotly.graph_objects as go
from optuna.distributions import (BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution,
                                  distribution_to_json)
from optuna.pruners import BasePruner
from optuna.trial import FrozenTrial, TrialState

from feedback.core.budget import Budget
from feedback.core.model import LoadedModel
from feedback.errors import FeedbackError, check_stop
from feedback.eval.corpus import Document, fingerprint
from feedback.eval.figures import BETTER, WORSE, figure
from feedback.eval.perplexity import PPLConfig, document_ids, evaluate, paired_bootstrap, scoring_work, token_nlls
from feedback.eval.sweep import is_noop
from feedback.strategies import build_strategy, get_strategy

FORMAT = 1  # of trials.jsonl
MAX_TRIALS = 10_000
STARTUP_TRIALS = 10  # TPE's random trials before it models the results (Optuna's default)
PRUNE_STARTUP = 4  # completed trials before any trial is pruned
TRIALS_FILE, BEST_FILE, HTML_FILE = "trials.jsonl", "best.json", "tune.html"
# Header keys that describe a run without changing its trials: not compared on resume.
INFORMATIONAL = ("data",)


# ---- the search space ----
def searched_names(strategy: str, fixed: dict | None = None) -> list[str]:
    """The parameters the tuner searches (tunable and not fixed); refused when there are none.
    Needs no model, so the command line can refuse before loading one."""
    cls = get_strategy(strategy)
    known = {p.name for p in cls.params}
    unknown = sorted(set(fixed or {}) - known)
    if unknown:
        raise FeedbackError(f"unknown parameter(s) {', '.join(unknown)} for strategy {strategy}; "
                            f"it takes {', '.join(known) or 'none'}")
    tunable = [p.name for p in cls.params if p.tunable]
    if not tunable:
        raise FeedbackError(f"strategy {strategy} has no tunable parameters")
    names = [n for n in tunable if n not in (fixed or {})]
    if not names:
        raise FeedbackError(f"every tunable parameter of {strategy} is fixed ({', '.join(tunable)}); "
                            "leave at least one free to tune")
    return names


def parse_fixed(fixed: dict | list | None, strategy: str, num_layers: int) -> dict:
    """`--param` values, parsed and checked by the strategy's schema; only the names given."""
    given = dict(fixed or {})
    searched_names(strategy, given)
    values = get_strategy(strategy).validate(given, num_layers)
    out = {k: values[k] for k in given}
    cls = get_strategy(strategy)
    if cls.strength_param in out and is_noop(strategy, out):
        raise FeedbackError(f"{cls.strength_param}=0 switches {strategy} off: every trial would measure the "
                            "baseline again")
    return out


def search_space(strategy: str, num_layers: int, fixed: dict | None = None) -> dict[str, BaseDistribution]:
    """Optuna distributions of the searched parameters, from the `Param` schema (see the module
    docstring)."""
    params = {p.name: p for p in get_strategy(strategy).params}
    space: dict[str, BaseDistribution] = {}
    for name in searched_names(strategy, fixed):
        p = params[name]
        if p.choices is not None or p.kind is bool:
            space[name] = CategoricalDistribution(tuple(p.search if p.search is not None else p.choices))
            continue
        lo, hi = p.search_range(num_layers)
        if p.kind is int:
            space[name] = IntDistribution(int(lo), int(hi), log=p.log and not p.is_layer)
        else:
            space[name] = FloatDistribution(float(lo), float(hi), log=p.log)
    return space


def _ask(study: optuna.Study, space: dict[str, BaseDistribution], strategy: str, fixed: dict) -> optuna.Trial:
    """A new trial: free parameters from the space; one that must be at least another (`Param.at_least`)
    searched from that one's value up, so no trial is a pair the strategy refuses."""
    after = {p.name: p.at_least for p in get_strategy(strategy).params if p.at_least and p.name in space}
    trial = study.ask({k: v for k, v in space.items() if k not in after})
    for name, other in after.items():
        dist, floor = space[name], trial.params.get(other, fixed.get(other))
        low = dist.low if floor is None else min(max(dist.low, floor), dist.high)
        trial.suggest_int(name, low, dist.high, log=dist.log)
    return trial


def check_budget(trials: int | None, timeout: float | None, cap: int = MAX_TRIALS) -> None:
    """--trials and/or --timeout: at least one, each positive; trials at most `cap`."""
    if trials is None and timeout is None:
        raise FeedbackError("give a budget: --trials N and/or --timeout SECONDS")
    if trials is not None and not 1 <= trials <= cap:
        raise FeedbackError(f"trials must be in [1, {cap}], got {trials}")
    if timeout is not None and not (math.isfinite(timeout) and timeout > 0):
        raise FeedbackError(f"timeout must be a positive number of seconds, got {timeout}")


# ---- pruning ----
class ClearlyWorsePruner(BasePruner):
    """Prune a trial whose subset-ΔPPL 95% CI lies wholly above the median subset ΔPPL of the
    completed trials (after `startup` of them); see the module docstring."""

    def __init__(self, startup: int = PRUNE_STARTUP):
        self.startup = startup

    def prune(self, study: optuna.Study, trial: FrozenTrial) -> bool:
        step = trial.last_step
        if step is None:
            return False
        others = [t.intermediate_values[step] for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                  if step in t.intermediate_values]
        if len(others) < self.startup:
            return False
        low = trial.user_attrs.get("subset_ci95", [math.nan])[0]
        if low is None or not math.isfinite(low):
            low = trial.intermediate_values[step]
        return low > median(others)


def subset_size(documents: int) -> int:
    """Documents a trial scores before the pruning decision: the first third, at least one (all of
    them when there is only one)."""
    return max(1, documents // 3)


# ---- scoring (as `evaluate` does it) ----
def _summary(pairs: list[tuple[np.ndarray, np.ndarray]], cfg: PPLConfig) -> dict:
    """ΔPPL % and its paired 95% CI over these documents' per-token NLLs, exactly as `evaluate`."""
    diffs = [fb - base for base, fb in pairs]
    lo, hi, method = paired_bootstrap(diffs, cfg.bootstrap, cfg.seed)
    mean_diff = float(np.concatenate(diffs).mean())
    return {"delta_pct": 100.0 * math.expm1(mean_diff), "ci95": [100.0 * math.expm1(lo), 100.0 * math.expm1(hi)],
            "ci_method": method, "tokens": int(sum(d.size for d in diffs))}


def _clean(x: Any) -> Any:
    """JSON-safe: NaN (no bootstrap) becomes null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, list):
        return [_clean(v) for v in x]
    return x


# ---- the log ----
def _read_log(path: Path) -> tuple[dict | None, list[dict], bool]:
    """(header, trials, whether the file needs rewriting): a last line cut off by a kill is dropped
    (that trial runs again); anything else that is not a tuning log is refused."""
    if not path.exists():
        return None, [], True
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    header, rows, cut = None, [], False
    for number, line in enumerate(lines, start=1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines) and number > 1:
                cut = True
                break
            raise FeedbackError(f"{path}:{number} is not JSON; this is not a tuning log") from None
        if header is None:
            if not isinstance(record, dict) or "header" not in record:
                raise FeedbackError(f"{path} has no tuning header on its first line; use another --out-dir")
            header = record["header"]
        else:
            rows.append(record)
    return header, rows, cut


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out |= _flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v}
    return out


def _mismatch(old: dict, new: dict) -> str | None:
    """The first setting in which two headers differ ("scoring.bootstrap: 100 there, 50 now"), or None."""
    a, b = _flat(old), _flat(new)
    for key in [*b, *(k for k in a if k not in b)]:  # in the header's order: strategy first
        if key.split(".")[0] in INFORMATIONAL:
            continue
        if a.get(key) != b.get(key):
            return f"{key}: {json.dumps(a.get(key))} there, {json.dumps(b.get(key))} now"
    return None


def jsonl_text(header: dict, rows: list[dict]) -> str:
    """The trials log as text: the header line, then one line per trial."""
    return "".join(json.dumps(r) + "\n" for r in [{"header": header}, *rows])


def _frozen(row: dict, space: dict[str, BaseDistribution], step: int) -> FrozenTrial:
    state = {"complete": TrialState.COMPLETE, "pruned": TrialState.PRUNED}.get(row["state"], TrialState.FAIL)
    inter = {step: row["subset_delta_pct"]} if row.get("subset_delta_pct") is not None else {}
    params = {k: v for k, v in row["params"].items() if k in space}
    return optuna.trial.create_trial(
        state=state, value=row["delta_pct"] if state == TrialState.COMPLETE else None, params=params,
        distributions={k: space[k] for k in params}, intermediate_values=inter,
        user_attrs={"subset_ci95": row.get("subset_ci95") or [None, None]})


def _sampler(seed: int, number: int, startup: int) -> optuna.samplers.TPESampler:
    """TPE seeded from (seed, trial number): see the module docstring."""
    state = int(np.random.SeedSequence([seed, number]).generate_state(1)[0])
    return optuna.samplers.TPESampler(seed=state, n_startup_trials=startup)


# ---- the search ----
def best_trial(rows: list[dict], strategy: str, fixed: dict | None = None) -> dict | None:
    """The completed trial with the lowest dev ΔPPL, settings with strength 0 left out (first on ties)."""
    live = [r for r in rows if r["state"] == "complete" and not is_noop(strategy, {**(fixed or {}), **r["params"]})]
    return min(live, key=lambda r: (r["delta_pct"], r["trial"])) if live else None


def run_tune(lm: LoadedModel, docs: list[Document], strategy: str, base: PPLConfig, fixed: dict | None = None, *,
             trials: int | None = None, timeout: float | None = None, seed: int = 0,
             out_dir: str | Path | None = None, test_docs: list[Document] | None = None, data: str = "",
             test: str = "", on_trial: Callable[[dict], None] | None = None, stop: threading.Event | None = None,
             progress: Callable[[str], None] | None = None, budget: Budget | None = None,
             startup_trials: int = STARTUP_TRIALS, prune_startup: int = PRUNE_STARTUP,
             max_trials: int = MAX_TRIALS) -> dict:
    """Search `strategy`'s parameters on `docs` (dev) and score the best point once on `test_docs`.

    `base` holds the scoring settings (mode, passes, window, stride, bootstrap, seed...); `fixed`
    the parameters not searched. `trials` is the total including trials already logged in `out_dir`
    (resumed); `timeout` the seconds this call may start new trials in (a trial under way finishes).
    `on_trial(row)` hears of every new trial; setting `stop` ends the search within one forward
    (raising `Stopped`), the trials finished so far being logged. Returns {"header", "trials",
    "best", "test", "importances"}; with `out_dir`, also writes trials.jsonl (as it goes), best.json
    and tune.html there."""
    check_budget(trials, timeout, max_trials)
    fixed = parse_fixed(fixed, strategy, lm.num_layers)
    space = search_space(strategy, lm.num_layers, fixed)
    cfg0 = dataclasses.replace(base, strategy=strategy, params=dict(fixed))
    cfg0.validate(lm.context_length)
    mode = cfg0.resolved_mode()
    docs = docs[: cfg0.max_docs] if cfg0.max_docs else docs
    if not docs:
        raise FeedbackError("the dev corpus holds no documents")
    items = [(d, ids) for d, ids in zip(docs, document_ids(lm, docs, cfg0)) if len(ids) >= 2]
    if not items:
        raise FeedbackError("no dev document has at least 2 tokens")
    if test_docs is not None:
        test_docs = test_docs[: cfg0.max_docs] if cfg0.max_docs else test_docs
        if not test_docs:
            raise FeedbackError("the test corpus holds no documents")
        if fingerprint(test_docs) == fingerprint(docs):
            raise FeedbackError("the test corpus is the dev corpus: the best point must be confirmed on held-out text")
    if budget is not None:
        counts = [len(ids) for _, ids in items]
        budget.check_scoring(*scoring_work(counts, cfg0, trials or max_trials))
        if test_docs is not None:
            budget.check_scoring(*scoring_work([len(i) for i in document_ids(lm, test_docs, cfg0)], cfg0))
    k = subset_size(len(items))
    header = {
        "format": FORMAT, "strategy": strategy, "fixed": fixed,
        "space": {n: json.loads(distribution_to_json(d)) for n, d in space.items()},
        "model": lm.name, "dtype": lm.dtype, "num_layers": lm.num_layers, "data": data,
        "corpus_fingerprint": fingerprint(docs), "documents": len(items),
        "scoring": {"mode": mode, "passes": cfg0.passes, "window": cfg0.window, "stride": cfg0.stride,
                    "chunk": cfg0.chunk, "max_docs": cfg0.max_docs, "max_tokens_per_doc": cfg0.max_tokens_per_doc,
                    "bootstrap": cfg0.bootstrap, "seed": cfg0.seed},
        "sampler": {"name": "TPE", "seed": seed, "startup_trials": startup_trials},
        "pruner": {"name": "clearly worse than the median", "subset_documents": k, "startup": prune_startup},
    }
    header = json.loads(json.dumps(header))  # as it reads back from the log (tuples as lists)
    log_path = Path(out_dir) / TRIALS_FILE if out_dir is not None else None
    rows: list[dict] = []
    if log_path is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        old, rows, cut = _read_log(log_path)
        if old is not None:
            diff = _mismatch(old, header)
            if diff:
                raise FeedbackError(f"{log_path} holds trials of a different tuning run ({diff}); use another "
                                    "--out-dir, or the same strategy, data and settings to resume")
        if old is None or cut:
            log_path.write_text(jsonl_text(header, rows), encoding="utf-8")

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="minimize", sampler=_sampler(seed, 0, startup_trials),
                                pruner=ClearlyWorsePruner(prune_startup))
    for row in rows:
        study.add_trial(_frozen(row, space, k))
    cache: dict = {}

    def score(part, cfg, trial_number, offset):
        out = []
        for i, (_doc, ids) in enumerate(part):
            out.append(token_nlls(lm, ids, cfg, cache, stop))
            if progress:
                progress(f"trial {trial_number}: document {offset + i + 1} of {len(items)} scored")
        return out

    started = time.monotonic()
    while (trials is None or len(rows) < trials) and (timeout is None or time.monotonic() - started < timeout):
        check_stop(stop, "the tuning")
        study.sampler = _sampler(seed, len(study.trials), startup_trials)
        trial = _ask(study, space, strategy, fixed)
        params = dict(trial.params)
        t0 = time.monotonic()
        row: dict = {"trial": trial.number, "params": params}
        try:
            values = build_strategy(strategy, {**fixed, **params}, lm.num_layers).values
        except FeedbackError as exc:  # a combination the strategy's cross-parameter check refuses
            study.tell(trial, state=TrialState.FAIL)
            row |= {"state": "failed", "error": str(exc), "delta_pct": None, "ci95": None, "subset_delta_pct": None,
                    "subset_ci95": None, "docs_scored": 0, "documents": len(items), "tokens": 0,
                    "seconds": time.monotonic() - t0}
        else:
            cfg = dataclasses.replace(cfg0, params=values)
            try:
                pairs = score(items[:k], cfg, trial.number, 0)
                sub = _summary(pairs, cfg)
                trial.set_user_attr("subset_ci95", _clean(sub["ci95"]))
                trial.report(sub["delta_pct"], k)
                pruned = k < len(items) and trial.should_prune()
                if not pruned:
                    pairs += score(items[k:], cfg, trial.number, k)
            except BaseException:
                study.tell(trial, state=TrialState.FAIL)
                raise
            full = sub if pruned else _summary(pairs, cfg)
            if pruned:
                study.tell(trial, state=TrialState.PRUNED)
            else:
                study.tell(trial, full["delta_pct"])
            row |= {"state": "pruned" if pruned else "complete", "delta_pct": full["delta_pct"],
                    "ci95": _clean(full["ci95"]), "subset_delta_pct": sub["delta_pct"],
                    "subset_ci95": _clean(sub["ci95"]), "docs_scored": len(pairs), "documents": len(items),
                    "tokens": full["tokens"], "seconds": time.monotonic() - t0}
        rows.append(row)
        if log_path is not None:
            with log_path.open("a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")
        if on_trial:
            on_trial(row)

    best = best_trial(rows, strategy, fixed)
    result = {"header": header, "trials": rows, "best": None, "test": None, "test_evaluations": 0,
              "importances": importances(study)}
    if best is not None:
        result["best"] = best | {"strategy_params": build_strategy(strategy, {**fixed, **best["params"]},
                                                                   lm.num_layers).values}
    best_path = Path(out_dir) / BEST_FILE if out_dir is not None else None
    previous = json.loads(best_path.read_text(encoding="utf-8")) if best_path is not None and best_path.exists() else {}
    result["test_evaluations"] = previous.get("test_evaluations", 0)
    if best is not None and test_docs is not None:
        test_print = fingerprint(test_docs)
        same = (previous.get("best") or {}).get("trial") == best["trial"] and previous.get("test") and \
            previous.get("test_fingerprint") == test_print and not _mismatch(previous.get("header", {}), header)
        if same:
            result["test"] = previous["test"]  # this point was scored on test already: not again
        else:
            check_stop(stop, "the tuning")
            cfg = dataclasses.replace(cfg0, params=result["best"]["strategy_params"])
            test_progress = (lambda d, n, _name: progress(f"test: document {d} of {n} scored")) if progress else None
            res = evaluate(lm, test_docs, cfg, progress=test_progress, baseline_cache=cache, stop=stop)
            res["data"] = test
            result["test"] = res
            result["test_evaluations"] += 1
        result["test_fingerprint"] = test_print
    if out_dir is not None:
        record = {k: result.get(k) for k in ("header", "best", "test", "test_evaluations", "test_fingerprint")}
        best_path.write_text(json.dumps(record, indent=2), encoding="utf-8")
        write_html(Path(out_dir) / HTML_FILE, rows, result["importances"],
                   f"{strategy} on {data or 'dev'}: ΔPPL % vs baseline per trial ({mode})")
    return result


def importances(study: optuna.Study) -> dict[str, float]:
    """Parameter importances (PED-ANOVA; needs no scikit-learn) over the completed trials; empty
    with fewer than 2 of them or when they cannot be computed (e.g. all values alike)."""
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if len(complete) < 2:
        return {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            evaluator = optuna.importance.PedAnovaImportanceEvaluator()
            return {k: float(v) for k, v in optuna.importance.get_param_importances(study, evaluator=evaluator).items()}
    except (ValueError, RuntimeError, ZeroDivisionError):
        return {}


# ---- reporting ----
def format_params(params: dict) -> str:
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


def table_row(row: dict) -> list:
    """[trial, params, ΔPPL % dev, state] for tables (the command line's and the page's)."""
    if row["delta_pct"] is None:
        delta = row.get("error", "")
    else:
        delta = f"{row['delta_pct']:+.3f}"
        if row["state"] == "pruned":
            delta += f" (first {row['docs_scored']} of {row['documents']} docs)"
    return [row["trial"], format_params(row["params"]), delta, row["state"]]


def history_figure(rows: list[dict], title: str = "") -> go.Figure:
    """ΔPPL % per trial (pruned trials: their subset value, hollow) and the running best of the
    completed trials."""
    done = [r for r in rows if r["state"] == "complete"]
    pruned = [r for r in rows if r["state"] == "pruned"]
    best_x, best_y, low = [], [], math.inf
    for r in done:
        low = min(low, r["delta_pct"])
        best_x.append(r["trial"])
        best_y.append(low)

    def hover(r: dict) -> str:
        return format_params(r["params"]).replace(", ", "<br>")

    traces = [
        dict(type="scatter", mode="markers", name="trial (all dev documents)", x=[r["trial"] for r in done],
             y=[r["delta_pct"] for r in done], text=[hover(r) for r in done], marker=dict(color="#555", size=8),
             hovertemplate="trial %{x}: ΔPPL %{y:+.3f}%<br>%{text}<extra></extra>"),
        dict(type="scatter", mode="markers", name="pruned (first documents only)", x=[r["trial"] for r in pruned],
             y=[r["delta_pct"] for r in pruned], text=[hover(r) for r in pruned],
             marker=dict(color=WORSE, size=8, symbol="circle-open", line=dict(width=2)),
             hovertemplate="trial %{x} pruned: ΔPPL %{y:+.3f}% on its first documents<br>%{text}<extra></extra>"),
        dict(type="scatter", mode="lines", name="best so far", x=best_x, y=best_y, line=dict(color=BETTER, width=2,
                                                                                          shape="hv"),
             hovertemplate="best so far %{y:+.3f}%<extra></extra>"),
    ]
    return figure(traces, 360, "trial", "ΔPPL % (lower is better)", title=dict(text=title, font=dict(size=13)),
                  hovermode="closest", margin=dict(l=60, r=15, t=50, b=45))


def importance_figure(values: dict[str, float], title: str = "Parameter importance (PED-ANOVA)") -> go.Figure:
    names = list(values)[::-1]
    trace = dict(type="bar", orientation="h", x=[values[n] for n in names], y=names, marker=dict(color=BETTER),
                 hovertemplate="%{y}: %{x:.3f}<extra></extra>")
    return figure([trace], 120 + 30 * len(names), "importance (share)", "", title=dict(text=title, font=dict(size=13)),
                  hovermode="closest", margin=dict(l=90, r=15, t=50, b=45))


def write_html(path: Path, rows: list[dict], values: dict[str, float], title: str) -> None:
    """One self-contained page: the history, then the importances (or why there are none)."""
    parts = [history_figure(rows, title).to_html(full_html=False, include_plotlyjs=True)]
    if values:
        parts.append(importance_figure(values).to_html(full_html=False, include_plotlyjs=False))
    else:
        parts.append("<p>Parameter importances need at least 2 completed trials that differ.</p>")
    path.write_text(f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>{title}</title></head><body>'
                    + "".join(parts) + "</body></html>", encoding="utf-8")
