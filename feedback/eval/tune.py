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

Pieces. `run_tune` is the protocol; each step is its own part: `TuneSettings` (budget, sampler,
pruner, out-dir), the search space (`search_space`, `_ask`), the documents (`prepare` ->
`TuneData`), the log (`TrialLog`), one trial with its pruning (`Search.run_trial`,
`ClearlyWorsePruner`), the test scored once (`score_test_once`). The figures and table rows are in
`feedback.eval.figures`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from statistics import median

import numpy as np
import optuna
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
    distribution_to_json,
)
from optuna.pruners import BasePruner
from optuna.trial import FrozenTrial, TrialState

from feedback.core.budget import Budget
from feedback.core.model import LoadedModel
from feedback.core.strict_json import json_safe
from feedback.errors import FeedbackError, check_stop
from feedback.eval.corpus import Document, fingerprint
from feedback.eval.figures import write_html
from feedback.eval.perplexity import (
    Estimate,
    PPLConfig,
    ScoringProgress,
    Tally,
    document_ids,
    estimate,
    evaluate,
    paired_bootstrap,
    token_nlls,
)
from feedback.eval.sweep import is_noop
from feedback.strategies import build_strategy, get_strategy

FORMAT = 1  # of trials.jsonl
MAX_TRIALS = 10_000
STARTUP_TRIALS = 10  # TPE's random trials before it models the results (Optuna's default)
PRUNE_STARTUP = 4  # completed trials before any trial is pruned
TRIALS_FILE, BEST_FILE, HTML_FILE = "trials.jsonl", "best.json", "tune.html"
# Header keys that describe a run without changing its trials: not compared on resume.
INFORMATIONAL = ("data",)


# ---- the settings ----
def check_budget(trials: int | None, timeout: float | None, cap: int = MAX_TRIALS) -> None:
    """--trials and/or --timeout: at least one, each positive; trials at most `cap`."""
    if trials is None and timeout is None:
        raise FeedbackError("give a budget: --trials N and/or --timeout SECONDS")
    if trials is not None and not 1 <= trials <= cap:
        raise FeedbackError(f"trials must be in [1, {cap}], got {trials}")
    if timeout is not None and not (math.isfinite(timeout) and timeout > 0):
        raise FeedbackError(f"timeout must be a positive number of seconds, got {timeout}")


@dataclass(frozen=True)
class TuneSettings:
    """How a search runs, apart from what it scores: its budget (`trials`, the total including
    logged ones, and/or `timeout`, the seconds this call may start new trials in), the sampler's seed
    and random startup, the pruner's startup, the cap on `trials` (a served page sets a lower one),
    and where the log and results go (`out_dir`; None: nothing written). `data` and `test` name the
    two corpora in the header and the test result."""

    trials: int | None = None
    timeout: float | None = None
    seed: int = 0
    startup_trials: int = STARTUP_TRIALS
    prune_startup: int = PRUNE_STARTUP
    max_trials: int = MAX_TRIALS
    out_dir: str | Path | None = None
    data: str = ""
    test: str = ""

    def check(self) -> None:
        check_budget(self.trials, self.timeout, self.max_trials)

    def more(self, done: int, elapsed: float) -> bool:
        """Whether another trial may start, `done` being logged and `elapsed` seconds gone."""
        return (self.trials is None or done < self.trials) and (
            self.timeout is None or elapsed < self.timeout
        )


# ---- the search space ----
def searched_names(strategy: str, fixed: dict | None = None) -> list[str]:
    """The parameters the tuner searches (tunable and not fixed); refused when there are none.
    Needs no model, so the command line can refuse before loading one."""
    cls = get_strategy(strategy)
    known = {p.name for p in cls.params}
    unknown = sorted(set(fixed or {}) - known)
    if unknown:
        raise FeedbackError(
            f"unknown parameter(s) {', '.join(unknown)} for strategy {strategy}; "
            f"it takes {', '.join(known) or 'none'}"
        )
    tunable = [p.name for p in cls.params if p.tunable]
    if not tunable:
        raise FeedbackError(f"strategy {strategy} has no tunable parameters")
    names = [n for n in tunable if n not in (fixed or {})]
    if not names:
        raise FeedbackError(
            f"every tunable parameter of {strategy} is fixed ({', '.join(tunable)}); "
            "leave at least one free to tune"
        )
    return names


def parse_fixed(fixed: dict | list | None, strategy: str, num_layers: int) -> dict:
    """`--param` values, parsed and checked by the strategy's schema; only the names given."""
    given = dict(fixed or {})
    searched_names(strategy, given)
    values = get_strategy(strategy).validate(given, num_layers)
    out = {k: values[k] for k in given}
    if is_noop(strategy, out):
        raise FeedbackError(
            f"{get_strategy(strategy).off_settings()} switches {strategy} off: every trial "
            "would measure the baseline again"
        )
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


# ---- the documents ----
def subset_size(documents: int) -> int:
    """Documents a trial scores before the pruning decision: the first third, at least one (all of
    them when there is only one)."""
    return max(1, documents // 3)


@dataclass(frozen=True)
class TuneData:
    """What a run scores: the scoring settings (strategy and fixed parameters filled in) and their
    mode, the dev documents as capped by `max_docs`, those of at least 2 tokens with their token ids,
    and the test documents (None: no test scoring)."""

    cfg: PPLConfig
    mode: str
    docs: list[Document]
    items: list[tuple[Document, list[int]]]
    test_docs: list[Document] | None

    @property
    def subset(self) -> int:
        return subset_size(len(self.items))

    def estimates(self, lm: LoadedModel, trials: int) -> tuple[Estimate, Estimate | None]:
        """What the search will score at most (every trial in full; a pruned one scores a third),
        and the test scored once (None: no test)."""
        dev = estimate([len(ids) for _, ids in self.items], self.cfg, trials)
        if self.test_docs is None:
            return dev, None
        return dev, estimate([len(ids) for ids in document_ids(lm, self.test_docs, self.cfg)], self.cfg)

    def check_work(self, lm: LoadedModel, budget: Budget, trials: int) -> None:
        """Refuse a search whose scoring (`trials` dev passes, then the test once) the budget cannot pay."""
        for est in filter(None, self.estimates(lm, trials)):
            budget.check_scoring(est.forwards, est.how)


def _capped(docs: list[Document], cfg: PPLConfig) -> list[Document]:
    return docs[: cfg.max_docs] if cfg.max_docs else docs


def prepare(
    lm: LoadedModel,
    docs: list[Document],
    test_docs: list[Document] | None,
    strategy: str,
    base: PPLConfig,
    fixed: dict,
) -> TuneData:
    """The scoring settings checked and the documents cut as `evaluate` cuts them; refused when no
    dev document can be scored, or when the test corpus is empty or is the dev corpus."""
    cfg = dataclasses.replace(base, strategy=strategy, params=dict(fixed))
    cfg.validate(lm.context_length)
    mode = cfg.resolved_mode()
    docs = _capped(docs, cfg)
    if not docs:
        raise FeedbackError("the dev corpus holds no documents")
    items = [(d, ids) for d, ids in zip(docs, document_ids(lm, docs, cfg)) if len(ids) >= 2]
    if not items:
        raise FeedbackError("no dev document has at least 2 tokens")
    if test_docs is not None:
        test_docs = _capped(test_docs, cfg)
        if not test_docs:
            raise FeedbackError("the test corpus holds no documents")
        if fingerprint(test_docs) == fingerprint(docs):
            raise FeedbackError(
                "the test corpus is the dev corpus: the best point must be confirmed on held-out text"
            )
    return TuneData(cfg, mode, docs, items, test_docs)


def run_header(
    lm: LoadedModel,
    strategy: str,
    fixed: dict,
    space: dict[str, BaseDistribution],
    data: TuneData,
    settings: TuneSettings,
) -> dict:
    """The log's header: everything that decides a run's trials (see the module docstring), as it
    reads back from the log (tuples as lists)."""
    cfg = data.cfg
    header = {
        "format": FORMAT,
        "strategy": strategy,
        "fixed": fixed,
        "space": {n: json.loads(distribution_to_json(d)) for n, d in space.items()},
        "model": lm.name,
        "dtype": lm.dtype,
        "num_layers": lm.num_layers,
        "data": settings.data,
        "corpus_fingerprint": fingerprint(data.docs),
        "documents": len(data.items),
        "scoring": {
            "mode": data.mode,
            "passes": cfg.passes,
            "window": cfg.window,
            "stride": cfg.stride,
            "chunk": cfg.chunk,
            "max_docs": cfg.max_docs,
            "max_tokens_per_doc": cfg.max_tokens_per_doc,
            "bootstrap": cfg.bootstrap,
            "seed": cfg.seed,
        },
        "sampler": {"name": "TPE", "seed": settings.seed, "startup_trials": settings.startup_trials},
        "pruner": {
            "name": "clearly worse than the median",
            "subset_documents": data.subset,
            "startup": settings.prune_startup,
        },
    }
    return json.loads(json.dumps(header))


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


class TrialLog:
    """A run's trials in order; with a folder, also `OUT_DIR/trials.jsonl` (the header line, then
    one line per trial, appended as each ends, so a killed run loses at most the trial under way)."""

    def __init__(self, path: Path | None, rows: list[dict]):
        self.path, self.rows = path, rows

    @classmethod
    def open(cls, out_dir: str | Path | None, header: dict) -> TrialLog:
        """The log of `out_dir` with its trials read back (a resume), or a new one with `header`;
        refused when the folder's log is another run's (naming the first difference) or no tuning
        log. Without a folder: an empty log kept in memory."""
        if out_dir is None:
            return cls(None, [])
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        path = Path(out_dir) / TRIALS_FILE
        old, rows, cut = _read_log(path)
        if old is not None:
            diff = _mismatch(old, header)
            if diff:
                raise FeedbackError(
                    f"{path} holds trials of a different tuning run ({diff}); use another "
                    "--out-dir, or the same strategy, data and settings to resume"
                )
        if old is None or cut:  # a new log, or one whose cut-off last line is dropped
            path.write_text(jsonl_text(header, rows), encoding="utf-8")
        return cls(path, rows)

    def append(self, row: dict) -> None:
        self.rows.append(row)
        if self.path is not None:
            with self.path.open("a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")


# ---- one trial and its pruning ----
def clearly_worse(low: float | None, value: float, others: list[float], startup: int = PRUNE_STARTUP) -> bool:
    """The pruning decision: a trial whose subset ΔPPL is `value` with its CI starting at `low` (None
    or NaN without a bootstrap: `value` stands in) is clearly worse when, with at least `startup`
    completed trials' subset ΔPPLs in `others`, that lower bound lies above their median."""
    if len(others) < startup:
        return False
    if low is None or not math.isfinite(low):
        low = value
    return low > median(others)


class ClearlyWorsePruner(BasePruner):
    """Prune a trial whose subset-ΔPPL 95% CI lies wholly above the median subset ΔPPL of the
    completed trials (after `startup` of them); see the module docstring."""

    def __init__(self, startup: int = PRUNE_STARTUP):
        self.startup = startup

    def prune(self, study: optuna.Study, trial: FrozenTrial) -> bool:
        step = trial.last_step
        if step is None:
            return False
        others = [
            t.intermediate_values[step]
            for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if step in t.intermediate_values
        ]
        low = trial.user_attrs.get("subset_ci95", [math.nan])[0]
        return clearly_worse(low, trial.intermediate_values[step], others, self.startup)


def _summary(pairs: list[tuple[np.ndarray, np.ndarray]], cfg: PPLConfig) -> dict:
    """ΔPPL % and its paired 95% CI over these documents' per-token NLLs, exactly as `evaluate`."""
    diffs = [fb - base for base, fb in pairs]
    lo, hi, method = paired_bootstrap(diffs, cfg.bootstrap, cfg.seed)
    mean_diff = float(np.concatenate(diffs).mean())
    return {
        "delta_pct": 100.0 * math.expm1(mean_diff),
        "ci95": [100.0 * math.expm1(lo), 100.0 * math.expm1(hi)],
        "ci_method": method,
        "tokens": int(sum(d.size for d in diffs)),
    }


def _frozen(row: dict, space: dict[str, BaseDistribution], step: int) -> FrozenTrial:
    state = {"complete": TrialState.COMPLETE, "pruned": TrialState.PRUNED}.get(row["state"], TrialState.FAIL)
    inter = {step: row["subset_delta_pct"]} if row.get("subset_delta_pct") is not None else {}
    params = {k: v for k, v in row["params"].items() if k in space}
    return optuna.trial.create_trial(
        state=state,
        value=row["delta_pct"] if state == TrialState.COMPLETE else None,
        params=params,
        distributions={k: space[k] for k in params},
        intermediate_values=inter,
        user_attrs={"subset_ci95": row.get("subset_ci95") or [None, None]},
    )


def _sampler(seed: int, number: int, startup: int) -> optuna.samplers.TPESampler:
    """TPE seeded from (seed, trial number): see the module docstring."""
    state = int(np.random.SeedSequence([seed, number]).generate_state(1)[0])
    return optuna.samplers.TPESampler(seed=state, n_startup_trials=startup)


class Search:
    """The Optuna study of one run and the baseline NLLs every trial shares (`cache`, filled by the
    first trial and reused by the test scoring): each trial is asked for, scored on the first
    documents, pruned or scored on the rest, and told to the study."""

    def __init__(
        self,
        lm: LoadedModel,
        strategy: str,
        fixed: dict,
        space: dict[str, BaseDistribution],
        data: TuneData,
        settings: TuneSettings,
        stop: threading.Event | None = None,
        tally: Tally | None = None,
    ):
        self.lm, self.strategy, self.fixed, self.space, self.data = lm, strategy, fixed, space, data
        self.seed, self.startup = settings.seed, settings.startup_trials
        self.stop, self.tally = stop, tally
        self.cache: dict = {}
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.study = optuna.create_study(
            direction="minimize",
            sampler=_sampler(self.seed, 0, self.startup),
            pruner=ClearlyWorsePruner(settings.prune_startup),
        )

    def resume(self, rows: list[dict]) -> None:
        """Re-add logged trials, so the sampler and the pruner see them as they were."""
        for row in rows:
            self.study.add_trial(_frozen(row, self.space, self.data.subset))

    def run_trial(self) -> dict:
        """One new trial run to its end, complete, pruned or failed (a combination the strategy
        refuses): its log row. A stop or an error inside it fails the trial and propagates."""
        self.study.sampler = _sampler(self.seed, len(self.study.trials), self.startup)
        trial = _ask(self.study, self.space, self.strategy, self.fixed)
        row: dict = {"trial": trial.number, "params": dict(trial.params)}
        t0 = time.monotonic()
        try:
            values = build_strategy(self.strategy, {**self.fixed, **row["params"]}, self.lm.num_layers).values
        except FeedbackError as exc:  # a combination the strategy's cross-parameter check refuses
            self.study.tell(trial, state=TrialState.FAIL)
            return row | {
                "state": "failed",
                "error": str(exc),
                "delta_pct": None,
                "ci95": None,
                "subset_delta_pct": None,
                "subset_ci95": None,
                "docs_scored": 0,
                "documents": len(self.data.items),
                "tokens": 0,
                "seconds": time.monotonic() - t0,
            }
        try:
            scored = self._score(trial, dataclasses.replace(self.data.cfg, params=values))
        except BaseException:
            self.study.tell(trial, state=TrialState.FAIL)
            raise
        if scored["state"] == "pruned":
            self.study.tell(trial, state=TrialState.PRUNED)
        else:
            self.study.tell(trial, scored["delta_pct"])
        return row | scored | {"seconds": time.monotonic() - t0}

    def _score(self, trial: optuna.Trial, cfg: PPLConfig) -> dict:
        """The first documents, the pruner's decision on them, then (unless pruned) the rest."""
        k, n = self.data.subset, len(self.data.items)
        if self.tally is not None:  # a trial's tokens are all its documents'; a pruned one stops short
            self.tally.point = trial.number + 1
            self.tally.begin(n, sum(len(ids) - 1 for _, ids in self.data.items))
        pairs = self._nlls(cfg, 0, k)
        sub = _summary(pairs, cfg)
        trial.set_user_attr("subset_ci95", json_safe(sub["ci95"]))
        trial.report(sub["delta_pct"], k)
        pruned = k < n and trial.should_prune()
        if not pruned:
            pairs += self._nlls(cfg, k, n)
        full = sub if pruned else _summary(pairs, cfg)
        return {
            "state": "pruned" if pruned else "complete",
            "delta_pct": full["delta_pct"],
            "ci95": json_safe(full["ci95"]),
            "subset_delta_pct": sub["delta_pct"],
            "subset_ci95": json_safe(sub["ci95"]),
            "docs_scored": len(pairs),
            "documents": n,
            "tokens": full["tokens"],
        }

    def _nlls(self, cfg: PPLConfig, start: int, end: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """(baseline, strategy) per-token NLLs of dev documents start..end-1, every window tallied."""
        out = []
        for i in range(start, end):
            if self.tally is not None:
                self.tally.document = i + 1
            out.append(
                token_nlls(
                    self.lm,
                    self.data.items[i][1],
                    cfg,
                    self.cache,
                    self.stop,
                    self.tally.window if self.tally is not None else None,
                )
            )
        return out


# ---- the best point, scored once on test ----
def best_trial(rows: list[dict], strategy: str, fixed: dict | None = None) -> dict | None:
    """The completed trial with the lowest dev ΔPPL, settings with strength 0 left out (first on ties).
    It may still be no better than the baseline: `feedback.eval.verdict` judges it, dev and test."""
    live = [
        r
        for r in rows
        if r["state"] == "complete" and not is_noop(strategy, {**(fixed or {}), **r["params"]})
    ]
    return min(live, key=lambda r: (r["delta_pct"], r["trial"])) if live else None


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
            return {
                k: float(v)
                for k, v in optuna.importance.get_param_importances(study, evaluator=evaluator).items()
            }
    except (ValueError, RuntimeError, ZeroDivisionError):
        return {}


def _previous(out_dir: str | Path | None) -> dict:
    """best.json of an earlier run in `out_dir`, or {}."""
    path = Path(out_dir) / BEST_FILE if out_dir is not None else None
    return json.loads(path.read_text(encoding="utf-8")) if path is not None and path.exists() else {}


def score_test_once(
    lm: LoadedModel,
    data: TuneData,
    best: dict,
    previous: dict,
    header: dict,
    name: str,
    cache: dict | None = None,
    stop: threading.Event | None = None,
    tally: Tally | None = None,
) -> dict:
    """{"test", "test_evaluations", "test_fingerprint"}: `best` (with its "strategy_params") scored
    on the test documents with `evaluate`, unless `previous` (the folder's best.json) already holds
    this trial's result on the same test text under the same header: then that result, not scored
    again. `test_evaluations` counts the different best points the test text has scored."""
    test_print = fingerprint(data.test_docs)
    done = previous.get("test_evaluations", 0)
    if (
        (previous.get("best") or {}).get("trial") == best["trial"]
        and previous.get("test")
        and previous.get("test_fingerprint") == test_print
        and not _mismatch(previous.get("header", {}), header)
    ):
        return {"test": previous["test"], "test_evaluations": done, "test_fingerprint": test_print}
    check_stop(stop, "the tuning")
    cfg = dataclasses.replace(data.cfg, params=best["strategy_params"])
    if tally is not None:
        tally.stage, tally.point, tally.points = "test", 1, 1
    res = evaluate(lm, data.test_docs, cfg, baseline_cache=cache, stop=stop, tally=tally)
    res["data"] = name
    return {"test": res, "test_evaluations": done + 1, "test_fingerprint": test_print}


def write_results(out_dir: str | Path, result: dict, title: str) -> None:
    """best.json (the header, the best dev trial and its test result) and tune.html."""
    record = {k: result.get(k) for k in ("header", "best", "test", "test_evaluations", "test_fingerprint")}
    (Path(out_dir) / BEST_FILE).write_text(json.dumps(record, indent=2), encoding="utf-8")
    write_html(Path(out_dir) / HTML_FILE, result["trials"], result["importances"], title)


# ---- the protocol ----
def run_tune(
    lm: LoadedModel,
    docs: list[Document],
    strategy: str,
    base: PPLConfig,
    fixed: dict | None,
    settings: TuneSettings,
    *,
    test_docs: list[Document] | None = None,
    on_trial: Callable[[dict], None] | None = None,
    stop: threading.Event | None = None,
    progress: Callable[[ScoringProgress], None] | None = None,
    budget: Budget | None = None,
) -> dict:
    """Search `strategy`'s parameters on `docs` (dev) and score the best point once on `test_docs`.

    `base` holds the scoring settings (mode, passes, window, stride, bootstrap, seed...); `fixed`
    the parameters not searched; `settings` the budget, sampler, pruner and out-dir (a log there is
    resumed). `on_trial(row)` hears of every new trial; setting `stop` ends the search within one
    forward (raising `Stopped`), the trials finished so far being logged; `progress` hears after
    every window where the search stands (trial, document, tokens; then the test); `budget` refuses
    a search it cannot pay for before any scoring. Returns {"header", "trials", "best", "test",
    "test_evaluations", "importances"} (and "test_fingerprint" once a test result exists); with an
    out-dir, also writes trials.jsonl (as it goes), best.json and tune.html there."""
    settings.check()
    fixed = parse_fixed(fixed, strategy, lm.num_layers)
    space = search_space(strategy, lm.num_layers, fixed)
    data = prepare(lm, docs, test_docs, strategy, base, fixed)
    if budget is not None:
        data.check_work(lm, budget, settings.trials or settings.max_trials)
    header = run_header(lm, strategy, fixed, space, data, settings)
    log = TrialLog.open(settings.out_dir, header)
    tally = Tally(progress, settings.trials or 0, "trial") if progress else None  # trials: 0 when only timed
    search = Search(lm, strategy, fixed, space, data, settings, stop, tally)
    search.resume(log.rows)
    started = time.monotonic()
    while settings.more(len(log.rows), time.monotonic() - started):
        check_stop(stop, "the tuning")
        row = search.run_trial()
        log.append(row)
        if on_trial:
            on_trial(row)

    best = best_trial(log.rows, strategy, fixed)
    if best is not None:
        best = best | {
            "strategy_params": build_strategy(strategy, {**fixed, **best["params"]}, lm.num_layers).values
        }
    previous = _previous(settings.out_dir)
    result = {
        "header": header,
        "trials": log.rows,
        "best": best,
        "test": None,
        "test_evaluations": previous.get("test_evaluations", 0),
        "importances": importances(search.study),
    }
    if best is not None and data.test_docs is not None:
        result |= score_test_once(lm, data, best, previous, header, settings.test, search.cache, stop, tally)
    if settings.out_dir is not None:
        write_results(
            settings.out_dir,
            result,
            f"{strategy} on {settings.data or 'dev'}: ΔPPL % vs baseline per trial ({data.mode})",
        )
    return result
