"""Every strategy, and a stack, on every architecture family of `tests/tiny_families.py`, loaded as a
user loads it (`random:<folder>`): each runs; at strength 0 it is the baseline to the logit; a row
left-padded in a batch is the same row alone; its scoring is causal (a later token never changes an
earlier NLL); and the baseline itself is `generate`'s greedy decode and plain transformers'
perplexity. The prompts go through the chat template, so they are longer than the sliding windows."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from feedback.core.engine import run_with_logits, start_run
from feedback.core.model import load_model
from feedback.core.records import RowSpec, RunConfig
from feedback.core.sharing import SharedDecoder, can_share, shared_events
from feedback.eval.perplexity import PPLConfig, token_nlls
from feedback.strategies import REGISTRY, PromptStrategy, get_strategy
from tests.tiny_families import FAMILIES, write_folder

STACK = "inner_loop+deep_cache"
# label -> (strategy, settings): every strategy at its defaults, a stack, and inner_loop's other mode
CASES = {n: (n, {}) for n in [*sorted(REGISTRY), STACK]} | {
    "inner_loop:euler": ("inner_loop", {"mode": "euler"})
}
HIDDEN = [c for c, (n, _) in CASES.items() if not issubclass(get_strategy(n), PromptStrategy)]
TOKENS = 6
PROMPT = "Name three rivers of Europe."
LONG = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle, in the style of a fable."
)
TEXT = (
    "The river rises in the mountains, runs through three countries and reaches the sea after a thousand "
    "kilometres; its valley holds vineyards, castles and old towns."
)
SAME = 1e-5  # logits of the same row computed two ways (batch position, strength 0): float noise only
SHARED = 1e-4  # ... and a row re-padded as other requests' rows join and leave: more of that noise


def _row(case: str, off: bool = False) -> RowSpec:
    """The case's row; `off`: with its strength (every member's, for a stack) at 0."""
    name, params = CASES[case]
    cls = get_strategy(name)
    members = getattr(cls, "members", ())
    zero = {f"{m.name}.{m.strength_param}": 0 for m in members} if members else {cls.strength_param: 0}
    return RowSpec(f"{case}@0" if off else case, name, params | zero if off else params)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, embedded_lm, tmp_path_factory):
    folder = write_folder(request.param, embedded_lm.tokenizer, tmp_path_factory.mktemp(request.param))
    return load_model(f"random:{folder}", dtype="float32")


def _run(lm, rows: list[RowSpec]):
    """The run's result and each row's logits at every step."""
    return run_with_logits(lm, RunConfig(prompt=PROMPT, model=lm.name, max_new_tokens=TOKENS, rows=rows))


_BATCHED: dict[str, dict] = {}  # per model: the batched run, made once for every test that reads it


def _batched(lm):
    """One run of every strategy at its defaults and (hidden-state ones) at strength 0, beside the
    baseline and a row with a longer prompt, so every other row is left-padded."""
    if lm.name not in _BATCHED:
        rows = [RowSpec("long", prompt=LONG), RowSpec("baseline")]
        rows += [_row(c) for c in CASES] + [_row(c, off=True) for c in HIDDEN]
        result, logits = _run(lm, rows)
        _BATCHED[lm.name] = {r.name: (row, logits[i]) for i, (r, row) in enumerate(zip(rows, result.rows))}
    return _BATCHED[lm.name]


def _gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert len(a) == len(b)
    return max((x - y).abs().max().item() for x, y in zip(a, b))


@pytest.mark.parametrize("case", CASES)
def test_a_padded_batched_row_is_the_row_alone(family, case):
    row, logits = _batched(family)[case]
    result, alone = _run(family, [_row(case)])
    assert row.stop_reason in ("max_tokens", "eos") and row.token_ids
    assert row.token_ids == result.rows[0].token_ids
    assert _gap(logits, alone[0]) <= SAME


@pytest.mark.parametrize("case", HIDDEN)
def test_strength_zero_is_the_baseline(family, case):
    runs = _batched(family)
    (base, base_logits), (zero, zero_logits) = runs["baseline"], runs[f"{case}@0"]
    assert zero.token_ids == base.token_ids
    assert _gap(zero_logits, base_logits) <= SAME
    _, on_logits = runs[case]  # and at its defaults it acts: the strategy reaches this family's layers
    steps = min(len(on_logits), len(base_logits))
    assert _gap(on_logits[:steps], base_logits[:steps]) > SAME


@pytest.mark.parametrize("case", HIDDEN)
def test_scoring_is_causal(family, case):
    """Changing a text's last token changes no earlier token's NLL, with or without feedback."""
    ids = family.tokenizer(TEXT)["input_ids"]
    other = ids[:-1] + [(ids[-1] + 1) % family.vocab_size]
    cfg = PPLConfig(*CASES[case], bootstrap=0)
    (base, fb), (base2, fb2) = token_nlls(family, ids, cfg), token_nlls(family, other, cfg)
    assert np.abs(base[:-1] - base2[:-1]).max() <= SAME
    assert np.abs(fb[:-1] - fb2[:-1]).max() <= SAME


def _submitted(decoder, run) -> threading.Thread:
    """A reader of the run's events, started; returns once the run is in the loop's line."""
    waiting = decoder.status()["joining"]
    reader = threading.Thread(target=lambda: list(decoder.submit(run)))
    reader.start()
    while decoder.status()["joining"] == waiting and reader.is_alive():
        time.sleep(0.001)
    return reader


def test_runs_sharing_the_decode_are_each_the_run_alone(family, hook_count):
    """A run decoding while a run with a longer prompt joins it (every running row re-padded on the
    left, inner_loop's own caches too) gives each row its tokens and logits alone; a family whose
    cache cannot be stacked (sliding-window layers) runs each request alone."""
    first = [RowSpec("baseline"), _row("inner_loop")]
    second = [RowSpec("long", prompt=LONG), _row("residual"), _row(STACK)]
    configs = [
        RunConfig(prompt=PROMPT, model=family.name, max_new_tokens=TOKENS, rows=r) for r in (first, second)
    ]
    alone = [run_with_logits(family, cfg) for cfg in configs]
    seen: list[dict[int, list]] = [{}, {}]

    def keep(k):
        return lambda step, live, logits: [
            seen[k].setdefault(i, []).append(logits[p]) for p, i in enumerate(live)
        ]

    runs = [start_run(family, cfg, observer=keep(k)) for k, cfg in enumerate(configs)]
    if not can_share(family):
        for run in runs:
            list(shared_events(run))
        assert family.decoder is None
    else:
        decoder = SharedDecoder(family, threaded=False)
        readers = [_submitted(decoder, runs[0])]
        for _ in range(2):
            decoder.turn()
        readers.append(_submitted(decoder, runs[1]))
        while decoder.turn():
            pass
        for reader in readers:
            reader.join(60)
        assert [beside for _, beside in decoder.joins] == [0, 2]  # the second joined the first's rows
    for run, (result, logits), own in zip(runs, alone, seen):
        for i, (mine, theirs) in enumerate(zip(run.result.rows, result.rows, strict=True)):
            assert mine.token_ids == theirs.token_ids, mine.name
            assert _gap(own[i], logits[i]) <= SHARED, mine.name
    assert hook_count(family.model) == 0


def _plain(lm):
    """The same weights as transformers gives them (its own attention choice, no engine changes)."""
    torch.manual_seed(0)  # as `random:` seeds its weights
    folder = lm.name.removeprefix("random:")
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder)).eval()


def test_the_baseline_is_generate_and_plain_perplexity(family):
    plain = _plain(family)
    ids = family.encode(PROMPT)
    with torch.inference_mode():
        out = plain.generate(
            torch.tensor([ids]),
            max_new_tokens=TOKENS,
            do_sample=False,
            pad_token_id=family.tokenizer.eos_token_id,
        )
    base, _ = _batched(family)["baseline"]
    assert out[0, len(ids) :].tolist() == base.token_ids
    text = family.tokenizer(TEXT)["input_ids"]
    with torch.inference_mode():
        logits = plain(torch.tensor([text]), use_cache=False).logits[0, :-1].float()
    expected = torch.nn.functional.cross_entropy(logits, torch.tensor(text[1:]), reduction="none").numpy()
    nll, _ = token_nlls(family, text, PPLConfig(None, {}, bootstrap=0))
    assert np.abs(nll - expected).max() <= 1e-4
