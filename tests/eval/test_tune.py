"""The tuner (feedback/eval/tune.py) on the tiny random model and a few short documents: the search space
from the Param schema, reproducibility, resume, pruning, bad input, the files, the test split scored
once, Stop; and its pieces on their own: the settings, the trials log, the pruning decision, the
test scoring's reuse rule."""

from __future__ import annotations

import json
import math
import threading

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

from feedback.errors import FeedbackError, Stopped
from feedback.eval import tune
from feedback.eval.corpus import Document
from feedback.eval.figures import table_row
from feedback.eval.perplexity import PPLConfig, evaluate
from feedback.strategies import REGISTRY, Param
from feedback.strategies.deep_cache import DeepCacheStrategy

WORDS = (
    "amber basalt cobalt dune ember fjord garnet harbour iris jasper kelp lagoon meadow nectar onyx prairie "
    "quartz reef saffron tundra umber valley willow xenon yarrow zephyr"
).split()
# Six short documents, no word twice in one: a token the text has not shown before gets nothing from a cache.
DOCS = [
    Document(f"d{i}", " ".join(WORDS[(5 * i + j) % len(WORDS)] for j in range(12)) + ".") for i in range(6)
]
TEST = [
    Document("t0", "A held-out line about rivers, stones and the colour of the evening sky."),
    Document("t1", "Another held-out sentence, mentioning lists, keys and values."),
]
BASE = PPLConfig(bootstrap=200)
CALL = (
    "test_docs",
    "on_trial",
    "stop",
    "progress",
    "budget",
)  # run_tune's own keywords; the rest are settings


def run(lm, strategy="deep_cache", fixed=None, **kw):
    kw.setdefault("trials", 5)
    call = {k: kw.pop(k) for k in CALL if k in kw}
    return tune.run_tune(lm, DOCS, strategy, BASE, fixed or {}, tune.TuneSettings(**kw), **call)


def test_search_space_follows_the_param_schema(tiny_lm, monkeypatch):
    space = tune.search_space("deep_cache", tiny_lm.num_layers, {"window": 64})
    assert list(space) == ["lam", "theta", "layer", "gate", "max_p"]  # window fixed, so not searched
    assert space["lam"] == FloatDistribution(0.002, 0.3, log=True)
    assert space["layer"] == IntDistribution(0, tiny_lm.num_layers - 1)  # every layer
    assert space["gate"] == FloatDistribution(-1.0, 0.98)
    assert tune.search_space("soft_token", 4)["top_k"] == IntDistribution(1, 256, log=True)

    class Choosy(DeepCacheStrategy):
        name = "choosy"
        params = (
            Param("lam", float, 0.02, "", 0.0, 1.0, search=(0.01, 0.1)),
            Param("mode", str, "a", "", choices=("a", "b", "c"), search=("a", "c")),
            Param("theta", float, 50.0, "", 0.0, 1000.0),
        )  # no search range: kept at its default

    monkeypatch.setitem(REGISTRY, "choosy", Choosy)
    space = tune.search_space("choosy", 4)
    assert space == {"lam": FloatDistribution(0.01, 0.1), "mode": CategoricalDistribution(("a", "c"))}


def test_same_seed_same_trials_and_each_number_is_evaluate_s(tiny_lm):
    first, again, other = run(tiny_lm, trials=4), run(tiny_lm, trials=4), run(tiny_lm, trials=4, seed=1)
    key = lambda res: [(r["params"], r["state"], r["delta_pct"]) for r in res["trials"]]  # noqa: E731
    assert key(first) == key(again)
    assert [r["params"] for r in first["trials"]] != [r["params"] for r in other["trials"]]
    row = first["trials"][0]
    assert row["state"] == "complete" and row["docs_scored"] == len(DOCS)
    direct = evaluate(tiny_lm, DOCS, PPLConfig("deep_cache", row["params"], bootstrap=200))
    assert row["delta_pct"] == pytest.approx(direct["delta_pct"], rel=1e-12)
    assert row["ci95"] == pytest.approx(direct["ci95"], rel=1e-12)


def test_a_stack_is_tuned_jointly_and_each_number_is_evaluate_s(tiny_lm):
    res = run(
        tiny_lm, "inner_loop+deep_cache", {"inner_loop.mode": "loop", "deep_cache.window": 64}, trials=3
    )
    row = res["trials"][0]
    assert {"inner_loop.beta", "deep_cache.lam"} <= set(row["params"]) and "deep_cache.window" not in row[
        "params"
    ]
    params = {"inner_loop.mode": "loop", "deep_cache.window": 64, **row["params"]}
    direct = evaluate(tiny_lm, DOCS, PPLConfig("inner_loop+deep_cache", params, bootstrap=200))
    assert row["state"] == "complete" and row["delta_pct"] == pytest.approx(direct["delta_pct"], rel=1e-12)
    assert res["best"]["strategy_params"]["deep_cache.window"] == 64


def test_resume_continues_the_log_and_samples_what_one_run_would(tiny_lm, tmp_path):
    new: list[int] = []
    run(tiny_lm, trials=3, out_dir=tmp_path / "a")
    resumed = run(tiny_lm, trials=5, out_dir=tmp_path / "a", on_trial=lambda r: new.append(r["trial"]))
    assert new == [3, 4]  # the three logged trials are not run again
    whole = run(tiny_lm, trials=5, out_dir=tmp_path / "b")
    assert [r["params"] for r in resumed["trials"]] == [r["params"] for r in whole["trials"]]
    lines = (tmp_path / "a" / tune.TRIALS_FILE).read_text().splitlines()
    assert len(lines) == 6 and "header" in json.loads(lines[0])
    # a line cut off by a kill is dropped and that trial runs again
    (tmp_path / "a" / tune.TRIALS_FILE).write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:20])
    new.clear()
    again = run(tiny_lm, trials=5, out_dir=tmp_path / "a", on_trial=lambda r: new.append(r["trial"]))
    assert new == [4] and again["trials"][4]["params"] == whole["trials"][4]["params"]


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(strategy="soft_token"), 'strategy: "deep_cache" there, "soft_token" now'),
        (dict(fixed={"gate": -1.0}), "fixed.gate: null there, -1.0 now"),
        (dict(base=PPLConfig(bootstrap=100)), "scoring.bootstrap: 200 there, 100 now"),
        (dict(docs=DOCS[:5]), "corpus_fingerprint"),
        (dict(seed=3), "sampler.seed"),
    ],
)
def test_a_resume_with_other_settings_is_refused(tiny_lm, tmp_path, change, message):
    run(tiny_lm, trials=1, out_dir=tmp_path)
    kw = dict(strategy="deep_cache", fixed={}, base=BASE, docs=DOCS, seed=0) | change
    with pytest.raises(FeedbackError, match="holds trials of a different tuning run") as err:
        tune.run_tune(
            tiny_lm,
            kw["docs"],
            kw["strategy"],
            kw["base"],
            kw["fixed"],
            tune.TuneSettings(seed=kw["seed"], trials=2, out_dir=tmp_path),
        )
    assert message in str(err.value) and "\n" not in str(err.value)
    (tmp_path / tune.TRIALS_FILE).write_text("not a log\n")
    with pytest.raises(FeedbackError, match="not a tuning log"):
        run(tiny_lm, trials=2, out_dir=tmp_path)


def test_pruning_drops_the_clearly_bad_region(tiny_lm):
    """Only lam is searched, the cache mixes at every position (gate -1, max_p 1), and no document
    repeats a word: every target is one the cache has not seen, so the mixture only takes
    probability away from it and ΔPPL grows with lam, the same on every token. A trial whose lam is
    above the median of the finished ones is then clearly worse on its first documents, and must be
    pruned there."""
    fixed = {"theta": 50.0, "layer": 3, "window": 64, "gate": -1.0, "max_p": 1.0}
    res = run(tiny_lm, fixed=fixed, trials=12)
    rows = res["trials"]
    k = tune.subset_size(len(DOCS))
    pruned = [r for r in rows if r["state"] == "pruned"]
    assert len(pruned) >= 2, [(r["params"], r["state"]) for r in rows]
    for r in rows:
        earlier = sorted(q["params"]["lam"] for q in rows[: r["trial"]] if q["state"] == "complete")
        if r["state"] == "pruned":
            assert len(earlier) >= tune.PRUNE_STARTUP and r["docs_scored"] == k < len(DOCS)
            assert r["params"]["lam"] > earlier[len(earlier) // 2 - 1]  # above the lower median
            assert r["subset_ci95"][0] > 0  # clearly worse than the baseline too
        else:
            assert r["docs_scored"] == len(DOCS)
    done = [r for r in rows if r["state"] == "complete"]
    assert res["best"]["params"]["lam"] == min(r["params"]["lam"] for r in done)  # ΔPPL grows with lam


def test_bad_input_is_one_clear_line(tiny_lm, monkeypatch):
    class Plain(DeepCacheStrategy):
        name = "plain"
        params = (Param("lam", float, 0.02, "", 0.0, 1.0),)

    monkeypatch.setitem(REGISTRY, "plain", Plain)
    cases = [
        (dict(trials=0), "trials must be in [1, 10000]"),
        (dict(trials=None, timeout=0), "timeout must be a positive number"),
        (dict(trials=None), "give a budget"),
        (
            dict(fixed={"lam": 0.1, "theta": 5, "layer": 1, "window": 8, "gate": 0, "max_p": 1}),
            "every tunable",
        ),
        (dict(strategy="plain"), "plain has no tunable parameters"),
        (dict(fixed={"zeta": 1}), "unknown parameter(s) zeta"),
        (dict(strategy="nope"), "unknown strategy 'nope'"),
        (dict(fixed={"lam": 0}), "lam=0 switches deep_cache off"),
        (dict(fixed={"lam": 5}), "lam=5.0 is out of range"),
        (dict(test_docs=DOCS), "the test corpus is the dev corpus"),
    ]
    for kw, message in cases:
        with pytest.raises(FeedbackError) as err:
            run(tiny_lm, **kw)
        assert message in str(err.value) and "\n" not in str(err.value), (kw, err.value)
    for docs, message in (([], "holds no documents"), ([Document("x", "")], "at least 2 tokens")):
        with pytest.raises(FeedbackError, match=message):
            tune.run_tune(tiny_lm, docs, "deep_cache", BASE, {}, tune.TuneSettings(trials=1))


def test_files_and_the_test_split_scored_once(tiny_lm, tmp_path, monkeypatch):
    calls: list[int] = []
    real = tune.evaluate
    monkeypatch.setattr(tune, "evaluate", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    res = run(tiny_lm, trials=4, out_dir=tmp_path, test_docs=TEST, data="dev.jsonl", test="test.jsonl")
    assert len(calls) == 1  # the dev trials never call it: only the best point, on test
    best = json.loads((tmp_path / tune.BEST_FILE).read_text())
    assert best["best"]["trial"] == res["best"]["trial"] and best["test_evaluations"] == 1
    direct = evaluate(tiny_lm, TEST, PPLConfig("deep_cache", res["best"]["strategy_params"], bootstrap=200))
    assert best["test"]["delta_pct"] == pytest.approx(direct["delta_pct"], rel=1e-12)
    assert best["test"]["ci95"] == pytest.approx(direct["ci95"]) and best["test"]["data"] == "test.jsonl"
    rows = [json.loads(line) for line in (tmp_path / tune.TRIALS_FILE).read_text().splitlines()[1:]]
    assert [r["trial"] for r in rows] == [0, 1, 2, 3]
    assert {"trial", "params", "state", "delta_pct", "ci95", "docs_scored", "seconds"} <= set(rows[0])
    html = (tmp_path / tune.HTML_FILE).read_text()
    assert "best so far" in html and "Parameter importance" in html and "plotly" in html.lower()
    assert set(res["importances"]) == set(tune.search_space("deep_cache", 4))
    run(tiny_lm, trials=4, out_dir=tmp_path, test_docs=TEST)  # nothing new: the test result is reused
    assert len(calls) == 1 and json.loads((tmp_path / tune.BEST_FILE).read_text())["test_evaluations"] == 1


def test_stop_between_and_within_trials(tiny_lm, tmp_path):
    stop = threading.Event()
    with pytest.raises(Stopped):
        run(tiny_lm, trials=5, out_dir=tmp_path, stop=stop, on_trial=lambda r: stop.set())
    assert len((tmp_path / tune.TRIALS_FILE).read_text().splitlines()) == 2  # the header and the one trial
    stop.clear()
    with pytest.raises(Stopped):
        run(tiny_lm, trials=5, stop=stop, progress=lambda text: stop.set())
    one = run(tiny_lm, trials=1)
    assert len(one["trials"]) == 1 and one["importances"] == {}  # fewer than 2 finished: none
    assert table_row(one["trials"][0])[3] == "complete"


def test_progress_within_trials_then_the_test_within_the_estimate(tiny_lm):
    """The search reports after every window: each trial's tokens within it, then the test once;
    its token-forwards never pass what the estimate (every trial in full) allows."""
    seen = []
    run(tiny_lm, trials=2, test_docs=TEST, progress=seen.append)
    stages = [(e.stage, e.point) for e in seen]
    assert stages == sorted(stages, key=stages.index)  # each trial's reports together, in order
    assert list(dict.fromkeys(stages)) == [("trial", 1), ("trial", 2), ("test", 1)] and seen[0].points == 2
    trial_one = [e for e in seen if e.point == 1 and e.stage == "trial"]
    assert len(trial_one) >= 2 and trial_one[-1].tokens == trial_one[-1].total  # within the trial, to its end
    data = tune.prepare(tiny_lm, DOCS, TEST, "deep_cache", BASE, {})
    dev, test = data.estimates(tiny_lm, 2)
    assert seen[-1].forwards <= dev.forwards + test.forwards and seen[-1].tokens == test.tokens


def test_a_combination_the_strategy_refuses_is_a_failed_trial_and_the_search_goes_on(
    tiny_lm, tmp_path, monkeypatch
):
    class Picky(DeepCacheStrategy):
        name = "picky"

        @classmethod
        def check(cls, values, num_layers):
            if values["lam"] > 0.03:
                raise FeedbackError("lam above 0.03 with this cache is refused")

    monkeypatch.setitem(REGISTRY, "picky", Picky)
    res = run(tiny_lm, "picky", trials=6, out_dir=tmp_path)
    failed = [r for r in res["trials"] if r["state"] == "failed"]
    assert failed and all(r["params"]["lam"] > 0.03 and "refused" in r["error"] for r in failed)
    assert res["best"]["params"]["lam"] <= 0.03
    again = run(tiny_lm, "picky", trials=7, out_dir=tmp_path)  # failed trials are resumed like the others
    assert [r["params"] for r in again["trials"][:6]] == [r["params"] for r in res["trials"]]
    assert table_row(failed[0])[2].startswith("lam above")


def test_a_layer_that_must_follow_another_is_searched_from_it_and_resumes(tiny_lm, tmp_path):
    """inner_loop's end_layer is at least its start_layer: no trial proposes a refused block."""
    res = run(tiny_lm, "inner_loop", {"loops": 1}, trials=6, out_dir=tmp_path)
    assert all(r["state"] != "failed" for r in res["trials"])
    assert all(r["params"]["end_layer"] >= r["params"]["start_layer"] for r in res["trials"])
    again = run(tiny_lm, "inner_loop", {"loops": 1}, trials=7, out_dir=tmp_path)
    assert [r["params"] for r in again["trials"][:6]] == [r["params"] for r in res["trials"]]
    fixed = run(tiny_lm, "inner_loop", {"loops": 1, "start_layer": 2}, trials=3)
    assert all(r["params"]["end_layer"] >= 2 for r in fixed["trials"])


def test_settings_refuse_a_bad_budget_and_say_when_another_trial_may_start():
    tune.TuneSettings(trials=3).check()
    with pytest.raises(FeedbackError, match=r"trials must be in \[1, 5\], got 6"):
        tune.TuneSettings(trials=6, max_trials=5).check()
    assert tune.TuneSettings(trials=3).more(2, 1e9) and not tune.TuneSettings(trials=3).more(3, 0.0)
    assert tune.TuneSettings(timeout=10).more(10_000, 9.9) and not tune.TuneSettings(timeout=10).more(0, 10.0)
    assert not tune.TuneSettings(trials=3, timeout=10).more(1, 11.0)  # whichever ends first


HEADER = {
    "format": tune.FORMAT,
    "strategy": "deep_cache",
    "data": "dev.jsonl",
    "scoring": {"bootstrap": 200, "seed": 0},
}


def test_the_trials_log_resumes_its_own_run_and_refuses_anything_else(tmp_path):
    path = tmp_path / tune.TRIALS_FILE
    log = tune.TrialLog.open(tmp_path, HEADER)
    assert log.rows == [] and json.loads(path.read_text()) == {"header": HEADER}
    log.append({"trial": 0, "state": "complete"})
    log.append({"trial": 1, "state": "pruned"})
    assert path.read_text() == tune.jsonl_text(HEADER, log.rows) and len(path.read_text().splitlines()) == 3
    again = tune.TrialLog.open(
        tmp_path, HEADER | {"data": "renamed.jsonl"}
    )  # the data's name decides nothing
    assert again.rows == log.rows and again.path == path
    with pytest.raises(FeedbackError, match="holds trials of a different tuning run") as err:
        tune.TrialLog.open(tmp_path, HEADER | {"scoring": {"bootstrap": 100, "seed": 0}})
    assert "(scoring.bootstrap: 200 there, 100 now)" in str(err.value)
    with pytest.raises(FeedbackError, match=r"model: null there, \"tiny\" now"):
        tune.TrialLog.open(tmp_path, HEADER | {"model": "tiny"})
    path.write_text(path.read_text() + '{"trial": 2, "sta')  # killed while writing a line
    cut = tune.TrialLog.open(tmp_path, HEADER)
    assert [r["trial"] for r in cut.rows] == [0, 1] and path.read_text() == tune.jsonl_text(HEADER, cut.rows)
    path.write_text(json.dumps({"header": HEADER}) + "\nnot json\n" + json.dumps({"trial": 0}) + "\n")
    with pytest.raises(FeedbackError, match=":2 is not JSON; this is not a tuning log"):
        tune.TrialLog.open(tmp_path, HEADER)
    path.write_text(json.dumps({"trial": 0}) + "\n")
    with pytest.raises(FeedbackError, match="has no tuning header on its first line"):
        tune.TrialLog.open(tmp_path, HEADER)
    memory = tune.TrialLog.open(None, HEADER)  # no folder: nothing written
    memory.append({"trial": 0, "state": "complete"})
    assert memory.path is None and memory.rows == [{"trial": 0, "state": "complete"}]


def test_the_pruning_decision_needs_the_whole_interval_above_the_median():
    others = [1.0, 2.0, 3.0, 4.0]  # median 2.5
    assert tune.clearly_worse(2.6, 5.0, others)
    assert not tune.clearly_worse(2.4, 5.0, others)  # its interval still reaches the median
    assert not tune.clearly_worse(2.5, 5.0, others)  # on the median is not above it
    assert not tune.clearly_worse(9.0, 9.0, others[:3])  # fewer completed trials than PRUNE_STARTUP
    assert tune.clearly_worse(9.0, 9.0, others[:3], startup=3)
    # no bootstrap (no interval): the point estimate stands in for the lower end
    assert tune.clearly_worse(None, 2.6, others) and not tune.clearly_worse(math.nan, 2.4, others)


def test_the_pruner_compares_with_the_completed_trials_at_the_same_step():
    study = optuna.create_study(pruner=tune.ClearlyWorsePruner(startup=2))
    dist = {"x": FloatDistribution(0.0, 1.0)}
    for value in (1.0, 3.0):  # completed: subset median 2.0
        study.add_trial(
            optuna.trial.create_trial(
                params={"x": 0.5}, distributions=dist, value=value, intermediate_values={2: value}
            )
        )
    study.add_trial(
        optuna.trial.create_trial(
            state=optuna.trial.TrialState.PRUNED,
            params={"x": 0.5},
            distributions=dist,
            intermediate_values={2: -100.0},
        )
    )
    study.add_trial(
        optuna.trial.create_trial(
            params={"x": 0.5}, distributions=dist, value=-50.0, intermediate_values={1: -50.0}
        )
    )  # another step: not compared

    def reported(low: float) -> optuna.Trial:
        trial = study.ask()
        trial.set_user_attr("subset_ci95", [low, 9.0])
        trial.report(5.0, 2)
        return trial

    assert reported(2.1).should_prune()
    assert not reported(1.9).should_prune()  # the pruned and other-step trials would have lowered the median
    assert not study.ask().should_prune()  # nothing reported yet


def test_the_test_split_is_scored_again_only_for_another_best_point_text_or_settings(tiny_lm):
    data = tune.prepare(tiny_lm, DOCS, TEST, "deep_cache", BASE, {})
    best = {"trial": 3, "strategy_params": REGISTRY["deep_cache"].validate({}, tiny_lm.num_layers)}
    header, cache = {"strategy": "deep_cache", "scoring": {"bootstrap": 200}}, {}
    first = tune.score_test_once(tiny_lm, data, best, {}, header, "test.jsonl", cache)
    assert first["test_evaluations"] == 1 and first["test"]["data"] == "test.jsonl"
    direct = evaluate(tiny_lm, TEST, PPLConfig("deep_cache", best["strategy_params"], bootstrap=200))
    assert first["test"]["delta_pct"] == pytest.approx(direct["delta_pct"], rel=1e-12)
    previous = {"header": header, "best": best} | first
    assert tune.score_test_once(tiny_lm, data, best, previous, header, "test.jsonl", cache) == first  # reused
    for stale in (
        previous | {"best": {"trial": 4}},
        previous | {"test_fingerprint": "another text"},
        previous | {"header": header | {"scoring": {"bootstrap": 100}}},
        previous | {"test": None},
    ):
        assert (
            tune.score_test_once(tiny_lm, data, best, stale, header, "test.jsonl", cache)["test_evaluations"]
            == 2
        )
