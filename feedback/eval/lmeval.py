"""lm-evaluation-harness backend: the baseline or any feedback strategy as an lm-eval model.

`FeedbackLM` is an lm-eval 0.4 `LM` (a `TemplateLM`: lm-eval's own context/continuation
tokenisation) registered as `feedback-lens` when this module is imported. It runs on the
project's own code, never a second model path:

- `loglikelihood` (multiple choice, cloze): the baseline scores requests in batches of rows, left
  padded, one forward per batch on the hooked forward; a strategy scores each request with the
  perplexity code's modes (`parallel`, `jacobi` with P passes, `exact` token by token, as
  `feedback.core.forward.window_nll_*` run them) on a sequence of its own.
- `loglikelihood_rolling` (wikitext-style perplexity): the prefix token (BOS, else EOS, as lm-eval's
  HF backend) then the text's tokens, every one scored (unlike `ppl`, which leaves a document's first
  token unscored), in the perplexity code's windows (`perplexity.windows`; by default window
  max_length + 1 and stride max_length, lm-eval's HF windows) with `window_nll_chunked` (baseline) or
  `window_nll_parallel`/`window_nll_exact` (strategy): the numbers `perplexity.token_nlls` gives on
  those tokens. Sequences longer than max_length + 1 tokens keep their last ones, as lm-eval's.
- `generate_until`: the engine (`start_run`, as `run_to_end` runs it), every request a row with its
  own prompt (no chat template: lm-eval formats the prompt), greedy unless the task samples; a row
  stops at EOS, `max_gen_toks`, or once its text holds an `until` string, and is cut there.

`lm_eval --model feedback-lens` needs this module imported: lm-eval 0.4.13 fills its model registry
from its own table and from imports, with no entry point for third-party models. So run its CLI
through `python -m feedback.eval.lmeval` (the same arguments), or import this module before
`lm_eval.simple_evaluate(model="feedback-lens", ...)`. The installed package also declares the
`lm_eval.models` entry point `feedback-lens` (pyproject.toml), for the lm-eval releases that discover
plugins by it (EleutherAI/lm-evaluation-harness PR #4013, after 0.4.13). Model arguments:
`pretrained` (or `model`; default embedded), `dtype`, `device`, `strategy`, `param_<NAME>=VALUE` per
strategy parameter, `mode`, `passes`, `max_length` (2048), `window`, `stride`, `chunk`, `batch_size`,
`max_gen_toks`, `seed`.

`run_pair` runs `lm_eval.simple_evaluate` for the baseline and the strategy on the same documents
and `compare` pairs their per-document results: per metric the two values, the difference, and a
95% interval (an exact conditional interval and McNemar's exact test on the discordant documents for
0/1 metrics such as acc; a paired bootstrap over documents of the task's own aggregation otherwise).
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import model_registry
from tqdm import tqdm

from feedback.core.engine import start_run
from feedback.core.forward import (
    hooked_forward,
    window_logits_exact,
    window_logits_parallel,
    window_nll_chunked,
    window_nll_exact,
    window_nll_parallel,
)
from feedback.core.model import LoadedModel, load_model
from feedback.core.records import MAX_ROWS, RowSpec, RunConfig, answer_text
from feedback.core.sampling import SamplingConfig
from feedback.errors import FeedbackError
from feedback.eval.perplexity import PPLConfig, windows
from feedback.strategies import BatchView, Phase, PromptStrategy, build_strategy, get_strategy

NAME = "feedback-lens"
PARAM_PREFIX = (
    "param_"  # model_args: param_alpha=0.2 is the strategy's alpha (names such as mode, window clash)
)
DEFAULT_MAX_LENGTH = 2048  # lm-eval's HF default max_length (capped by the model's context)
DEFAULT_BATCH = 8
BATCH_TOKENS = (
    8192  # padded tokens per batched baseline forward at most (one long sequence alone may pass it)
)
DEFAULT_GEN_TOKS = 256  # lm-eval's default max_gen_toks


class FeedbackLM(TemplateLM):
    """The baseline (no `strategy`) or a feedback strategy as an lm-eval model (see the module)."""

    def __init__(
        self,
        pretrained: str | None = None,
        model: str | None = None,
        strategy: str | None = None,
        params: dict | None = None,
        mode: str | None = None,
        passes: int = 3,
        max_length: int | None = None,
        window: int | None = None,
        stride: int | None = None,
        chunk: int = 512,
        batch_size: int | str | None = None,
        max_batch_size: int | None = None,
        device: str | None = None,
        dtype: str = "auto",
        max_gen_toks: int = DEFAULT_GEN_TOKS,
        seed: int = 0,
        prefix_token_id: int | None = None,
        trust_remote_code: bool = False,
        lm: LoadedModel | None = None,
        **extra: Any,
    ):
        super().__init__()
        params = dict(params or {})
        for key, value in extra.items():
            if not key.startswith(PARAM_PREFIX):
                raise FeedbackError(
                    f"{NAME}: unknown model argument {key!r}; a strategy parameter is given as "
                    f"{PARAM_PREFIX}{key}=VALUE"
                )
            params[key[len(PARAM_PREFIX) :]] = value
        if params and not strategy:
            raise FeedbackError(f"{NAME}: strategy parameters need a strategy")
        if strategy:
            get_strategy(strategy)  # an unknown name is refused before the model loads
        if lm is None:
            if device and device.startswith("cuda") and not torch.cuda.is_available():
                # lm-eval's command line asks for cuda unless told otherwise; its HF backend falls back too
                print(f"warning: {NAME}: device {device!r} is not available, using the CPU", file=sys.stderr)
                device = "cpu"
            lm = load_model(
                pretrained or model or "embedded",
                dtype=dtype,
                device=device or "auto",
                trust_remote_code=trust_remote_code,
            )
        self.lm = lm
        self.strategy, self.seed = strategy or None, int(seed)
        self.params = build_strategy(strategy, params, lm.num_layers).values if strategy else {}
        self.prompt_level = bool(strategy) and issubclass(get_strategy(strategy), PromptStrategy)
        # lm-eval's HF backend: a sequence of at most max_length + 1 tokens (max_length fed), rolling
        # windows predicting max_length tokens each after 1 of context: our window max_length + 1,
        # stride max_length. A smaller stride gives later windows more context (other numbers).
        self._max_length = min(int(max_length or DEFAULT_MAX_LENGTH), lm.context_length)
        window = min(int(window) if window else self._max_length + 1, lm.context_length)
        self.cfg = PPLConfig(
            strategy=strategy,
            params=self.params,
            mode=mode,
            passes=int(passes),
            window=window,
            stride=int(stride) if stride else max(1, window - 1),
            chunk=int(chunk),
            bootstrap=0,
        )
        # A prompt-level strategy changes the prompt, not the model: it generates, it does not score.
        self.mode = (
            None if self.prompt_level else self.cfg.validate(lm.context_length, lm.num_layers).resolved_mode()
        )
        self.batch_size = (
            DEFAULT_BATCH
            if batch_size in (None, "auto") or str(batch_size).startswith("auto")
            else int(batch_size)
        )
        if not 1 <= self.batch_size <= MAX_ROWS:
            raise FeedbackError(f"{NAME}: batch_size must be in [1, {MAX_ROWS}], got {self.batch_size}")
        self.max_gen_toks = int(max_gen_toks)
        self._prefix = prefix_token_id

    # ---- what lm-eval asks of a TemplateLM ----
    @property
    def tokenizer(self):
        return self.lm.tokenizer

    @property
    def eot_token_id(self) -> int:
        eos = self.lm.tokenizer.eos_token_id
        return int(eos if eos is not None else self.lm.eos_token_ids[0])

    @property
    def prefix_token_id(self) -> int:
        """What an empty context and a rolling text start from: BOS, else EOS (lm-eval's HF backend)."""
        if self._prefix is not None:
            return int(self._prefix)
        bos = self.lm.tokenizer.bos_token_id
        return int(bos) if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def device(self):
        return self.lm.device

    @property
    def tokenizer_name(self) -> str:
        return self.lm.name.replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return getattr(self.lm.tokenizer, "chat_template", None) if chat_template else None

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        return self.lm.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return list(self.lm.tokenizer(string, add_special_tokens=bool(add_special_tokens))["input_ids"])

    def describe(self) -> dict:
        """What this side is, for reports."""
        return {
            "model": self.lm.name,
            "dtype": self.lm.dtype,
            "precision": self.lm.precision,
            "strategy": self.strategy,
            "params": self.params,
            "mode": self.mode,
            "passes": self.cfg.passes if self.mode == "jacobi" else None,
            "max_length": self._max_length,
            "window": self.cfg.window,
            "stride": self.cfg.stride,
            "batch_size": self.batch_size,
        }

    def _scoring(self) -> None:
        if self.prompt_level:
            raise FeedbackError(
                f"{self.strategy} is a prompt-level strategy: it changes the prompt, not the model, "
                "so it has no log-likelihood to give; use it on generate_until tasks"
            )

    # ---- loglikelihood ----
    def _loglikelihood_tokens(
        self, requests, disable_tqdm: bool = False, **kwargs
    ) -> list[tuple[float, bool]]:
        self._scoring()
        out: list[tuple[float, bool] | None] = [None] * len(requests)
        seqs = []
        for i, (_, ctx, cont) in enumerate(requests):
            if not cont:
                raise FeedbackError(f"{NAME}: a loglikelihood request has an empty continuation")
            seq = (ctx + cont)[
                -min(self._max_length + 1, self.lm.context_length) :
            ]  # as lm-eval's HF backend
            seqs.append((i, seq, min(len(cont), len(seq) - 1)))
        # Longest first: a batch holds sequences of like length (little padding), the slow ones go first.
        seqs.sort(key=lambda item: -len(item[1]))
        bar = tqdm(total=len(seqs), desc=f"{NAME} loglikelihood", disable=disable_tqdm)
        done: dict[tuple, tuple[float, bool]] = {}  # identical sequences are scored once
        if self.strategy is None:
            todo = []
            for _, seq, n in seqs:
                if (tuple(seq), n) not in done:
                    done[(tuple(seq), n)] = None
                    todo.append((seq, n))
            for part in _batches(todo, self.batch_size):
                for (seq, n), answer in zip(part, baseline_scores(self.lm, part)):
                    done[(tuple(seq), n)] = answer
                bar.update(len(part))
        else:
            for _, seq, n in seqs:
                key = (tuple(seq), n)
                if key not in done:
                    done[key] = strategy_score(
                        self.lm,
                        seq,
                        n,
                        build_strategy(self.strategy, self.params, self.lm.num_layers),
                        self.mode,
                        self.cfg.passes,
                    )
                bar.update(1)
        bar.close()
        for i, seq, n in seqs:
            out[i] = done[(tuple(seq), n)]
            self.cache_hook.add_partial("loglikelihood", requests[i][0], out[i])
        return out

    # ---- loglikelihood_rolling ----
    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        self._scoring()
        out = []
        for request in tqdm(requests, desc=f"{NAME} rolling", disable=disable_tqdm):
            (text,) = request.args
            ids = [self.prefix_token_id] + self.tok_encode(text)
            out.append(-float(self.rolling_nlls(ids).sum()))
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), out[-1])
        return out

    def rolling_nlls(self, ids: list[int]) -> np.ndarray:
        """Per-token NLL of ids[1:] in the perplexity code's windows: what `perplexity.token_nlls`
        gives for this side (its baseline NLLs, or its feedback NLLs), without scoring the other."""
        ids_t = torch.tensor(ids, device=self.lm.device)
        parts = []
        for start, end, scored in windows(len(ids), self.cfg.window, self.cfg.stride):
            w, keep = ids_t[start:end], slice(scored - start - 1, None)
            if self.strategy is None:
                parts.append(window_nll_chunked(self.lm, w, self.cfg.chunk)[keep])
                continue
            strategy = build_strategy(self.strategy, self.params, self.lm.num_layers)
            if self.mode == "exact":
                parts.append(window_nll_exact(self.lm, w, strategy)[keep])
            else:
                parts.append(
                    window_nll_parallel(
                        self.lm, w, strategy, self.cfg.passes if self.mode == "jacobi" else 1
                    )[keep]
                )
        return torch.cat(parts).double().cpu().numpy()

    # ---- generate_until ----
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out: list[str | None] = [None] * len(requests)
        groups: dict[tuple, list[int]] = {}
        settings = []
        for i, request in enumerate(requests):
            context, gen_kwargs = request.args
            settings.append(self._gen_settings(gen_kwargs))
            groups.setdefault(settings[-1], []).append(i)
        bar = tqdm(total=len(requests), desc=f"{NAME} generate_until", disable=disable_tqdm)
        for (until, max_new, temperature), members in groups.items():
            for start in range(0, len(members), self.batch_size):
                part = members[start : start + self.batch_size]
                texts = self.generate([requests[i].args[0] for i in part], list(until), max_new, temperature)
                for i, text in zip(part, texts):
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                bar.update(len(part))
        bar.close()
        return out

    def _gen_settings(self, gen_kwargs: dict) -> tuple[tuple[str, ...], int, float]:
        kwargs = dict(gen_kwargs or {})
        until = kwargs.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        eos = self.lm.tokenizer.decode([self.eot_token_id])
        if eos and eos not in until:
            until.append(eos)
        max_new = int(kwargs.get("max_gen_toks") or kwargs.get("max_new_tokens") or self.max_gen_toks)
        # as lm-eval's HF backend: greedy unless the task asks to sample (then temperature, default 1)
        temperature = float(kwargs.get("temperature", 1.0) or 0.0) if kwargs.get("do_sample") else 0.0
        return tuple(u for u in until if u), max_new, temperature

    def generate(
        self, contexts: list[str], until: list[str], max_new_tokens: int, temperature: float = 0.0
    ) -> list[str]:
        """One engine run, each context a row (this side's strategy on every row): each reply cut
        before the first `until` string. A row stops once its text holds one (it is asked to stop
        at its next step) and at EOS or `max_new_tokens` as any run's rows do."""
        lm = self.lm
        limit = self._max_length - max_new_tokens  # lm-eval's HF backend: prompt and reply within max_length
        if limit < 1:
            raise FeedbackError(
                f"max_gen_toks={max_new_tokens} leaves no room for a prompt within max_length "
                f"{self._max_length}"
            )
        prompts = []
        for context in contexts:
            ids = lm.encode(context, chat_template=False)
            # too long: the prompt's last tokens, as lm-eval's HF backend left-truncates
            prompts.append(context if len(ids) <= limit else lm.tokenizer.decode(ids[-limit:]))
        rows = [RowSpec(f"r{k}", self.strategy, dict(self.params), prompt=p) for k, p in enumerate(prompts)]
        config = RunConfig(
            prompt="",
            model=lm.name,
            chat_template=False,
            max_new_tokens=max_new_tokens,
            seed=self.seed,
            sampling=SamplingConfig(temperature=temperature),
            rows=rows,
        ).validate()
        run = start_run(lm, config)
        texts = [""] * len(rows)
        for event in run:
            if self.prompt_level:
                continue  # its restatement comes first: cut after the run, on the answer
            for index, record in event.records.items():
                texts[index] += record.text
                if index not in event.finished and any(u in texts[index] for u in until):
                    run.stop_row(index)
        return [cut(self._reply(row), until) for row in run.result.rows]

    def _reply(self, row) -> str:
        """A row's reply as lm-eval reads it: all of it, or for a prompt-level strategy its answer
        (`answer_text` less the forced transition marker), leading whitespace removed."""
        if not self.prompt_level:
            return row.text
        return (
            "".join(s.text for s in row.steps if s.part not in ("restate", "transition")).lstrip()
            if any(s.part for s in row.steps)
            else answer_text(row)
        )


def _batches(todo: list[tuple[list[int], int]], rows: int) -> list[list[tuple[list[int], int]]]:
    """Consecutive batches of at most `rows` sequences (longest first) and BATCH_TOKENS padded
    tokens: a batch of long sequences holds fewer rows, so its attention scores stay bounded."""
    out, part = [], []
    for item in todo:
        width = max([len(item[0])] + [len(seq) for seq, _ in part])
        if part and (len(part) >= rows or (len(part) + 1) * width > BATCH_TOKENS):
            out.append(part)
            part = []
        part.append(item)
    return out + ([part] if part else [])


def cut(text: str, until: list[str]) -> str:
    """`text` before the first occurrence of any `until` string (lm-eval's HF backend's rule)."""
    for term in until:
        if term:
            text = text.split(term)[0]
    return text


# ---- scoring: the baseline in batches of rows, a strategy in the perplexity code's modes ----
def baseline_scores(lm: LoadedModel, part: list[tuple[list[int], int]]) -> list[tuple[float, bool]]:
    """(log-likelihood, greedy) of the last n tokens of each sequence, given the tokens before them,
    under the plain model: the sequences (all but each one's last token) left-padded into one batch
    with an attention mask and each row's own positions, as the engine's prefill batches prompts,
    one forward on the hooked forward keeping the logits of the scored positions only."""
    inputs = [seq[:-1] for seq, _ in part]
    keep = max(n for _, n in part)
    lengths = [len(x) for x in inputs]
    width = max(lengths)
    pad = lm.tokenizer.pad_token_id if lm.tokenizer.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(x)) + x for x in inputs], device=lm.device)
    call: dict = dict(input_ids=ids, use_cache=False, logits_to_keep=keep)
    if len(set(lengths)) > 1:
        mask = torch.tensor([[0] * (width - n) + [1] * n for n in lengths], device=lm.device)
        call |= dict(attention_mask=mask, position_ids=(mask.cumsum(dim=1) - 1).clamp_min(0))
    with torch.inference_mode():
        logits = hooked_forward(lm, BatchView(Phase.SEQUENCE, []), [], **call).logits
        out = []
        for row, (seq, n) in enumerate(part):
            out.append(_score(logits[row, keep - n :], torch.tensor(seq[-n:], device=lm.device)))
    return out


def strategy_score(
    lm: LoadedModel, seq: list[int], n: int, strategy, mode: str, passes: int
) -> tuple[float, bool]:
    """(log-likelihood, greedy) of the last n tokens of `seq` with the strategy on, scored as the
    perplexity code scores a window in `mode` (`window_nll_parallel` with 1 or `passes` passes,
    `window_nll_exact` token by token), keeping the logits so greediness can be read too."""
    ids = torch.tensor(seq, device=lm.device)
    if mode == "exact":
        logits = window_logits_exact(lm, ids, strategy)
    else:
        logits = window_logits_parallel(lm, ids, strategy, passes if mode == "jacobi" else 1)
    return _score(logits[-n:], ids[-n:])


def _score(logits: torch.Tensor, targets: torch.Tensor) -> tuple[float, bool]:
    logp = torch.log_softmax(logits.float(), dim=-1)
    ll = float(logp.gather(1, targets[:, None]).double().sum())
    return ll, bool((logp.argmax(dim=-1) == targets).all())


# ---- baseline vs strategy on the same tasks ----
def task_manager(tasks: list[str], include_path: str | None = None):
    """lm-eval's TaskManager: the include path alone when it holds every task asked for (indexing
    lm-eval's own thousands of tasks takes seconds), else with lm-eval's own tasks too. Unknown
    names are refused here, in one line."""
    from lm_eval.tasks import TaskManager

    if include_path:
        local = TaskManager(include_path=include_path, include_defaults=False)
        if set(tasks) <= set(local.all_tasks):
            return local
    manager = TaskManager(include_path=include_path) if include_path else TaskManager()
    unknown = [t for t in tasks if t not in set(manager.all_tasks)]
    if unknown:
        raise FeedbackError(
            f"unknown lm-eval task(s) {', '.join(unknown)}"
            + ("" if include_path else " (a task of your own: give --include-path DIR)")
        )
    return manager


def run_pair(
    lm: LoadedModel,
    tasks: list[str],
    strategy: str,
    params: dict | None = None,
    *,
    mode: str | None = None,
    passes: int = 3,
    max_length: int | None = None,
    window: int | None = None,
    stride: int | None = None,
    include_path: str | None = None,
    limit: int | float | None = None,
    num_fewshot: int | None = None,
    batch_size: int | None = None,
    max_gen_toks: int = DEFAULT_GEN_TOKS,
    bootstrap: int = 2000,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
) -> dict:
    """`lm_eval.simple_evaluate` for the baseline, then for `strategy`, on the same documents of
    `tasks` (per-document results logged), and their paired comparison (`compare`)."""
    from lm_eval import simple_evaluate

    if not tasks:
        raise FeedbackError("give at least one task")
    common = dict(
        max_length=max_length,
        window=window,
        stride=stride,
        batch_size=batch_size,
        max_gen_toks=max_gen_toks,
        seed=seed,
        lm=lm,
    )
    sides = {
        "baseline": FeedbackLM(**common),
        "feedback": FeedbackLM(strategy=strategy, params=params, mode=mode, passes=passes, **common),
    }
    manager = task_manager(tasks, include_path)
    started, results = time.perf_counter(), {}
    with _light_env_info():
        for name, side in sides.items():
            if log:
                log(f"{name}: {', '.join(tasks)}")
            results[name] = simple_evaluate(
                model=side,
                tasks=list(tasks),
                task_manager=manager,
                limit=limit,
                num_fewshot=num_fewshot,
                log_samples=True,
                bootstrap_iters=0,
                verbosity="ERROR",
                random_seed=seed,
            )
    return {
        "tasks": list(tasks),
        "baseline_side": sides["baseline"].describe(),
        "feedback_side": sides["feedback"].describe(),
        "limit": limit,
        "num_fewshot": num_fewshot,
        "comparison": compare(results["baseline"], results["feedback"], bootstrap, seed),
        "baseline": _plain(results["baseline"]["results"]),
        "feedback": _plain(results["feedback"]["results"]),
        "n_samples": _plain(results["baseline"].get("n-samples", {})),
        "wall_seconds": time.perf_counter() - started,
    }


@contextlib.contextmanager
def _light_env_info():
    """simple_evaluate ends by collecting torch's environment report (`pip list`, `nvidia-smi` and
    more in subprocesses: about a second a call); the comparison reports none of it, so while it
    runs the report holds only the versions."""
    from lm_eval import evaluator

    full = getattr(evaluator, "add_env_info", None)

    def versions(storage: dict) -> None:
        from importlib.metadata import version

        import transformers

        storage.update(
            {"lm_eval_version": version("lm_eval"), "transformers_version": transformers.__version__}
        )

    if full is not None:
        evaluator.add_env_info = versions
    try:
        yield
    finally:
        if full is not None:
            evaluator.add_env_info = full


def _plain(value):
    """JSON-safe: NaN and infinities as None, numpy numbers as Python ones."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (np.floating, np.integer)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _aggregation(result: dict, task: str, metric: str):
    """The aggregation lm-eval used for `metric` of `task`: its config's, else the metric's default."""
    from lm_eval.api.registry import get_aggregation, get_metric_aggregation

    for entry in (result.get("configs", {}).get(task, {}) or {}).get("metric_list") or []:
        if entry.get("metric") == metric and entry.get("aggregation"):
            agg = entry["aggregation"]
            return agg if callable(agg) else get_aggregation(agg)
    try:
        return get_metric_aggregation(metric)
    except (KeyError, ValueError):
        return None


def _binom_cdf(k: int, n: int, p: float) -> float:
    """P(X <= k) for X ~ Binomial(n, p)."""
    if k < 0:
        return 0.0
    if k >= n:
        return 1.0
    if p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 0.0
    lp, lq = math.log(p), math.log1p(-p)
    terms = [
        math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * lp + (n - i) * lq
        for i in range(k + 1)
    ]
    top = max(terms)
    return min(1.0, math.exp(top) * sum(math.exp(t - top) for t in terms))


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value: b and c documents changed one way and the other."""
    m = b + c
    return 1.0 if m == 0 else min(1.0, 2.0 * _binom_cdf(min(b, c), m, 0.5))


def clopper_pearson(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """Exact (Clopper-Pearson) interval of a binomial proportion, k successes of n."""
    alpha = (1.0 - level) / 2.0

    def solve(f, target: float) -> float:  # f increasing in p on [0, 1]
        lo, hi = 0.0, 1.0
        for _ in range(60):
            mid = (lo + hi) / 2.0
            lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
        return (lo + hi) / 2.0

    lower = 0.0 if k == 0 else solve(lambda p: 1.0 - _binom_cdf(k - 1, n, p), alpha)  # P(X >= k) = alpha
    upper = 1.0 if k == n else solve(lambda p: 1.0 - _binom_cdf(k, n, p), 1.0 - alpha)  # P(X <= k) = alpha
    return lower, upper


def _binary(values: list) -> bool:
    return all(isinstance(v, (bool, int, float, np.number)) and float(v) in (0.0, 1.0) for v in values)


def _resampled(base: list, fb: list, agg, resamples: int, rng: np.random.Generator) -> np.ndarray | None:
    """Differences (feedback - baseline) of the aggregate over paired resamples of the documents;
    vectorised for lm-eval's mean, perplexity, weighted perplexity and bits per byte."""
    from lm_eval.api import metrics as m

    n = len(base)
    vectorised = {
        m.mean: "mean",
        m.perplexity: "perplexity",
        m.weighted_perplexity: "weighted_perplexity",
        m.bits_per_byte: "bits_per_byte",
    }.get(agg)
    out = []
    step = max(1, 4_000_000 // max(n, 1))  # resamples per block: the index matrix stays small
    for start in range(0, resamples, step):
        pick = rng.integers(0, n, size=(min(step, resamples - start), n))
        if vectorised in ("mean", "perplexity"):
            b, f = (np.asarray(v, dtype=float)[pick].mean(axis=1) for v in (base, fb))
            if vectorised == "perplexity":
                b, f = np.exp(-b), np.exp(-f)
        elif vectorised in ("weighted_perplexity", "bits_per_byte"):

            def agg_of(values, pick=pick):
                arr = np.asarray(values, dtype=float)
                mean = arr[:, 0][pick].sum(axis=1) / arr[:, 1][pick].sum(axis=1)
                return np.exp(-mean) if vectorised == "weighted_perplexity" else -mean / math.log(2)

            b, f = agg_of(base), agg_of(fb)
        else:
            b = np.array([agg([base[i] for i in row]) for row in pick], dtype=float)
            f = np.array([agg([fb[i] for i in row]) for row in pick], dtype=float)
        out.append(f - b)
    return np.concatenate(out) if out else None


def compare(base: dict, fb: dict, resamples: int = 2000, seed: int = 0) -> list[dict]:
    """Per task, filter and metric: the baseline's and the feedback's value (as lm-eval aggregated
    them), the difference and a paired 95% interval from the per-document results of both runs
    (`log_samples`), documents matched by id. 0/1 metrics (acc, acc_norm, exact_match): McNemar's
    exact test on the discordant documents and the exact conditional interval of the difference
    (Clopper-Pearson on b / (b + c), scaled by (b + c) / n). Others: a paired bootstrap over
    documents of the task's own aggregation (`resamples`; 0: none)."""
    rows = []
    rng = np.random.default_rng(seed)
    for task, samples in (base.get("samples") or {}).items():
        other = (fb.get("samples") or {}).get(task)
        if not other:
            continue
        for key, value in (base["results"].get(task) or {}).items():
            if "," not in key or "_stderr" in key:
                continue
            metric, filt = key.split(",", 1)
            b_docs = {s["doc_id"]: s[metric] for s in samples if s.get("filter") == filt and metric in s}
            f_docs = {s["doc_id"]: s[metric] for s in other if s.get("filter") == filt and metric in s}
            ids = sorted(set(b_docs) & set(f_docs))
            f_value = (fb["results"].get(task) or {}).get(key)
            if not ids or not isinstance(value, (int, float)) or not isinstance(f_value, (int, float)):
                continue
            b_vals, f_vals = [b_docs[i] for i in ids], [f_docs[i] for i in ids]
            higher = (base.get("higher_is_better", {}).get(task) or {}).get(metric)
            row = {
                "task": task,
                "metric": metric,
                "filter": filt,
                "n": len(ids),
                "baseline": float(value),
                "feedback": float(f_value),
                "delta": float(f_value) - float(value),
                "higher_is_better": higher,
                "ci95": None,
                "p_value": None,
                "method": "none",
            }
            if len(ids) != len(b_docs) or len(ids) != len(f_docs):
                row["note"] = "the two runs scored different documents: only those in both are paired"
            agg = _aggregation(base, task, metric)
            from lm_eval.api import metrics as m

            if agg is m.mean and _binary(b_vals) and _binary(f_vals):
                gained = sum(1 for x, y in zip(b_vals, f_vals) if float(y) > float(x))
                lost = sum(1 for x, y in zip(b_vals, f_vals) if float(y) < float(x))
                lo, hi = clopper_pearson(gained, gained + lost) if gained + lost else (0.5, 0.5)
                scale = (gained + lost) / len(ids)
                row |= {
                    "ci95": [scale * (2 * lo - 1), scale * (2 * hi - 1)],
                    "p_value": mcnemar_exact(gained, lost),
                    "gained": gained,
                    "lost": lost,
                    "method": f"exact McNemar on {gained + lost} discordant of {len(ids)} documents",
                }
            elif agg is not None and resamples > 0 and len(ids) >= 2:
                try:
                    diffs = _resampled(b_vals, f_vals, agg, resamples, rng)
                except (TypeError, ValueError, ZeroDivisionError, IndexError):
                    diffs = None
                if diffs is not None and np.isfinite(diffs).any():
                    lo, hi = np.nanpercentile(diffs, [2.5, 97.5])
                    row |= {
                        "ci95": [float(lo), float(hi)],
                        "method": f"paired bootstrap over {len(ids)} documents ({resamples} resamples)",
                    }
            rows.append(row)
    return _plain(rows)


def _number(x: float | None) -> str:
    if x is None:
        return "n/a"
    return f"{x:.2f}" if abs(x) >= 100 else f"{x:.4f}"


def format_table(rows: list[dict]) -> str:
    """The comparison as an aligned text table, a line per task and metric."""
    head = ["task", "metric", "n", "baseline", "feedback", "delta", "95% CI", "p", "interval"]
    lines = []
    for r in rows:
        ci = "n/a" if r["ci95"] is None else f"[{_signed(r['ci95'][0])}, {_signed(r['ci95'][1])}]"
        better = {True: " (higher better)", False: " (lower better)"}.get(r.get("higher_is_better"), "")
        metric = r["metric"] + (f" [{r['filter']}]" if r["filter"] != "none" else "")
        lines.append(
            [
                r["task"],
                metric + better,
                str(r["n"]),
                _number(r["baseline"]),
                _number(r["feedback"]),
                _signed(r["delta"]),
                ci,
                "" if r["p_value"] is None else f"{r['p_value']:.3g}",
                r["method"],
            ]
        )
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(head)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in [head, *lines])


def _signed(x: float) -> str:
    return ("+" if x >= 0 else "") + _number(x)


def _register() -> None:
    # `in`, not `get`: an entry point already registered under the name (lm-eval's plugin discovery)
    # stays a lazy placeholder that loads this class, instead of being loaded from inside its own import
    if NAME not in model_registry:
        model_registry.register(NAME, target=FeedbackLM)


def main() -> None:
    """`python -m feedback.eval.lmeval ARGS`: lm-eval's own command line (`lm_eval ARGS`) with
    `--model feedback-lens` available."""
    from lm_eval.__main__ import cli_evaluate

    import feedback.eval.lmeval  # noqa: F401  (registers the model under its module's name)

    cli_evaluate()


if __name__ == "__main__":
    sys.exit(main())
else:
    _register()
