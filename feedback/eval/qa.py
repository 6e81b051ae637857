"""Question answering with references: greedy accuracy and the gold answer's perplexity, per row.

Each question of a set with gold answers (JSONL of {"question", "answer"}) runs once through the
engine with the given rows (a plain row and strategies), greedy by default. A row is right when the
answer extracted from its reply (`voting.extract_answer`; for a restate row, from the part after its
restatement) matches the gold one (`voting.answer_matches`). The gold answer's perplexity after
the prompt (after the restatement for restate) is the run's reference PPL. This is how prompt-level
strategies, which text perplexity cannot score, are compared with the others.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

from feedback import ASSETS
from feedback.core.engine import run_to_end
from feedback.core.model import LoadedModel
from feedback.core.records import RowSpec, RunConfig, answer_text
from feedback.errors import FeedbackError, check_stop
from feedback.eval.voting import answer_matches, extract_answer

BUILTIN_QUESTIONS = ASSETS / "questions.jsonl"  # 16, with gold answers


def evaluate_qa(
    lm: LoadedModel,
    questions: list[dict],
    rows: list[RowSpec],
    max_new_tokens: int = 64,
    progress: Callable[[int, int], None] | None = None,
    stop: threading.Event | None = None,
) -> dict:
    """Per row: accuracy, mean gold-answer NLL (and its perplexity), tokens; per question: each
    row's extracted answer and whether it is right."""
    if not questions:
        raise FeedbackError("the question set is empty")
    if not rows:
        raise FeedbackError("give at least one row")
    started, items = time.perf_counter(), []
    totals = {r.name: {"right": 0, "nll": 0.0, "scored": 0, "tokens": 0} for r in rows}
    for i, q in enumerate(questions):
        check_stop(stop, "the question set")
        gold = str(q["answer"])
        cfg = RunConfig(
            prompt=q["question"], model=lm.name, max_new_tokens=max_new_tokens, rows=rows, reference=gold
        )
        result = run_to_end(lm, cfg, stop_event=stop)
        item = {"question": q["question"], "gold": gold, "rows": {}}
        for row in result.rows:
            answer = extract_answer(answer_text(row), question=q["question"])
            right = bool(answer_matches(answer, gold))
            t = totals[row.name]
            t["right"] += right
            t["tokens"] += len(row.token_ids)
            ppl = row.metrics.get("reference_ppl")
            if ppl is not None:
                t["nll"] += math.log(ppl)
                t["scored"] += 1
            item["rows"][row.name] = {
                "answer": answer,
                "right": right,
                "reference_ppl": ppl,
                "text": row.text,
            }
        items.append(item)
        if progress:
            progress(i + 1, len(questions))
    n = len(questions)
    summary = {
        name: {
            "accuracy": t["right"] / n,
            "right": t["right"],
            "gold_ppl": math.exp(t["nll"] / t["scored"]) if t["scored"] else None,
            "mean_tokens": t["tokens"] / n,
        }
        for name, t in totals.items()
    }
    return {
        "questions": n,
        "rows": summary,
        "items": items,
        "max_new_tokens": max_new_tokens,
        "row_specs": [{"name": r.name, "strategy": r.strategy, "params": r.params} for r in rows],
        "wall_seconds": time.perf_counter() - started,
    }
