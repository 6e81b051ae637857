"""Perplexity: windows, NLL against a direct computation, bootstrap, corpus inputs, sweeps."""

from __future__ import annotations

import json
import math
import threading

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from feedback.core.budget import EXACT_COST
from feedback.errors import FeedbackError, Stopped
from feedback.eval import corpus
from feedback.eval.perplexity import (
    PPLConfig,
    ScoringProgress,
    Tally,
    block_length,
    document_ids,
    estimate,
    evaluate,
    fitting_cap,
    fitting_docs,
    measured_rate,
    paired_bootstrap,
    scoring_rate,
    scoring_work,
    seconds_left,
    surprise_diff,
    token_nlls,
    windows,
)
from feedback.eval.sweep import best_point, is_noop, parse_grid, run_sweep, to_csv

TEXT = "The river flows to the sea. The sea rises as clouds, and the clouds rain on the hills again."


@given(st.integers(2, 300), st.integers(2, 64), st.integers(1, 64))
def test_windows_score_every_target_exactly_once(n, size, stride):
    stride = min(stride, size)
    scored = []
    for start, end, first in windows(n, size, stride):
        assert 0 <= start < first <= end <= n and end - start <= size
        scored += list(range(first, end))
    assert scored == list(range(1, n))


def test_baseline_nll_matches_a_direct_computation(tiny_lm):
    ids = tiny_lm.tokenizer(TEXT)["input_ids"]
    base, fb = token_nlls(tiny_lm, ids, PPLConfig())
    assert fb is None
    with torch.inference_mode():
        logits = tiny_lm.model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    direct = (
        torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="none").double().numpy()
    )
    assert np.allclose(base, direct, atol=1e-5)


def test_sliding_windows_give_the_same_nll_as_one_pass_when_context_is_long_enough(tiny_lm):
    ids = tiny_lm.tokenizer(TEXT * 3)["input_ids"]
    whole, _ = token_nlls(tiny_lm, ids, PPLConfig(window=512))
    windowed, _ = token_nlls(tiny_lm, ids, PPLConfig(window=24, stride=8))
    assert whole.shape == windowed.shape
    # tokens in the first window have identical context in both runs
    assert np.allclose(whole[:23], windowed[:23], atol=1e-5)
    assert not np.allclose(whole, windowed, atol=1e-5)  # later tokens see less context


def test_paired_bootstrap_is_seeded_and_covers_the_mean():
    rng = np.random.default_rng(1)
    diffs = [rng.normal(-0.1, 1.0, size=50) for _ in range(12)]
    a = paired_bootstrap(diffs, 500, seed=3)
    assert a == paired_bootstrap(diffs, 500, seed=3)
    assert a[2] == "documents" and a[0] < np.concatenate(diffs).mean() < a[1]
    few = paired_bootstrap(diffs[:3], 500, seed=3)
    assert few[2].startswith("token blocks of ") and "these texts only" in few[2] and few[0] < few[1]


def ar1(rng: np.random.Generator, n: int, phi: float) -> np.ndarray:
    x = np.empty(n)
    x[0] = rng.normal() / math.sqrt(1 - phi * phi)
    for i in range(1, n):
        x[i] = phi * x[i - 1] + rng.normal()
    return x


def test_block_length_grows_with_correlation():
    rng = np.random.default_rng(0)
    assert block_length(rng.normal(size=2000)) <= 2
    assert 6 <= block_length(ar1(rng, 2000, 0.5)) <= 30  # theory for phi = 0.5, n = 2000: ~17
    assert block_length(ar1(rng, 2000, 0.9)) > block_length(ar1(rng, 2000, 0.5))
    assert block_length(np.zeros(50)) == 1 and block_length(np.ones(5)) == 1


def test_single_text_interval_covers_on_autocorrelated_differences():
    """AR(1) differences (phi 0.5), one text of 400 tokens, true mean 0: resampling tokens as if
    independent covers ~77 % of the time for a nominal 95 %; the moving-block bootstrap much closer."""
    rng = np.random.default_rng(7)
    hits, naive = 0, 0
    runs = 200
    for i in range(runs):
        x = ar1(rng, 400, 0.5)
        lo, hi, method = paired_bootstrap([x], 400, seed=i)
        hits += lo <= 0.0 <= hi
        pick = rng.integers(0, x.size, size=(400, x.size))
        nlo, nhi = np.percentile(x[pick].mean(axis=1), [2.5, 97.5])
        naive += nlo <= 0.0 <= nhi
    assert naive / runs < 0.85 and hits / runs >= 0.88, (naive / runs, hits / runs)


def test_evaluate_reports_everything(tiny_lm):
    docs = [corpus.Document("a", TEXT), corpus.Document("b", TEXT[::-1]), corpus.Document("tiny", "x")]
    res = evaluate(tiny_lm, docs, PPLConfig("deep_cache", {"lam": 0.3}, bootstrap=200))
    json.dumps(res)
    assert res["mode"] == "parallel" and res["approximate"] is False and res["documents"] == 2
    assert set(res) >= {
        "baseline_ppl",
        "feedback_ppl",
        "delta_pct",
        "ci95",
        "mode",
        "wall_seconds",
        "corpus_fingerprint",
        "per_doc",
        "config",
        "model",
    }
    assert res["ci95"][0] <= res["delta_pct"] <= res["ci95"][1]
    assert res["config"]["params"]["theta"] == 50.0  # defaults are filled in
    pooled = math.exp(
        np.mean(
            np.concatenate(
                [
                    token_nlls(tiny_lm, tiny_lm.tokenizer(d.text)["input_ids"], PPLConfig())[0]
                    for d in docs[:2]
                ]
            )
        )
    )
    assert res["baseline_ppl"] == pytest.approx(pooled, rel=1e-9)
    jac = evaluate(tiny_lm, docs[:1], PPLConfig("residual", {"alpha": 0.2}, passes=4, bootstrap=0))
    assert jac["mode"] == "jacobi" and jac["approximate"] is True and jac["passes"] == 4


@pytest.mark.parametrize(
    "cfg, message",
    [
        (PPLConfig("residual", mode="parallel"), "recurrent"),
        (PPLConfig("residual", mode="jacobi", passes=1), "passes must be in"),
        (PPLConfig("deep_cache", mode="sideways"), "mode must be one of"),
        (PPLConfig(stride=0), "stride"),
        (PPLConfig("nope"), "unknown strategy"),
        (PPLConfig("deep_cache", {"lam": 2}), "lam=2.0 is out of range"),
    ],
)
def test_bad_ppl_configs(tiny_lm, cfg, message):
    with pytest.raises(FeedbackError, match=message):
        evaluate(tiny_lm, [corpus.Document("a", TEXT)], cfg)


def test_surprise_diff_aligns_tokens_and_nlls(tiny_lm):
    cfg = PPLConfig("anchor", {"alpha": 0.4, "prompt_tokens": 4}, bootstrap=0)
    res = evaluate(tiny_lm, [corpus.Document("t", TEXT)], cfg, token_detail=True)
    out = surprise_diff(res)
    assert len(out["tokens"]) == len(out["baseline_nll"]) == len(out["feedback_nll"]) == res["tokens"]
    base, fb = token_nlls(tiny_lm, tiny_lm.tokenizer(TEXT)["input_ids"], cfg)
    assert np.allclose(out["baseline_nll"], base) and np.allclose(out["feedback_nll"], fb)
    assert out["feedback_ppl"] == pytest.approx(res["feedback_ppl"])
    ids = tiny_lm.tokenizer(TEXT)["input_ids"]  # the first token is kept for display, unscored
    assert out["first_token"] == tiny_lm.tokenizer.decode([ids[0]]) and len(out["tokens"]) == len(ids) - 1
    with pytest.raises(FeedbackError, match="at least 2 tokens"):
        evaluate(tiny_lm, [corpus.Document("t", "")], cfg, token_detail=True)


def test_builtin_split_is_deterministic_and_disjoint():
    dev, test = corpus.builtin("dev"), corpus.builtin("test")
    names_dev, names_test = {d.name for d in dev}, {d.name for d in test}
    assert not names_dev & names_test and len(dev) > 20 and len(test) > 20
    assert [d.name for d in corpus.builtin("dev")] == [d.name for d in dev]
    assert corpus.fingerprint(dev) != corpus.fingerprint(test)
    with pytest.raises(FeedbackError, match="dev or test"):
        corpus.builtin("train")


def test_file_inputs(tmp_path):
    (tmp_path / "a.txt").write_text("first document")
    (tmp_path / "b.txt").write_text("second document")
    assert [d.name for d in corpus.load(str(tmp_path))] == ["a.txt", "b.txt"]
    assert corpus.load(str(tmp_path / "a.txt"))[0].text == "first document"
    lines = [
        '{"text": "good one", "id": "x"}',
        "not json",
        '{"text": ""}',
        '{"other": 1}',
        "[1, 2]",
        '{"text": "good two"}',
    ]
    (tmp_path / "d.jsonl").write_text("\n".join(lines))
    warnings: list[str] = []
    docs = corpus.load(str(tmp_path / "d.jsonl"), warnings.append)
    assert [(d.name, d.text) for d in docs] == [("x", "good one"), ("line6", "good two")]
    assert [w.split(":")[1] for w in warnings] == ["2", "3", "4", "5"] and "not valid JSON" in warnings[0]
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(FeedbackError, match="not UTF-8"):
        corpus.load(str(tmp_path / "bin.txt"))
    with pytest.raises(FeedbackError, match="no such file"):
        corpus.load(str(tmp_path / "missing.txt"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FeedbackError, match="no .txt files"):
        corpus.load(str(tmp_path / "empty"))


def test_parse_grid_and_sweep(tiny_lm):
    grid = parse_grid(["lam=0,0.3", "theta=5,50"], "deep_cache", 4)
    assert grid == {"lam": [0.0, 0.3], "theta": [5.0, 50.0]}
    for bad, message in [
        (["lam"], "expects NAME=V1"),
        (["beta=1"], "unknown parameter"),
        (["lam=0", "lam=1"], "twice"),
        (["lam=7"], "out of range"),
        ([], "at least one"),
        (["lam=" + ",".join(["0.1"] * 21), "theta=" + ",".join(["1"] * 20)], "at most 400"),
    ]:
        with pytest.raises(FeedbackError, match=message):
            parse_grid(bad, "deep_cache", 4)
    # the page names its own fields, not the command line's flag
    with pytest.raises(FeedbackError, match=r"^grid y: unknown parameter 'beta'"):
        parse_grid(["lam=0", "beta=1"], "deep_cache", 4, ["grid x", "grid y"])
    with pytest.raises(FeedbackError, match=r"^grid x expects NAME=V1,V2,\.\.\., got 'lam'"):
        parse_grid(["lam"], "deep_cache", 4, ["grid x"])
    with pytest.raises(FeedbackError, match=r"^give at least one grid x NAME"):
        parse_grid([], "deep_cache", 4, ["grid x"])
    rows = run_sweep(tiny_lm, [corpus.Document("a", TEXT)], "deep_cache", grid, PPLConfig(bootstrap=50))
    assert len(rows) == 4 and all(r["baseline_ppl"] == rows[0]["baseline_ppl"] for r in rows)
    assert [r["delta_pct"] for r in rows if r["lam"] == 0.0] == [0.0, 0.0]
    header = to_csv(rows, ["lam", "theta"]).splitlines()[0]
    assert header.startswith("lam,theta,delta_pct,ci95_low,ci95_high,ci95_width")


@pytest.mark.parametrize("chunk", [1, 5, 16, 512])
def test_chunked_prefill_matches_one_pass(tiny_lm, chunk):
    ids = tiny_lm.tokenizer(TEXT * 2)["input_ids"]
    one, _ = token_nlls(tiny_lm, ids, PPLConfig(chunk=10_000))
    chunked, _ = token_nlls(tiny_lm, ids, PPLConfig(chunk=chunk))
    assert np.allclose(one, chunked, atol=1e-4)


class StopAfter:
    """A stop event that turns itself on after `n` checks: stands in for a Stop pressed mid-job."""

    def __init__(self, n: int):
        self.n, self.checks = n, 0

    def is_set(self) -> bool:
        self.checks += 1
        return self.checks > self.n


@pytest.mark.parametrize("mode, checks", [("parallel", 2), ("exact", 5)])
def test_a_stopped_evaluation_ends_within_a_window_or_token(tiny_lm, mode, checks):
    docs = [corpus.Document(f"d{i}", TEXT * 3) for i in range(4)]
    cfg = PPLConfig(
        "deep_cache" if mode == "parallel" else "residual", {}, mode, window=16, stride=8, bootstrap=0
    )
    stop = StopAfter(checks)
    seen: list[int] = []
    with pytest.raises(Stopped, match="stopped"):
        evaluate(tiny_lm, docs, cfg, progress=lambda i, n, name: seen.append(i), stop=stop)
    assert stop.checks == checks + 1 and seen == []  # nothing ran past the check that saw the stop
    done = threading.Event()
    assert evaluate(tiny_lm, docs[:1], cfg, stop=done)["documents"] == 1  # an unset event changes nothing


@pytest.mark.parametrize("mode", ["parallel", "jacobi"])
def test_stop_is_looked_at_before_every_forward(tiny_lm, mode):
    """A long window takes several forwards (baseline chunks, Jacobi passes): Stop is seen between
    any two of them, so a stopped job never runs more than one forward on."""
    since_check: list[int] = [0]
    gaps: list[int] = []

    class Watch:
        def is_set(self) -> bool:
            gaps.append(since_check[0])
            since_check[0] = 0
            return False

    handle = tiny_lm.model.register_forward_pre_hook(
        lambda *_: since_check.__setitem__(0, since_check[0] + 1)
    )
    try:
        cfg = PPLConfig(
            "residual" if mode == "jacobi" else "deep_cache",
            {},
            mode,
            passes=3,
            window=32,
            stride=16,
            chunk=8,
            bootstrap=0,
        )
        evaluate(tiny_lm, [corpus.Document("d", TEXT * 3)], cfg, stop=Watch())
    finally:
        handle.remove()
    assert max(gaps[1:] + since_check) <= 1 and len(gaps) > 10


def test_a_stop_during_a_forward_ends_it_at_the_next_layer(tiny_lm):
    """One forward over a long window can take seconds: a Stop that comes during it is seen before
    the next decoder layer, and no further layer runs."""
    stop = threading.Event()
    ran: list[int] = []

    def enter(i):
        def hook(*_):
            ran.append(i)
            if len(ran) == 3:  # the third layer entered in the whole evaluation: Stop arrives now
                stop.set()

        return hook

    handles = [layer.register_forward_pre_hook(enter(i)) for i, layer in enumerate(tiny_lm.layers)]
    try:
        cfg = PPLConfig("deep_cache", {}, "parallel", window=32, stride=16, chunk=64, bootstrap=0)
        with pytest.raises(Stopped):
            evaluate(tiny_lm, [corpus.Document("d", TEXT * 3)], cfg, stop=stop)
    finally:
        for h in handles:
            h.remove()
    assert len(ran) == 3 and tiny_lm.num_layers > 3  # the layer Stop came in never ran its forward


def test_a_stopped_sweep_keeps_the_points_it_finished(tiny_lm):
    grid = {"lam": [0.0, 0.1, 0.2]}
    points: list[dict] = []
    stop = threading.Event()

    def on_point(row, i, n):
        points.append(row)
        stop.set()  # Stop pressed after the first point

    with pytest.raises(Stopped):
        run_sweep(
            tiny_lm,
            [corpus.Document("a", TEXT)],
            "deep_cache",
            grid,
            PPLConfig(bootstrap=20),
            {},
            on_point,
            stop=stop,
        )
    assert [p["lam"] for p in points] == [0.0]


def test_best_point_never_picks_a_setting_with_strength_zero():
    rows = [
        {"lam": 0.0, "gate": 0.9, "delta_pct": -0.0},
        {"lam": 0.1, "gate": 0.9, "delta_pct": 0.4},
        {"lam": 0.2, "gate": 0.9, "delta_pct": 0.2},
    ]
    assert best_point(rows, "deep_cache")["lam"] == 0.2  # the no-op point (ΔPPL 0) is not "best"
    assert best_point(rows[:1], "deep_cache") is None
    assert (
        best_point([{"gate": 0.5, "delta_pct": 1.0}], "deep_cache", {"lam": 0.0}) is None
    )  # fixed strength 0
    assert is_noop("residual", {"alpha": 0}) and not is_noop("residual", {"alpha": 0.1})


def test_scoring_over_budget_is_refused_before_any_forward(tiny_lm):
    from feedback.core.budget import Budget

    forwards: list[int] = []
    handle = tiny_lm.model.register_forward_pre_hook(lambda *_: forwards.append(1))
    try:
        docs = [corpus.Document("a", TEXT * 4)]
        n = len(tiny_lm.tokenizer(TEXT * 4)["input_ids"])
        cfg = PPLConfig("residual", {}, "jacobi", passes=3, bootstrap=0)
        with pytest.raises(
            FeedbackError,
            match=rf"would score {4 * n:,} token-forwards \({n:,} window tokens, "
            r"baseline \+ 1 x jacobi \(3 passes\)\)",
        ):
            evaluate(tiny_lm, docs, cfg, budget=Budget(scored_tokens=4 * n - 1))
        with pytest.raises(FeedbackError, match="FEEDBACK_BUDGET_SCORED_TOKENS"):
            run_sweep(
                tiny_lm,
                docs,
                "deep_cache",
                {"lam": [0.1, 0.2, 0.3]},
                PPLConfig(bootstrap=0),
                budget=Budget(scored_tokens=3 * n),
            )  # baseline + 3 points = 4n
        assert forwards == []
        evaluate(tiny_lm, docs, cfg, budget=Budget(scored_tokens=4 * n))
    finally:
        handle.remove()


def test_the_scoring_convention_is_stated_and_reproduces_the_number(tiny_lm):
    """The result says how it scored; following that statement by hand gives the same perplexity."""
    cfg = PPLConfig(None, {}, "parallel", window=16, stride=8, bootstrap=0)
    res = evaluate(tiny_lm, [corpus.Document("d", TEXT)], cfg)
    conv = res["scoring"]
    assert conv["first_token_scored"] is False and conv["window"] == 16 and conv["stride"] == 8
    ids = tiny_lm.tokenizer(TEXT)["input_ids"]
    assert conv["bos_added"] == (ids[0] == tiny_lm.tokenizer.bos_token_id)
    nll, scored = [], 0
    with torch.inference_mode():
        for start, end, first in windows(len(ids), 16, 8):
            logits = tiny_lm.model(input_ids=torch.tensor([ids[start:end]])).logits[0].double()
            logp = torch.log_softmax(logits, dim=-1)
            for t in range(max(first, start + 1), end):  # target t given ids[start:t]
                nll.append(-logp[t - 1 - start, ids[t]].item())
                scored += 1
    assert scored == res["tokens"] == len(ids) - 1
    assert res["baseline_ppl"] == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-4)


# ---- corpus jobs: the estimate, the per-document limit, progress within a point ----
def window_tokens(n: int, size: int, stride: int) -> int:
    return sum(end - start for start, end, _ in windows(n, size, stride))


@pytest.mark.parametrize(
    "strategy, mode, per_pass",
    [
        (None, None, 0),
        ("deep_cache", "parallel", 1),
        ("residual", "jacobi", 3),
        ("residual", "exact", EXACT_COST),
    ],
)
def test_the_estimate_is_tokens_times_points_times_passes(strategy, mode, per_pass):
    """Window tokens x (the baseline once + points x passes), the documents under 2 tokens left out
    (nothing to score), and the time at a measured rate; the budget counts the same number."""
    cfg = PPLConfig(strategy, {}, mode, passes=3, window=16, stride=8)
    counts = [40, 1, 10]
    est = estimate(counts, cfg, points=6)
    fed = window_tokens(40, 16, 8) + 10
    assert (est.documents, est.tokens, est.window_tokens) == (2, 39 + 9, fed)
    assert (est.points, est.passes) == ((6, per_pass) if strategy else (0, 0))
    assert est.forwards == fed * (1 + per_pass * est.points) == scoring_work(counts, cfg, 6)[0]
    assert est.seconds is None and est.at(50.0).seconds == pytest.approx(est.forwards / 50.0)
    with pytest.raises(FeedbackError, match="at least 2 tokens"):
        estimate([1, 0], cfg)


def test_time_left_goes_at_the_pace_so_far_else_at_the_measured_rate():
    assert seconds_left(1000, 0, 0.0, 50.0) == pytest.approx(20.0)  # nothing done yet: the measured rate
    assert seconds_left(1000, 250, 10.0, 50.0) == pytest.approx(30.0)  # 25 per second so far
    assert seconds_left(1000, 1000, 10.0, 50.0) == 0.0 and seconds_left(1000, 0, 0.0, None) is None


def test_a_refusal_can_say_what_would_fit():
    """The largest per-document limit, and the most documents, whose scoring stays within a limit:
    the next one up does not fit."""
    cfg = PPLConfig("deep_cache", {}, "parallel", window=16, stride=8)
    counts = [100, 60, 30]
    cost = lambda cs: estimate(cs, cfg, 4).forwards  # noqa: E731
    limit = cost([50, 50, 30])
    cap = fitting_cap(counts, cfg, 4, limit)
    assert cost([min(n, cap) for n in counts]) <= limit < cost([min(n, cap + 1) for n in counts])
    assert (
        fitting_docs(counts, cfg, 4, cost(counts[:2])) == 2
        and fitting_docs(counts, cfg, 4, cost(counts[:1]) - 1) == 0
    )
    assert fitting_cap(counts, cfg, 4, cost([2, 2, 2]) - 1) is None


def test_each_document_is_cut_to_the_per_document_limit(tiny_lm):
    docs = [corpus.Document("long", TEXT * 2), corpus.Document("short", "a b")]
    whole = [len(ids) for ids in document_ids(tiny_lm, docs, PPLConfig())]
    cut = document_ids(tiny_lm, docs, PPLConfig(max_tokens_per_doc=12))
    assert [len(ids) for ids in cut] == [12, whole[1]] and whole[0] > 12
    assert cut[0] == tiny_lm.tokenizer(TEXT * 2)["input_ids"][:12]  # the first tokens, as scored
    res = evaluate(tiny_lm, docs, PPLConfig(max_tokens_per_doc=12, bootstrap=0))
    assert [d["tokens"] for d in res["per_doc"]] == [11, whole[1] - 1]
    for bad in (0, 1):  # 0 would otherwise read as "no limit"
        with pytest.raises(FeedbackError, match="max tokens per document must be at least 2"):
            evaluate(tiny_lm, docs, PPLConfig(max_tokens_per_doc=bad))


def test_progress_comes_within_a_point_and_adds_up_to_the_estimate(embedded_lm):
    """On the real model: a sweep reports after every window, so several times within each point
    before the point ends, tokens rising to the point's total; its token-forwards end at exactly
    what the estimate (and the budget) counted, the baseline once."""
    docs = [corpus.Document("a", TEXT)]
    base = PPLConfig(window=12, stride=6, bootstrap=0)  # the text is ~22 tokens: a few windows
    seen: list[ScoringProgress] = []
    ends: list[int] = []
    run_sweep(
        embedded_lm,
        docs,
        "deep_cache",
        {"lam": [0.05, 0.1]},
        base,
        {},
        on_point=lambda row, i, n: ends.append(len(seen)),
        progress=seen.append,
    )
    first = seen[: ends[0]]
    assert len(first) >= 2 and all(e.point == 1 and e.points == 2 and e.stage == "point" for e in first)
    assert [e.tokens for e in first] == sorted(e.tokens for e in first) and first[-1].tokens == first[
        -1
    ].total
    assert first[0].tokens < first[0].total  # the first report came before the point's end
    counts = [len(ids) for ids in document_ids(embedded_lm, docs, base)]
    est = estimate(counts, PPLConfig("deep_cache", window=12, stride=6), points=2)
    assert seen[-1].forwards == est.forwards and seen[-1].point == 2 and seen[-1].tokens == est.tokens


def test_the_scoring_rate_is_measured_once_per_model(tiny_lm):
    rate = scoring_rate(tiny_lm)
    assert rate > 0 and measured_rate(tiny_lm) == rate
    forwards: list[int] = []
    handle = tiny_lm.model.register_forward_pre_hook(lambda *_: forwards.append(1))
    try:
        assert scoring_rate(tiny_lm) == rate and forwards == []  # kept: no forward the second time
    finally:
        handle.remove()


def test_one_tally_counts_a_whole_job(tiny_lm):
    """A tally runs through several evaluations: token-forwards add up, tokens restart each time."""
    seen: list[ScoringProgress] = []
    tally = Tally(seen.append, points=2, stage="point")
    cfg = PPLConfig("deep_cache", {}, window=16, stride=8, bootstrap=0)
    cache: dict = {}
    for point in (1, 2):
        tally.point = point
        evaluate(tiny_lm, [corpus.Document("a", TEXT)], cfg, baseline_cache=cache, tally=tally)
    two = [e for e in seen if e.point == 2]
    assert two[0].tokens < two[-1].tokens == two[-1].total  # tokens count within the point
    assert two[-1].forwards == estimate([len(tiny_lm.tokenizer(TEXT)["input_ids"])], cfg, 2).forwards
