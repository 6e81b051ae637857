"""The lm-evaluation-harness backend (feedback/eval/lmeval.py): its numbers are the project's own
(rolling log-likelihood = the perplexity code's NLLs, loglikelihood = the window scorers', greedy
generate_until = the engine's row text), and the paired comparison runs lm-eval end to end on
tasks in lm-eval's own format (tests/data/lmeval: YAML with `dataset_path: json` over local JSONL).
Skipped where lm-eval is not installed (it is a test requirement, not a runtime one)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402

from feedback.core.engine import run_to_end  # noqa: E402
from feedback.core.forward import window_nll_exact, window_nll_parallel  # noqa: E402
from feedback.core.records import RowSpec, RunConfig  # noqa: E402
from feedback.errors import FeedbackError  # noqa: E402
from feedback.eval.lmeval import (
    NAME,
    FeedbackLM,
    clopper_pearson,
    compare,
    cut,
    format_table,  # noqa: E402
    mcnemar_exact,
    run_pair,
)
from feedback.eval.perplexity import PPLConfig, token_nlls  # noqa: E402
from feedback.strategies import build_strategy  # noqa: E402

import torch  # noqa: E402  (isort: skip)

ROOT = Path(__file__).resolve().parents[2]
TASKS = ROOT / "tests" / "data" / "lmeval"
TEXT = "The river flows to the sea. The sea rises as clouds, and the clouds rain on the hills again."


def _rolling(text: str) -> Instance:
    return Instance("loglikelihood_rolling", {}, (text,), 0)


def test_registered_under_its_name_and_built_from_model_args(tiny_lm):
    assert get_model(NAME) is FeedbackLM
    side = FeedbackLM.create_from_arg_string(
        "strategy=residual,param_alpha=0.2,passes=2,window=64",
        {"lm": tiny_lm, "batch_size": 4, "device": None},
    )
    d = side.describe()
    assert (d["strategy"], d["params"]["alpha"], d["mode"], d["passes"]) == ("residual", 0.2, "jacobi", 2)
    assert (d["max_length"], d["window"], d["stride"], d["batch_size"]) == (512, 64, 63, 4)
    assert FeedbackLM(lm=tiny_lm).describe()["mode"] == "parallel"  # the baseline
    stack = FeedbackLM.create_from_arg_string(
        "strategy=inner_loop+deep_cache,param_deep_cache.lam=0.3", {"lm": tiny_lm}
    ).describe()
    assert stack["strategy"] == "inner_loop+deep_cache" and stack["params"]["deep_cache.lam"] == 0.3
    with pytest.raises(FeedbackError, match="param_alpha"):
        FeedbackLM.create_from_arg_string("strategy=residual,alpha=0.2", {"lm": tiny_lm})
    with pytest.raises(FeedbackError, match="recurrent"):
        FeedbackLM(lm=tiny_lm, strategy="residual", mode="parallel")
    with pytest.raises(FeedbackError, match="unknown strategy"):
        FeedbackLM(lm=tiny_lm, strategy="nope")
    with pytest.raises(FeedbackError, match="out of range"):
        FeedbackLM(lm=tiny_lm, strategy="deep_cache", params={"lam": 2})
    with pytest.raises(FeedbackError, match="prompt-level"):
        FeedbackLM(lm=tiny_lm, strategy="restate").loglikelihood_rolling([_rolling(TEXT)], disable_tqdm=True)


# A stack (inner_loop then deep_cache) is scored and decoded as any strategy is.
STACK_CASE = (
    "inner_loop+deep_cache",
    {"inner_loop.beta": 0.6, "deep_cache.lam": 0.3, "deep_cache.gate": -1.0},
)


@pytest.mark.parametrize(
    "strategy, params, mode",
    [
        (None, {}, None),
        ("deep_cache", {"lam": 0.3}, "parallel"),
        ("residual", {"alpha": 0.2}, "jacobi"),
        ("residual", {"alpha": 0.2}, "exact"),
        STACK_CASE + ("parallel",),
        ("residual+deep_cache", {"residual.alpha": 0.2, "deep_cache.lam": 0.3}, "jacobi"),
    ],
)
def test_rolling_loglikelihood_is_the_perplexity_codes(tiny_lm, strategy, params, mode):
    """Overlapping windows (16 tokens, stride 6) over the prefix token and the text."""
    side = FeedbackLM(lm=tiny_lm, strategy=strategy, params=params, mode=mode, window=16, stride=6)
    [ll] = side.loglikelihood_rolling([_rolling(TEXT)], disable_tqdm=True)
    ids = [side.prefix_token_id] + tiny_lm.tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    assert len(ids) > 16 and side.prefix_token_id == tiny_lm.tokenizer.bos_token_id
    base, fb = token_nlls(tiny_lm, ids, PPLConfig(strategy, params, mode, window=16, stride=6))
    assert ll == pytest.approx(-float((fb if strategy else base).sum()), abs=1e-4)


PAIRS = [
    ("Question: What do bees make?\nAnswer:", " honey"),
    ("The river flows", " to the sea, and back."),
    ("A", " library is a quiet place"),
]


def test_loglikelihood_batched_baseline_and_every_mode_match_the_window_scorers(tiny_lm):
    tok = tiny_lm.tokenizer
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(PAIRS)]
    cases = [
        (None, {}, None),
        ("deep_cache", {"lam": 0.3}, "parallel"),
        ("residual", {"alpha": 0.2}, "jacobi"),
        ("residual", {"alpha": 0.2}, "exact"),
    ]
    for strategy, params, mode in cases:
        side = FeedbackLM(lm=tiny_lm, strategy=strategy, params=params, mode=mode, batch_size=3)
        got = side.loglikelihood(requests, disable_tqdm=True)
        for (ctx, cont), (ll, _) in zip(PAIRS, got):
            whole = tok(ctx + cont, add_special_tokens=False)["input_ids"]
            n = len(whole) - len(tok(ctx, add_special_tokens=False)["input_ids"])
            ids = torch.tensor(whole)
            if strategy is None:  # left-padded rows in one forward vs the chunked prefill, one sequence
                nll = token_nlls(tiny_lm, whole, PPLConfig())[0]
            elif mode == "exact":
                nll = window_nll_exact(
                    tiny_lm, ids, build_strategy(strategy, params, tiny_lm.num_layers)
                ).numpy()
            else:
                nll = window_nll_parallel(
                    tiny_lm,
                    ids,
                    build_strategy(strategy, params, tiny_lm.num_layers),
                    3 if mode == "jacobi" else 1,
                ).numpy()
            assert ll == pytest.approx(-float(nll[-n:].sum()), abs=1e-4), (strategy, mode, ctx)
    # greedy: the continuation is the plain model's argmax after the context
    ctx = tok("The river flows", add_special_tokens=False)["input_ids"]
    with torch.inference_mode():
        best = int(tiny_lm.model(input_ids=torch.tensor([ctx])).logits[0, -1].argmax())
    flags = [
        g
        for _, g in FeedbackLM(lm=tiny_lm)._loglikelihood_tokens(
            [(("", ""), ctx, [best]), (("", ""), ctx, [(best + 1) % tiny_lm.vocab_size])], disable_tqdm=True
        )
    ]
    assert flags == [True, False]


PROMPTS = ["Question: What is 2 + 2?\nAnswer:", "The sky is", "Once upon a time there was"]


@pytest.mark.parametrize("strategy, params", [(None, {}), ("residual", {"alpha": 0.2}), STACK_CASE])
def test_greedy_generate_until_is_the_engines_row_text(tiny_lm, strategy, params):
    """The backend batches the prompts as rows of one run; each reply is the one the engine gives
    the prompt alone, and an `until` string cuts it (the row stops there)."""

    def alone(prompt: str) -> str:
        config = RunConfig(
            prompt=prompt,
            model=tiny_lm.name,
            chat_template=False,
            max_new_tokens=10,
            rows=[RowSpec("r", strategy, params)],
        )
        return run_to_end(tiny_lm, config).rows[0].text

    expected = [alone(p) for p in PROMPTS]
    side = FeedbackLM(lm=tiny_lm, strategy=strategy, params=params, batch_size=3)
    got = side.generate_until(
        [
            Instance("generate_until", {}, (p, {"until": [], "max_gen_toks": 10}), i)
            for i, p in enumerate(PROMPTS)
        ],
        disable_tqdm=True,
    )
    assert got == expected and all(got)
    stop = expected[0].split()[1]  # a word inside the first reply
    got = side.generate_until(
        [Instance("generate_until", {}, (PROMPTS[0], {"until": [stop], "max_gen_toks": 10}), 0)],
        disable_tqdm=True,
    )
    assert got == [cut(expected[0], [stop])] and stop not in got[0]


def test_the_baseline_agrees_with_lm_evals_own_hf_backend(tiny_lm):
    """lm-eval's HFLM on the same model object: the same rolling windows (max_length 32: three
    windows over the longer text), log-likelihoods (an empty context too) and greedy replies."""
    from lm_eval.models.huggingface import HFLM

    hf = HFLM(pretrained=tiny_lm.model, tokenizer=tiny_lm.tokenizer, max_length=32, batch_size=2)
    ours = FeedbackLM(lm=tiny_lm, max_length=32, batch_size=2)
    rolling = [
        _rolling(TEXT),
        _rolling("A library is a quiet place. People borrow books and bring them back. " * 2),
    ]
    assert ours.loglikelihood_rolling(rolling, disable_tqdm=True) == pytest.approx(
        hf.loglikelihood_rolling(rolling, disable_tqdm=True), abs=1e-3
    )
    scored = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(PAIRS + [("", "Hello there")])]
    assert [ll for ll, _ in ours.loglikelihood(scored, disable_tqdm=True)] == pytest.approx(
        [ll for ll, _ in hf.loglikelihood(scored, disable_tqdm=True)], abs=1e-4
    )
    gen = [
        Instance("generate_until", {}, (p, {"until": ["."], "max_gen_toks": 8, "do_sample": False}), i)
        for i, p in enumerate(PROMPTS[:2])
    ]
    assert ours.generate_until(gen, disable_tqdm=True) == hf.generate_until(gen, disable_tqdm=True)


def _word_ppl(lls: list[float], texts: list[str]) -> float:
    return math.exp(-sum(lls) / sum(len(re.split(r"\s+", t)) for t in texts))


def test_paired_comparison_runs_lm_eval_end_to_end(tiny_lm, monkeypatch):
    monkeypatch.chdir(ROOT)  # the tasks' data_files are relative to the repository root
    res = run_pair(
        tiny_lm,
        ["fl_mc_tiny", "fl_ppl_tiny", "fl_gen_tiny"],
        "deep_cache",
        {"lam": 0.3},
        include_path=str(TASKS),
        bootstrap=200,
        batch_size=4,
    )
    rows = {(r["task"], r["metric"]): r for r in res["comparison"]}
    assert set(rows) == {
        ("fl_mc_tiny", "acc"),
        ("fl_mc_tiny", "acc_norm"),
        ("fl_ppl_tiny", "word_perplexity"),
        ("fl_ppl_tiny", "byte_perplexity"),
        ("fl_ppl_tiny", "bits_per_byte"),
        ("fl_gen_tiny", "exact_match"),
    }
    acc = rows[("fl_mc_tiny", "acc")]
    assert acc["n"] == 8 and acc["baseline"] == res["baseline"]["fl_mc_tiny"]["acc,none"]
    assert acc["delta"] == pytest.approx((acc["gained"] - acc["lost"]) / 8)
    assert acc["ci95"][0] <= acc["delta"] <= acc["ci95"][1] and 0 <= acc["p_value"] <= 1
    ppl = rows[("fl_ppl_tiny", "word_perplexity")]
    assert ppl["n"] == 3 and ppl["ci95"][0] <= ppl["ci95"][1] and "bootstrap" in ppl["method"]
    # lm-eval's word perplexity of the rolling task is the perplexity code's, on each document's tokens
    texts = [json.loads(line)["text"] for line in (TASKS / "ppl_tiny.jsonl").read_text().splitlines()]
    prefix = tiny_lm.tokenizer.bos_token_id
    side = res["feedback_side"]
    assert (side["max_length"], side["window"], side["stride"]) == (512, 512, 511)  # capped by the context
    nlls = [
        token_nlls(
            tiny_lm,
            [prefix] + tiny_lm.tokenizer(t, add_special_tokens=False)["input_ids"],
            PPLConfig("deep_cache", {"lam": 0.3}, window=512, stride=511),
        )
        for t in texts
    ]
    for side, pick in (("baseline", 0), ("feedback", 1)):
        assert res[side]["fl_ppl_tiny"]["word_perplexity,none"] == pytest.approx(
            _word_ppl([-float(n[pick].sum()) for n in nlls], texts), rel=1e-5
        )
    assert res["feedback_side"]["strategy"] == "deep_cache" and res["baseline_side"]["strategy"] is None
    table = format_table(res["comparison"])
    assert table.splitlines()[0].split()[:3] == ["task", "metric", "n"] and len(table.splitlines()) == 7
    assert all(task in table for task in ("fl_mc_tiny", "fl_ppl_tiny", "fl_gen_tiny"))
    json.dumps(res, allow_nan=False)


def test_exact_tests_and_the_pairing_of_documents():
    assert mcnemar_exact(0, 5) == pytest.approx(0.0625) and mcnemar_exact(3, 3) == 1.0
    assert mcnemar_exact(0, 0) == 1.0
    assert clopper_pearson(0, 10)[1] == pytest.approx(1 - 0.025**0.1, abs=1e-9)
    lo, hi = clopper_pearson(5, 10)
    assert lo == pytest.approx(0.187086, abs=1e-5) and hi == pytest.approx(0.812914, abs=1e-5)

    def result(accs, lls):
        return {
            "results": {
                "t": {
                    "acc,none": sum(accs) / len(accs),
                    "acc_stderr,none": "N/A",
                    "alias": "t",
                    "perplexity,none": math.exp(-sum(lls) / len(lls)),
                }
            },
            "samples": {
                "t": [
                    {"doc_id": i, "filter": "none", "acc": a, "perplexity": ll}
                    for i, (a, ll) in enumerate(zip(accs, lls))
                ]
            },
            "configs": {
                "t": {
                    "metric_list": [
                        {"metric": "acc", "aggregation": "mean"},
                        {"metric": "perplexity", "aggregation": "perplexity"},
                    ]
                }
            },
            "higher_is_better": {"t": {"acc": True, "perplexity": False}},
        }

    base = result([1, 0, 0, 0, 1, 0], [-1.0, -2.0, -1.5, -1.2, -0.8, -2.2])
    fb = result([1, 1, 1, 1, 1, 0], [-0.9, -1.8, -1.4, -1.2, -0.7, -2.0])
    rows = {r["metric"]: r for r in compare(base, fb, resamples=500)}
    acc = rows["acc"]
    assert (acc["gained"], acc["lost"], acc["n"]) == (3, 0, 6) and acc["p_value"] == pytest.approx(0.25)
    assert acc["delta"] == pytest.approx(0.5) and acc["ci95"][0] < 0.5 <= acc["ci95"][1]
    ppl = rows["perplexity"]
    assert (
        ppl["delta"] < 0 and ppl["ci95"][1] <= 0 and ppl["higher_is_better"] is False
    )  # lower on every document


def test_baseline_batches_hold_at_most_the_rows_and_padded_tokens_allowed():
    from feedback.eval.lmeval import BATCH_TOKENS, _batches

    todo = [([0] * n, 1) for n in (BATCH_TOKENS + 10, 3000, 3000, 2000, 100, 100, 50)]
    assert [[len(s) for s, _ in b] for b in _batches(todo, 8)] == [
        [BATCH_TOKENS + 10],
        [3000, 3000],
        [2000, 100, 100, 50],
    ]
    assert [len(b) for b in _batches(todo, 2)] == [1, 2, 2, 2]
