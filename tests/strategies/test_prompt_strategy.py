"""PromptStrategy: the base every prompt-level strategy builds on. Its defaults leave a row as a
plain row; a strategy overrides only what it changes, and the engine, the schema and perplexity's
refusal follow from the class alone (no flag to set)."""

from __future__ import annotations

import pytest

from feedback.core import quality
from feedback.core.engine import run_to_end, start_run
from feedback.core.records import RowSpec, RunConfig
from feedback.errors import FeedbackError
from feedback.eval.perplexity import PPLConfig
from feedback.strategies import REGISTRY, PromptStrategy, Strategy
from feedback.strategies.restate import RestateStrategy

PROMPT = "Tom has 3 apples and buys 4 more. How many now?"
REFERENCE = "He has 7."
ADDED = "Answer in one word."


class Unchanged(PromptStrategy):
    name = "unchanged"
    description = "prompt-level with every default"
    params = ()


class AskedDifferently(PromptStrategy):
    name = "asked_differently"
    description = "appends a sentence to the prompt, nothing else"
    params = ()

    def rewrite_prompt(self, prompt: str) -> str:
        return f"{prompt} {ADDED}"


class OneWord(PromptStrategy):
    """Every token the sampler picks is replaced by one word, marked as the part "word"."""

    name = "one_word"
    description = "always the same token"
    params = ()

    def begin(self, tokenizer, eos_ids: list[int]) -> None:
        self.word = tokenizer(" apples", add_special_tokens=False)["input_ids"][0]

    def choose(self, step: int, token: int) -> tuple[int, str | None]:
        return self.word, "word"


class LeadIn(OneWord):
    """Its first three tokens are a lead-in, and an answer follows it after one space."""

    name = "lead_in"

    def context_tokens(self, token_ids: list[int]) -> list[int]:
        return token_ids[:3]

    def reference_text(self, reference: str) -> str:
        return " " + reference


@pytest.fixture
def registered(monkeypatch):
    for cls in (Unchanged, AskedDifferently, OneWord, LeadIn):
        monkeypatch.setitem(REGISTRY, cls.name, cls)


def _run(lm, *rows: RowSpec, **kwargs):
    return run_to_end(lm, RunConfig(prompt=PROMPT, model="tiny", max_new_tokens=8, rows=list(rows), **kwargs))


def test_the_defaults_leave_a_row_as_a_plain_row(tiny_lm, registered, hook_count):
    result = _run(tiny_lm, RowSpec("plain"), RowSpec("p", "unchanged"), reference=REFERENCE)
    plain, row = result.rows
    assert row.token_ids == plain.token_ids and all(s.part is None for s in row.steps)
    # no lead-in: the reference is scored right after the prompt, by the plain model
    assert row.metrics["reference_ppl"] == pytest.approx(plain.metrics["reference_ppl"], rel=1e-6)
    assert row.metrics["reference_ppl_with_strategy"] is True
    assert hook_count(tiny_lm.model) == 0


def test_a_strategy_that_only_rewrites_the_prompt_is_that_prompt(tiny_lm, registered):
    run = start_run(
        tiny_lm,
        RunConfig(
            prompt=PROMPT,
            model="tiny",
            max_new_tokens=8,
            rows=[RowSpec("asked", "asked_differently"), RowSpec("typed", prompt=f"{PROMPT} {ADDED}")],
        ),
    )
    for _ in run:
        pass
    asked, typed = run.result.rows
    assert run.rows[0].prompt_ids == run.rows[1].prompt_ids
    assert ADDED in tiny_lm.tokenizer.decode(run.rows[0].prompt_ids)
    assert asked.token_ids == typed.token_ids


def test_choose_gives_the_tokens_and_parts_and_a_forced_token_still_wins(tiny_lm, registered):
    word = tiny_lm.tokenizer(" apples", add_special_tokens=False)["input_ids"][0]
    forced = tiny_lm.tokenizer(" pears", add_special_tokens=False)["input_ids"][0]
    result = _run(
        tiny_lm, RowSpec("plain"), RowSpec("w", "one_word"), RowSpec("wf", "one_word", prefix=[forced])
    )
    plain, row, with_prefix = result.rows
    assert row.token_ids == [word] * 8 and plain.token_ids != row.token_ids
    assert [s.part for s in row.steps] == ["word"] * 8
    assert with_prefix.token_ids == [forced] + [word] * 7 and with_prefix.steps[0].forced


def test_being_prompt_level_follows_from_the_class(registered):
    for cls in REGISTRY.values():
        assert cls.schema(4)["prompt_level"] is issubclass(cls, PromptStrategy)
    assert Unchanged.schema(4)["prompt_level"] and not Unchanged.recurrent
    assert issubclass(RestateStrategy, PromptStrategy) and issubclass(PromptStrategy, Strategy)
    assert not hasattr(Strategy, "prompt_level")  # no hand-set flag to keep in step


def test_text_perplexity_refuses_any_prompt_level_strategy(registered):
    for name in ("unchanged", "restate"):
        with pytest.raises(FeedbackError, match="prompt-level strategy"):
            PPLConfig(name, {}).resolved_mode()


def test_the_reference_follows_the_lead_in_a_strategy_declares(tiny_lm, registered):
    """`context_tokens` and `reference_text` say where and how the reference is scored."""
    run = start_run(
        tiny_lm,
        RunConfig(
            prompt=PROMPT, model="tiny", max_new_tokens=8, reference=REFERENCE, rows=[RowSpec("w", "lead_in")]
        ),
    )
    for _ in run:
        pass
    row = run.result.rows[0]
    ids = tiny_lm.tokenizer(" " + REFERENCE, add_special_tokens=False)["input_ids"]
    expected = quality.reference_ppl(tiny_lm, run.rows[0].prompt_ids + row.token_ids[:3], ids, None, {})
    assert row.metrics["reference_ppl"] == pytest.approx(expected["reference_ppl"], rel=1e-6)
