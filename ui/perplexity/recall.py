"""The Perplexity tab's Recall section: long-context key-fact recall (`feedback.eval.recall`) on a
small grid — synthetic facts at depths of texts of some lengths, the baseline and the strategy of
the section's own panel in one run per prompt — drawn as heatmaps of the facts recalled per length ×
depth (each row, and the strategy minus the baseline) while it runs.

The work goes through `ModelRunner` as every model job does (the one model line, Stop, closed
tabs, the served budgets); the handler takes its controls' values by name (the strategy controls as
`<strategy>_<param>`), and every number is checked against the bound its box shows
(`feedback.serve.limits`). The grid is built and its cost checked before the request waits."""

from __future__ import annotations

from dataclasses import dataclass, replace

import gradio as gr

from feedback.core.budget import Budget
from feedback.core.records import RowSpec
from feedback.errors import FeedbackError
from feedback.eval.recall import (
    Instance,
    RecallConfig,
    check_budget,
    evaluate_recall,
    plan,
    recall_result,
    summarise,
    work,
)
from feedback.eval.recall_figures import GAIN_LEGEND, accuracy_heatmap, difference_heatmap
from feedback.serve.gpu_time import GpuWork
from feedback.serve.limits import (
    RECALL_GRID_CHARS,
    RECALL_ITEMS,
    RECALL_NEW_TOKENS,
    SERVED_RECALL_MAX_LENGTH,
    SERVED_RECALL_MAX_VALUES,
    SMALL_SEED,
    check_recall_grid,
)
from feedback.serve.pool import ModelPool
from feedback.strategies import build_strategy, get_strategy
from ui.page.charts import empty_figure
from ui.page.controls import bound_number, build_strategy_panel, chosen, run_controls, to_components
from ui.page.runner import Finished, GpuTask, ModelRunner, Outcome, TabWork, cancellable_by_clients, reporting
from ui.page.stop_signal import StopSignal

TAB = "recall"  # its own jobs: its Stop ends its own run, not a perplexity measurement
BASELINE = "baseline"


def duration(seconds: float) -> str:
    """ "about 40 s", "about 700 s (12 min)" (as the corpus jobs say it)."""
    return f"about {seconds:,.0f} s" + (f" ({seconds / 60:.0f} min)" if seconds >= 120 else "")


def rows_for(strategy: str, params: dict, num_layers: int) -> list[RowSpec]:
    """The baseline, then the panel's strategy (a row named after it), its parameters checked now."""
    get_strategy(strategy)
    try:
        build_strategy(strategy, params, num_layers)
    except FeedbackError as exc:
        raise FeedbackError(f"{strategy}: {exc}") from None
    return [RowSpec(BASELINE), RowSpec(strategy, strategy, dict(params))]


def plan_text(instances: list[Instance], rows: list[RowSpec], max_new_tokens: int, cfg: RecallConfig) -> str:
    """ "12 prompts (2 items × 2 lengths × 3 depths) of 316 to 1,080 tokens, 2 rows: 9,000 token-forwards
    scored, 384 tokens decoded at most": what the budgets check."""
    scored, decoded, _ = work(instances, rows, max_new_tokens)
    sizes = [i.prompt_tokens for i in instances]
    size = f"{min(sizes):,}" if min(sizes) == max(sizes) else f"{min(sizes):,} to {max(sizes):,}"
    return (
        f"{count(len(instances), 'prompt')} ({count(cfg.items, 'item')} × "
        f"{count(len(cfg.lengths), 'length')} × "
        f"{count(len(cfg.depths), 'depth')}) of {size} tokens, {len(rows)} rows: {scored:,} token-forwards "
        f"scored, {decoded:,} tokens decoded at most"
    )


def count(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def verdict(res: dict, name: str) -> str:
    """One strategy row against the baseline, in words, with the numbers behind it."""
    t, rows = res["tests"][name], res["rows"]
    m, g = t["mcnemar"], t["gold_logprob"]
    base, own = rows[BASELINE], rows[name]
    line = (
        f"**{name}** recalled {own['right']} of {own['instances']} facts, the baseline {base['right']}: "
        f"{m['strategy_only_right']} right only with {name}, {m['baseline_only_right']} only without; "
        f"McNemar exact p = {m['p']:.3g}" + (" (no clear difference)" if m["p"] >= 0.05 else "")
    )
    if g["mean_diff"] is None:
        return f"{line}.  \nGold answer's log-probability: {g['method']}."
    ci = g["ci95"]
    if ci is None:
        return f"{line}.  \nΔ gold-answer log-probability {g['mean_diff']:+.3f} nats per prompt (no CI)."
    word = (
        "higher with feedback (the CI excludes 0)"
        if ci[0] > 0
        else "lower with feedback (the CI excludes 0)"
        if ci[1] < 0
        else "no clear difference (the CI includes 0)"
    )
    return (
        f"{line}.  \nΔ gold-answer log-probability {g['mean_diff']:+.3f} nats per prompt, 95% CI "
        f"[{ci[0]:+.3f}, {ci[1]:+.3f}] — {word}; {g['method']}."
    )


def result_view(res: dict, strategy: str, note: str = "") -> dict:
    """What the section shows of a (possibly partial) result, by output name."""
    lengths, depths = res["lengths"], res["depths"]
    view = {
        "baseline_plot": accuracy_heatmap(
            res["accuracy"][BASELINE], res["counts"], lengths, depths, f"baseline: facts recalled{note}"
        ),
        "strategy_plot": accuracy_heatmap(
            res["accuracy"][strategy], res["counts"], lengths, depths, f"{strategy}: facts recalled{note}"
        ),
        "difference_plot": difference_heatmap(
            res["difference"][strategy], lengths, depths, f"{strategy} − baseline: accuracy difference{note}"
        ),
    }
    if res["instances"]:
        view["summary"] = verdict(res, strategy)
    return view


@dataclass
class RecallTask(GpuTask):
    """A Recall grid on the GPU: each prompt's record as it finishes, then `Finished` with the result."""

    model: str
    gpu: GpuWork
    cfg: RecallConfig
    rows: list[RowSpec]
    instances: list[Instance]
    budget: Budget | None

    def run(self, lm, stop: StopSignal):
        def job(report, halt):
            return evaluate_recall(
                lm,
                self.cfg,
                self.rows,
                instances=self.instances,
                on_instance=report,
                stop=halt,
                budget=self.budget,
            )

        yield from reporting(job, stop)

    def split(self, fits) -> list[RecallTask]:
        """Consecutive runs of prompts, each as many as fit one call (a prompt is one engine run)."""
        chunks: list[list[Instance]] = [[]]
        for inst in self.instances:
            if chunks[-1] and not fits(
                recall_gpu_work(chunks[-1] + [inst], self.rows, self.cfg.max_new_tokens)
            ):
                chunks.append([])
            chunks[-1].append(inst)
        return [
            replace(self, instances=c, gpu=recall_gpu_work(c, self.rows, self.cfg.max_new_tokens))
            for c in chunks
        ]


def recall_gpu_work(instances: list[Instance], rows: list[RowSpec], max_new_tokens: int) -> GpuWork:
    """One run of the rows per prompt: its decode, and the prompt and gold answers scored."""
    scored, decoded, how = work(instances, rows, max_new_tokens)
    return GpuWork(
        steps=len(instances) * max_new_tokens,
        row_tokens=decoded,
        scored=scored,
        how=f"{how}; {max_new_tokens} new tokens each",
        fewer="fewer items, lengths or depths, shorter lengths, or fewer max new tokens",
    )


class RecallWork(TabWork):
    label = "a Recall grid"

    def __init__(
        self, section: RecallSection, lm, cfg: RecallConfig, rows: list[RowSpec], instances: list[Instance]
    ):
        super().__init__(section.run, section.stop, section.status)
        self.outputs, self.budget = section.outputs, section.runner.budget
        self.lm, self.cfg, self.rows, self.instances = lm, cfg, rows, instances
        self.strategy = rows[1].name
        self.plan = plan_text(instances, rows, cfg.max_new_tokens, cfg)
        self.records: list[dict] = []
        self.wall_seconds = 0.0  # the runs' own time, every GPU call's together
        self.task = RecallTask(
            lm.name, recall_gpu_work(instances, rows, cfg.max_new_tokens), cfg, rows, instances, self.budget
        )

    def starting(self) -> dict:
        blank = empty_figure("the heatmaps fill in as each prompt finishes")
        if self.calls and len(self.calls) > 1:
            self.plan += f"; as {len(self.calls)} GPU calls, the grid being longer than one may ask for"
        return (
            self.busy()
            | self.say(f"Starting: {self.plan}.")
            | to_components(
                self.outputs,
                {
                    "summary": "",
                    "baseline_plot": blank,
                    "strategy_plot": blank,
                    "difference_plot": blank,
                    "result": None,
                },
            )
        )

    def _partial(self) -> dict:
        return summarise(
            self.records,
            [r.name for r in self.rows],
            self.cfg.lengths,
            self.cfg.depths,
            self.cfg.bootstrap,
            self.cfg.seed,
        )

    def left_text(self, elapsed: float) -> str:
        """Time left at the pace so far, prompts weighted by their tokens."""
        done = sum(i.prompt_tokens for i in self.instances[: len(self.records)])
        total = sum(i.prompt_tokens for i in self.instances)
        return f"; {duration(elapsed * (total - done) / done)} left" if done and elapsed > 0 else ""

    def progress(self, items: list, elapsed: float) -> dict:
        out, new = self.busy(), False
        for item in items:
            if isinstance(item, Finished):  # one GPU call's prompts done (the grid may take several)
                self.wall_seconds += item.result["wall_seconds"]
            elif isinstance(item, dict):
                self.records.append({k: v for k, v in item.items() if k not in ("done", "total")})
                new = True
        n, total = len(self.records), len(self.instances)
        if new:
            note = f" ({n} of {total} prompts)"
            out |= to_components(self.outputs, result_view(self._partial(), self.strategy, note))
        where = (
            ""
            if n >= total
            else f"; now length {self.instances[n].length:,}, depth {self.instances[n].depth:g} %"
        )
        return out | self.say(
            f"Running… {n} of {total} prompts done{where}{self.left_text(elapsed)} "
            f"({elapsed:.0f} s). {self.plan}."
        )

    def finish(self, outcome: Outcome) -> dict:
        if outcome.kind == "done" and len(self.records) == len(self.instances):
            res = recall_result(self.lm.name, self.cfg, self.rows, self.records, self.wall_seconds)
            return (
                self.idle()
                | self.say(f"Done in {res['wall_seconds']:.1f} s: {self.plan}.")
                | to_components(self.outputs, result_view(res, self.strategy) | {"result": res})
            )
        if not self.records:
            return self.ended_early(
                outcome,
                "Stopped before the first prompt finished; nothing was measured.",
                "Left the line; nothing was measured.",
            )
        partial = self._partial() | {"items": self.records, "config": self.cfg.to_dict()}
        if outcome.kind == "failed":
            text, kind = f"Failed after {len(self.records)} prompts: {outcome.message}", "error"
        else:
            text, kind = (
                f"Stopped after {len(self.records)} of {len(self.instances)} prompts; the heatmaps and "
                "tests cover those.",
                "stopped",
            )
        return (
            self.idle()
            | self.say(text, kind)
            | to_components(
                self.outputs, result_view(partial, self.strategy, " (stopped)") | {"result": partial}
            )
        )


class RecallSection:
    def __init__(self, pool: ModelPool, runner: ModelRunner):
        self.pool, self.runner = pool, runner

    def prepare(self, values: dict) -> RecallWork:
        """Long-context key-fact recall on a small grid: the baseline and the strategy, one run per prompt."""
        lm = self.pool.get()
        rows = rows_for(*chosen(values), lm.num_layers)
        lengths, depths = check_recall_grid(values["lengths"], values["depths"])
        cfg = RecallConfig(
            items=RECALL_ITEMS.check(values["items"]),
            lengths=lengths,
            depths=depths,
            seed=SMALL_SEED.check(values["seed"]),
            max_new_tokens=RECALL_NEW_TOKENS.check(values["max_new_tokens"]),
        )
        instances = plan(lm, cfg)  # a length beyond the model's context is refused here, naming the lengths
        check_budget(self.runner.budget, instances, rows, cfg.max_new_tokens)
        return RecallWork(self, lm, cfg, rows, instances)

    def stop_run(self, request: gr.Request = None) -> str:
        return self.runner.stop(TAB, request)

    def build(self, num_layers: int) -> None:
        """The section (an accordion), inside the current tab."""
        with gr.Accordion("Recall: long-context key facts", open=False, elem_id="recall"):
            gr.Markdown(
                "Does the model find a fact it was given far back in a long text? Synthetic facts (a "
                "number, a name, a date, a two-hop fact, in turn) are put at each depth of distractor text "
                "(the built-in corpus) of each length; the question comes after the text. A reply is right "
                "when it names exactly the fact's value. Each prompt is one run of the baseline and the "
                f"strategy below, greedy; at most {RECALL_ITEMS.hi} items and {SERVED_RECALL_MAX_VALUES} "
                f"lengths (≤ {SERVED_RECALL_MAX_LENGTH:,} tokens) and depths here "
                "(`python -m feedback recall` takes more). "
                "McNemar's exact test compares the facts recalled; a paired bootstrap the gold answer's "
                "log-probability after the question."
            )
            with gr.Row(equal_height=False):
                with gr.Column(min_width=280):
                    self.panel = build_strategy_panel(num_layers, "deep_cache", prefix="recall")
                with gr.Column(min_width=280):
                    lengths = gr.Textbox(
                        "256, 1024",
                        label="lengths",
                        max_length=RECALL_GRID_CHARS,
                        info="tokens of text, comma-separated",
                        elem_id="recall-lengths",
                    )
                    depths = gr.Textbox(
                        "0, 50, 100",
                        label="depths",
                        max_length=RECALL_GRID_CHARS,
                        info="% of the text before the fact, comma-separated",
                        elem_id="recall-depths",
                    )
                    items = bound_number(
                        RECALL_ITEMS, 2, info=f"facts per cell ({RECALL_ITEMS.info})", elem_id="recall-items"
                    )
                    max_new = bound_number(RECALL_NEW_TOKENS, 16, elem_id="recall-max-new")
                    seed = bound_number(
                        SMALL_SEED,
                        0,
                        info="the same seed gives the same facts and texts",
                        elem_id="recall-seed",
                    )
            self.run, self.stop, self.status = run_controls("recall", "Run recall grid")
            self.summary = gr.Markdown(elem_id="recall-summary")
            gr.HTML(f'<div class="fl-note">{GAIN_LEGEND}</div>')
            with gr.Row(equal_height=False):
                self.baseline_plot = gr.Plot(show_label=False, elem_id="recall-baseline-plot")
                self.strategy_plot = gr.Plot(show_label=False, elem_id="recall-strategy-plot")
            self.difference_plot = gr.Plot(show_label=False, elem_id="recall-difference-plot")
            with gr.Accordion("Recall result (JSON)", open=False):
                self.result = gr.JSON()
            stop_ack = gr.Textbox(visible=False)
            cancel_trigger = gr.Button(visible=False)  # for program clients' Job.cancel()
        # What the work shows, by name, in the order API clients get it.
        self.outputs = {
            "summary": self.summary,
            "baseline_plot": self.baseline_plot,
            "strategy_plot": self.strategy_plot,
            "difference_plot": self.difference_plot,
            "result": self.result,
        }
        # In the order positional API clients pass them.
        inputs = {
            "strategy": self.panel.strategy,
            "lengths": lengths,
            "depths": depths,
            "items": items,
            "max_new_tokens": max_new,
            "seed": seed,
            **self.panel.named_inputs(),
        }
        handler = self.runner.wrap(TAB, self.prepare, list(inputs), status=self.status)
        running = self.run.click(
            handler,
            inputs_kwargs=inputs,
            outputs=[*self.outputs.values(), self.status, self.run, self.stop],
            api_name="recall",
            concurrency_limit=None,
            show_progress="hidden",
        )
        self.stop.click(
            self.stop_run,
            None,
            stop_ack,
            api_name="stop_recall",
            concurrency_limit=None,
            show_progress="hidden",
        )
        cancellable_by_clients(cancel_trigger, running)
