"""The GPU time one request asks for on ZeroGPU (`spaces.GPU`'s duration), from its size.

ZeroGPU checks the asked-for duration against the visitor's quota before the call and serves
shorter requests first, so each request asks for what its size needs rather than one default:
a start-up term, then each decode step (every row advances one token; on a GPU a step costs
about the same for 1 row or 16), each row-token decoded, and each token-forward scored without
decoding (prompt prefill, the quality metrics, perplexity, recall's gold answers). The cap is
`limits.GPU_DURATION_CAP_S` (FEEDBACK_GPU_DURATION_CAP); a request over it is refused before it
waits, saying what to ask less of.

The rates were measured with the embedded model (SmolLM2-135M, float32) on the 2-core development
CPU, under the load of a parallel test run: decode steps of 1, 4, 8 and 16 rows took 54, 103, 172
and 259 ms (about 40 ms a step and 14 ms a row-token; rounded up below), scoring ran ~230
token-forwards/s. A GPU is faster, so on one these are upper bounds; they were not measured on a
GPU (`python -m feedback doctor` measures step times there). They are where a server starts: a
`GpuClock` scales them by what each finished request measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from feedback.errors import FeedbackError
from feedback.serve.limits import GPU_DURATION_CAP_ENV

START_S = 10.0  # forking ZeroGPU's worker and moving the weights to the GPU (not measured on ZeroGPU)
STEP_S = 0.045  # one decode step, whatever the rows
ROW_TOKEN_S = 0.015  # one row's token within a step
SCORE_S = 0.005  # one token-forward of prefill or scoring


@dataclass(frozen=True)
class GpuWork:
    """What one request will do on the GPU, in the units its time scales with."""

    steps: int = 0  # decode steps, every run of the request together
    row_tokens: int = 0  # tokens decoded, every row together (rows x new tokens)
    scored: int = 0  # token-forwards without decoding: prefill, scoring, perplexity
    how: str = ""  # the sizes, as a refusal states them: "4 columns x 1,024 new tokens"
    fewer: str = ""  # what to ask less of, by the page's field names: "fewer columns or max new tokens"

    def variable_s(self) -> float:
        """The seconds the work itself takes at the rates above (start-up aside)."""
        return self.steps * STEP_S + self.row_tokens * ROW_TOKEN_S + self.scored * SCORE_S

    def seconds(self, scale: float = 1.0) -> int:
        """The GPU seconds to ask for (whole seconds, rounded up), the work's rates times `scale`
        (a `GpuClock`'s: what this machine measured)."""
        return math.ceil(START_S + scale * self.variable_s())

    def check(self, cap: int, scale: float = 1.0) -> int:
        """The seconds to ask for, or a `FeedbackError` when they are over `cap` (before the request
        waits)."""
        seconds = self.seconds(scale)
        if seconds > cap:
            raise FeedbackError(
                f"this request needs about {seconds:,} s of GPU time ({self.how}); a request here "
                f"may ask for at most {cap:,} s ({GPU_DURATION_CAP_ENV}): ask for {self.fewer}"
            )
        return seconds


MIN_MEASURED_S = 2.0  # work predicted shorter than this says little about the rates (start-up noise)
MARGIN = 1.25  # asked-for time over the slowest recent measure: a run may be slower than the last ones
MIN_SCALE, MAX_SCALE = 0.05, 2.0
KEEP = 8  # recent measurements the scale is taken from


@dataclass
class GpuClock:
    """The rates above scaled to the machine the work really runs on. After each request that ran
    to its end, the time its work took inside the GPU function (queueing and start-up aside) is
    compared with what the rates predicted; the scale is the slowest of the last KEEP such ratios
    times MARGIN, within [MIN_SCALE, MAX_SCALE]. It starts at 1: the development CPU's rates, an
    upper bound on a GPU, so a new Space over-asks at first and asks for what it needs after a few
    requests (ZeroGPU serves shorter requests first)."""

    scale: float = 1.0
    ratios: list[float] = field(default_factory=list)

    def observe(self, work: GpuWork, seconds: float) -> None:
        predicted = work.variable_s()
        if predicted < MIN_MEASURED_S:
            return
        self.ratios = (self.ratios + [seconds / predicted])[-KEEP:]
        self.scale = min(MAX_SCALE, max(MIN_SCALE, MARGIN * max(self.ratios)))
