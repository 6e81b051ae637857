"""Deep Think's calibration panel: is the confidence worth trusting on this question?

Computed from the Deep Think run's own traces when the question has an expected answer
(`feedback.eval.calibration.from_deep_think`), so it needs no model work: the warm-up traces fit
Platt scaling (dev), the online traces that were not stopped are scored (test). A reliability
diagram per side (one line per DeepConf measure, in the side's colour) and a table of AUROC, ECE,
adaptive ECE and Brier score per side and measure, the AUROC and ECE each with the count of traces
behind it and its 95% CI, or "too few" where the traces cannot judge the measure (the library's
`too_few`): a run's handful of traces must not read as a verdict. `python -m feedback calibrate`
measures the same over a whole question set."""

from __future__ import annotations

import math

import gradio as gr
import plotly.graph_objects as go

from feedback.eval.calibration import (
    ECE_RESAMPLES,
    ECE_SEED,
    MEASURES,
    MIN_JUDGED_TRACES,
    MIN_PER_CLASS,
    from_deep_think,
    side_too_few,
)
from feedback.eval.deepthink import SIDES
from feedback.eval.figures import figure
from ui.page.charts import MARK, empty_figure, row_color

# One colour per side (as in every chart); the measures differ by dash and marker, so the lines
# read without colour too.
STYLES = {
    "mean": ("solid", "circle"),
    "tail": ("dash", "square"),
    "bottom10_group": ("dot", "diamond"),
    "lowest_group": ("dashdot", "triangle-up"),
}
SHORT = {"mean": "mean", "tail": "tail", "bottom10_group": "bottom-10% group", "lowest_group": "lowest group"}
HEADERS = [
    "side",
    "measure",
    "test traces",
    "accuracy",
    "AUROC",
    "AUROC 95% CI",
    "ECE",
    "ECE 95% CI",
    "adaptive ECE",
    "Brier",
    "Brier (base rate)",
    "Platt a",
    "Platt b",
]
TOO_FEW = "too few"  # an interval's cell where the traces cannot judge the measure
NO_EXPECTED = (
    "Give an **expected answer** to see whether the confidence can be trusted on this question: each "
    "trace is then right or wrong, and the panel compares confidence with correctness."
)
EXPLAINED = (
    "**AUROC**: the chance a right trace has a higher confidence than a wrong one (0.5 = no signal; needs "
    "right and wrong traces). Each measure is mapped to a probability by Platt scaling fitted on the warm-up "
    "traces; on the online traces that were not stopped, **ECE** (equal-width bins) and **adaptive ECE** "
    "(equal-mass bins) are the average gap between confidence and accuracy (0 = calibrated), **Brier** is "
    "the mean of (p − right)², to beat its **base rate** (the warm-up accuracy for every trace). "
    "**95% CI**: the AUROC's a score interval on Hanley & McNeil's variance, the ECE's a bootstrap of the "
    f"online traces ({ECE_RESAMPLES} resamples, seed {ECE_SEED}); **too few**: fewer than "
    f"{MIN_JUDGED_TRACES} online traces, or fewer than {MIN_PER_CLASS} right or {MIN_PER_CLASS} wrong ones, "
    "which cannot judge a measure. — : not defined here."
)


def _round(value, digits: int = 3):
    """A table cell: the number rounded, or a dash where it is not defined."""
    return (
        "—"
        if value is None or (isinstance(value, float) and not math.isfinite(value))
        else round(value, digits)
    )


def interval(pair, judged: bool) -> str:
    """An interval's cell: "[0.61, 0.93]", "too few" where the traces cannot judge, or a dash."""
    if not judged:
        return TOO_FEW
    return "—" if pair is None else f"[{pair[0]:.2f}, {pair[1]:.2f}]"


def reliability_figure(side: str, rep: dict, color_index: int) -> go.Figure:
    """Accuracy against Platt-scaled confidence per bin of the test traces, one line per measure (the
    marker's size grows with the bin's count), and the diagonal a calibrated measure would follow."""
    color = row_color(color_index)
    traces = [
        dict(
            type="scatter",
            x=[0, 1],
            y=[0, 1],
            mode="lines",
            name="calibrated",
            line=dict(color=MARK, dash="dash", width=1.5),
            hoverinfo="skip",
        )
    ]
    counts = [b["count"] for m in MEASURES for b in rep["measures"][m]["test"]["reliability"]]
    largest = max(counts or [1]) or 1
    for m in MEASURES:
        bins = [b for b in rep["measures"][m]["test"]["reliability"] if b["count"]]
        if not bins:
            continue
        dash, symbol = STYLES[m]
        traces.append(
            dict(
                type="scatter",
                x=[b["confidence"] for b in bins],
                y=[b["accuracy"] for b in bins],
                mode="lines+markers",
                name=SHORT[m],
                line=dict(color=color, dash=dash, width=1.5),
                marker=dict(
                    color=color, symbol=symbol, size=[6 + 12 * math.sqrt(b["count"] / largest) for b in bins]
                ),
                customdata=[[b["count"], b["lo"], b["hi"]] for b in bins],
                hovertemplate=(
                    f"{SHORT[m]}<br>bin %{{customdata[1]:.1f}}–%{{customdata[2]:.1f}}:"
                    f" %{{customdata[0]}} traces"
                    "<br>mean confidence %{x:.2f}<br>accuracy %{y:.2f}<extra></extra>"
                ),
            )
        )
    return figure(
        traces,
        320,
        "Platt-scaled confidence (online traces)",
        f"{side}: accuracy",
        hovermode="closest",
        xaxis=dict(range=[0, 1]),
        yaxis=dict(range=[-0.05, 1.05]),
    )


def table_rows(result: dict) -> list[list]:
    rows = []
    for side, rep in result["sides"].items():
        for m in MEASURES:
            r = rep["measures"][m]
            t, platt = r["test"], r["platt"] or {}
            judged = t["too_few"] is None
            rows.append(
                [
                    side,
                    SHORT[m],
                    t["traces"],
                    _round(t["accuracy"]),
                    _round(t["auroc"]),
                    interval(t["auroc_ci95"], judged),
                    _round(t["ece"]),
                    interval(t["ece_ci95"], judged),
                    _round(t["adaptive_ece"]),
                    _round(t["brier"]),
                    _round(t["brier_base_rate"]),
                    _round(platt.get("a")),
                    _round(platt.get("b")),
                ]
            )
    return rows


def _share(value: float | None) -> str:
    """An accuracy as a percentage, or a dash where there is none."""
    return "—" if value is None else f"{value:.0%}"


def note(result: dict) -> str:
    """What the numbers were computed from, and what each side's early-stop threshold kept."""
    lines = [
        f"Computed from this run's own traces against the expected answer: Platt scaling fitted on the "
        f"warm-up traces, scored on the online traces that were not stopped (η {result['eta']:g}%)."
    ]
    for side, rep in result["sides"].items():
        n = rep["traces"]
        th = rep["thresholds"][0]
        kept = th["dev"]
        line = (
            f"**{side}**: {n['dev']} warm-up and {n['test']} online traces "
            f"(stopped ones left out: {result['stopped_left_out'][side]})"
        )
        if kept is not None:
            line += (
                f"; the threshold {th['threshold']:.2f} keeps {kept['kept']} of {kept['traces']} "
                f"warm-up traces, accuracy {_share(kept['accuracy_kept'])} vs "
                f"{_share(kept['accuracy_all'])} of all"
            )
        lines.append(line + ".")
    lines += caveats(result)
    return "  \n".join(lines) + "\n\n" + EXPLAINED


def caveats(result: dict) -> list[str]:
    """A line per side whose online traces cannot judge its measures (the first measure's reason,
    with the count), and where to measure them properly."""
    lines = []
    for side, rep in result["sides"].items():
        reason = side_too_few(rep)
        if reason:
            lines.append(
                f"**{side}: {reason}**: its AUROC and ECE below come without an interval and are no "
                "evidence either way."
            )
    if lines:
        lines.append("`python -m feedback calibrate` measures them over a question set.")
    return lines


def view(report: dict | None) -> tuple:
    """The panel's note, both sides' reliability diagrams and the table, from a Deep Think report."""
    result = from_deep_think(report) if report else None
    if result is None:
        blank = empty_figure("a reliability diagram appears here after a run with an expected answer")
        return NO_EXPECTED, blank, blank, []
    figures = [reliability_figure(side, result["sides"][side], i) for i, side in enumerate(SIDES)]
    return note(result), *figures, table_rows(result)


class CalibrationPanel:
    """Built inside the Deep Think tab; `connect` refreshes it after every run from the kept report."""

    def build(self) -> None:
        with gr.Accordion(
            "Calibration: is the confidence worth trusting?", open=True, elem_id="dt-calibration"
        ):
            self.note = gr.Markdown(NO_EXPECTED, elem_id="dt-calib-note")
            with gr.Row():
                self.plots = [
                    gr.Plot(show_label=False, elem_id="dt-calib-baseline"),
                    gr.Plot(show_label=False, elem_id="dt-calib-feedback"),
                ]
            self.table = gr.Dataframe(headers=HEADERS, interactive=False, elem_id="dt-calib-table")

    def connect(self, event, kept: gr.State) -> None:
        event.then(view, kept, [self.note, *self.plots, self.table], api_name=False, show_progress="hidden")
