"""The Sweep's and the Tune's best point, as both keep it for "Send best to Compare": only a point
that beats the baseline is kept (`recommend`), and where in Compare it goes (`target_column`,
`unique_name`). Each job's report stream feeds its clock and rows here too (`take_reports`)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import NamedTuple

import gradio as gr

from feedback.strategies import get_strategy
from ui.page.runner import Finished

FEEDBACK_COLUMN = 1  # Compare's column 2, the page's default feedback column (column 1 is the baseline)
SEND_LABEL = "Send best to Compare"


def take_reports(work, items: list, elapsed: float) -> bool:
    """A long job's reports, `elapsed` seconds into it: the measured rate and where the job stands
    go to `work.clock`, result rows (dicts) join `work.rows`, a `Finished` result becomes
    `work.result`. True when a new row came."""
    new = False
    for item in items:
        if work.clock.take(item, elapsed):
            continue
        if isinstance(item, dict):
            work.rows.append(item)
            new = True
        elif isinstance(item, Finished):
            work.result = item.result
    return new


def kept_best(
    source: str, strategy: str, params: dict, num_layers: int, delta_pct: float, judged: str = ""
) -> dict:
    """A job's best point as the tab keeps it for "Send best to Compare": the job that found it
    ("Sweep", "Tune"), the strategy, every parameter with defaults filled in (a Compare column takes
    a whole set: one left out would keep whatever the column had), its ΔPPL and the verdict on it
    (`feedback.eval.verdict`, in words). Only a point that beats the baseline is kept (`recommend`)."""
    return {
        "source": source,
        "strategy": strategy,
        "params": get_strategy(strategy).validate(params, num_layers),
        "delta_pct": delta_pct,
        "verdict": judged,
    }


def offer(best: dict | None) -> dict:
    """The kept best point (by output name) and its send button, which is on only when there is one:
    a job whose best does not beat the baseline keeps none, so a harmful setting is never offered."""
    return {"best": best, "send": gr.update(interactive=best is not None)}


class Judged(NamedTuple):
    """A job's best point as the status line reports it (`sweep_best`, `tune_best`)."""

    text: str  # the point in words, each ΔPPL with the verdict on it
    why: str | None  # why it is no recommendation; None: it is one
    verdict: str  # the verdict on its ΔPPL (a Tune's on dev), for the note "Send best to Compare" writes


def recommend(judged: Judged, keep: Callable[[str], dict]) -> tuple[str, dict | None]:
    """The status line's words on a job's best point and what the tab keeps of it: the point
    (`keep(verdict)`) when it is a recommendation, else nothing, the line saying why first."""
    if judged.why is None:
        return judged.text, keep(judged.verdict)
    return f"{judged.why}, so nothing is offered to Compare — {judged.text}", None


def target_column(strategy: str, strategies: list, shown: int) -> int:
    """The Compare column (0-based) a best point goes to: the first shown column already on its
    strategy (that column is the one meant to try it), else column 2, the page's feedback column."""
    return next((i for i, s in enumerate(strategies[:shown]) if s == strategy), FEEDBACK_COLUMN)


def unique_name(base: str, names: list[str], column: int) -> str:
    """`base` ("Sweep best"), numbered ("Sweep best 2") while another column has that name: a run
    refuses two columns of one name."""
    others = set(names[:column] + names[column + 1 :])
    return next(name for k in itertools.count(1) if (name := base if k == 1 else f"{base} {k}") not in others)
