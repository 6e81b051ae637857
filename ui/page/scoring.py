"""What every corpus job shares (the Perplexity tab's measurement, the Sweep's and the Tune's): the
per-document limit, the estimate, progress and refusals.

Every corpus job says before it starts what it will score and about how long that takes
(`JobClock`, from the library's `Estimate` and the model's measured speed), then where it stands
within a point, and a request over the scoring budget is refused naming the fields that would make
it fit (`check_budget`)."""

from __future__ import annotations

import gradio as gr

from feedback.core.budget import Budget
from feedback.errors import FeedbackError
from feedback.eval.perplexity import (
    RATE_PROBE_TOKENS,
    Estimate,
    PPLConfig,
    ScoringProgress,
    document_ids,
    fitting_cap,
    fitting_docs,
    measured_rate,
    scoring_rate,
    seconds_left,
)
from feedback.serve.gpu_time import GpuWork
from feedback.serve.limits import (
    MAX_DOCS,
    MAX_TOKENS_PER_DOC,
    SERVED_MAX_TOKENS_PER_DOC,
)
from ui.page.controls import bound_number


def max_tokens_input(prefix: str) -> gr.Number:
    """The per-document token limit; it starts at the served cap, which cuts nothing the default
    budget could score, so a person lowers it for a shorter job."""
    return bound_number(
        MAX_TOKENS_PER_DOC,
        SERVED_MAX_TOKENS_PER_DOC,
        elem_id=f"{prefix}-max-tokens",
        info=f"each document cut to its first N tokens ({MAX_TOKENS_PER_DOC.info})",
    )


def doc_limits(values: dict) -> dict:
    """The `PPLConfig` settings of the per-document limit box, checked against its bound."""
    return {"max_tokens_per_doc": MAX_TOKENS_PER_DOC.check(values["max_tokens_per_doc"])}


def token_counts(lm, docs, cfg: PPLConfig) -> list[int]:
    return [len(ids) for ids in document_ids(lm, docs, cfg)]


def check_budget(budget: Budget, est: Estimate, counts: list[int], cfg: PPLConfig) -> None:
    """The scoring budget's refusal, and what would fit: the largest per-document limit, or the
    most documents, by the names of the page's fields (the budget's own message names only its
    setting, which a visitor cannot change)."""
    try:
        budget.check_scoring(est.forwards, est.how)
    except FeedbackError as exc:
        raise FeedbackError(f"{exc}{fit_hint(counts, cfg, est.points or 1, budget.scored_tokens)}") from None


def fit_hint(counts: list[int], cfg: PPLConfig, points: int, limit: int) -> str:
    cap, docs = fitting_cap(counts, cfg, points, limit), fitting_docs(counts, cfg, points, limit)
    options = ([f"{MAX_TOKENS_PER_DOC.name} {cap:,}"] if cap else []) + (
        [f"{MAX_DOCS.name} {docs}"] if 0 < docs < len(counts) else []
    )
    return f". It fits with {' or '.join(options)}." if options else ""


def duration(seconds: float) -> str:
    """ "about 40 s", "about 700 s (12 min)"."""
    return f"about {seconds:,.0f} s" + (f" ({seconds / 60:.0f} min)" if seconds >= 120 else "")


def part_text(est: Estimate, label: str = "", noun: str = "points") -> str:
    """ "3 documents, 5,989 tokens, fed as 11,200 window tokens × (baseline + 6 points × 3 passes) =
    246,400 token-forwards": tokens × points × passes, the sum the budget checks."""
    if est.mode is None:
        each = "baseline only"
    else:
        passes = (
            f"{est.passes} (token by token)"
            if est.mode == "exact"
            else f"{est.passes} pass{'es' if est.passes != 1 else ''}"
        )
        each = f"(baseline + {est.points} {noun} × {passes})" if noun else f"(baseline + feedback × {passes})"
    return (
        f"{label}{est.documents:,} document{'s' if est.documents != 1 else ''}, {est.tokens:,} tokens, "
        f"fed as {est.window_tokens:,} window tokens × {each} = {est.forwards:,} token-forwards"
    )


def scored_text(at: ScoringProgress) -> str:
    """ "point 2 of 6: 1,024 of 3,000 tokens scored (document 2 of 3)"."""
    where = {
        "point": f"point {at.point} of {at.points}: ",
        "trial": f"trial {at.point}" + (f" of {at.points}" if at.points else "") + ": ",
        "test": "test: ",
    }.get(at.stage, "")
    return f"{where}{at.tokens:,} of {at.total:,} tokens scored (document {at.document} of {at.documents})"


class JobClock:
    """A corpus job's estimate (one or more parts: the Tune's search, then its test) and where it
    stands, as status text. The rate is the model's measured one (`scoring_rate`), known at once
    when this model has been measured, else once the job has measured it as it starts."""

    def __init__(self, lm, *parts: tuple[str, str, Estimate | None]):
        self.parts = [(label, noun, est) for label, noun, est in parts if est is not None]
        self.rate, self.at, self.at_s = measured_rate(lm), None, 0.0

    @property
    def forwards(self) -> int:
        return sum(est.forwards for _, _, est in self.parts)

    def take(self, item, elapsed: float) -> bool:
        """Whether `item` was one of the clock's reports: the measured rate, or where the job stands
        (heard `elapsed` seconds into the job)."""
        if isinstance(item, Estimate):
            self.rate = item.rate
        elif isinstance(item, ScoringProgress):
            self.at, self.at_s = item, elapsed
        return isinstance(item, (Estimate, ScoringProgress))

    def estimate_text(self) -> str:
        parts = "; then ".join(part_text(est, label, noun) for label, noun, est in self.parts)
        when = (
            f"{duration(self.forwards / self.rate)} at {self.rate:,.0f} token-forwards/s "
            "measured on this model"
            if self.rate
            else "the time follows once this model's speed is measured"
        )
        return f"Estimate: {parts}; {when}."

    def where_text(self, elapsed: float) -> str:
        """Where the job stands and the time left, at its pace so far."""
        if self.at is None:
            return "starting" if self.rate else "measuring this model's speed"
        left = seconds_left(self.forwards, self.at.forwards, self.at_s, self.rate)
        if left is None:
            return scored_text(self.at)
        # between reports (a window can take seconds) the time left counts down from the last one
        return f"{scored_text(self.at)}; {duration(max(0.0, left - (elapsed - self.at_s)))} left"


LESS_TEXT = (
    f"less text ({MAX_DOCS.name}, {MAX_TOKENS_PER_DOC.name})"  # what a scoring job over the cap asks less of
)


def measure(est: Estimate, lm, stop) -> Estimate:
    """In the GPU function, holding the model: `est` at this model's rate, a report the page's clock
    `take`s."""
    return est.at(scoring_rate(lm, stop))


def scoring_gpu_work(*ests: Estimate | None, fewer: str) -> GpuWork:
    """The GPU work of scoring a corpus: every estimate's token-forwards, and the rate's probe."""
    forwards = sum(est.forwards for est in ests if est is not None)
    return GpuWork(scored=forwards + RATE_PROBE_TOKENS + 8, how=f"{forwards:,} token-forwards", fewer=fewer)
