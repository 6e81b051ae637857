"""Restatement: first restate the question's key facts, then answer with them in context.

A prompt-level strategy (the seed recipe "first restate the key facts, then answer"): it changes
what the model is asked and forces two short markers, never a hidden state. The row's newest user
message gets INSTRUCTION appended; its reply starts with OPENING (forced), the model restates the
facts until it ends the line, ends its turn or reaches `max_tokens` (the token that would do so is
replaced); then
TRANSITION is forced and the model answers on, in the same reply, with its restatement in context.
The steps carry which part they belong to ("restate", "transition"), so both phases show marked.
Scoring a text with it means scoring a reference answer after the restatement (reference PPL);
text perplexity does not apply, since the model itself is unchanged.
"""

from __future__ import annotations

from feedback.strategies.base import Param, Preset, PromptStrategy

INSTRUCTION = (
    "Before answering, restate the key facts given in the question in one or two short "
    "sentences. Then answer."
)
OPENING = "Key facts:"
TRANSITION = "\n\nAnswer:"


class RestateStrategy(PromptStrategy):
    name = "restate"
    description = (
        "prompt-level, no hidden-state change: the row restates the question's key facts, "
        "then answers with them in its context"
    )
    formula = (
        f"prompt + “{INSTRUCTION}” → reply “{OPENING} <restatement>{TRANSITION.strip()} <answer>”; "
        "the markers are forced"
    )
    strength_param = "max_tokens"  # 0: no restatement, the markers only
    # Notes: greedy, 96 tokens, on the 8 example prompts.
    presets = (
        Preset(
            "visible effect",
            {},
            "a restatement of at most 48 tokens: every example answer changes from its first token "
            "(“Key facts:”)",
        ),
        Preset(
            "markers only",
            {"max_tokens": 0},
            "no restatement, only the forced “Key facts:” and “Answer:” markers: isolates what the markers "
            "themselves do",
        ),
    )
    params = (
        Param(
            "max_tokens",
            int,
            48,
            "longest restatement, in tokens, before the answer is forced to start",
            0,
            512,
            search=(8, 128),
            log=True,
        ),
    )

    def reset(self) -> None:
        self.opening: list[int] = []
        self.transition: list[int] = []
        self.eos: set[int] = set()
        self.decode = None
        self.queue: list[int] = []  # markers still to force
        self.part = "restate"  # restate -> transition -> answer
        self.restated = 0  # restatement tokens the model chose
        self.answer_start: int | None = None  # step of the answer's first token

    def begin(self, tokenizer, eos_ids: list[int]) -> None:
        """Tokenise the markers (called by the engine once the row's tokenizer is known)."""
        encode = lambda s: list(tokenizer(s, add_special_tokens=False)["input_ids"])  # noqa: E731
        self.opening, self.transition, self.eos = encode(OPENING), encode(TRANSITION), set(eos_ids)
        self.decode = tokenizer.decode
        self.queue = list(self.opening)

    def rewrite_prompt(self, prompt: str) -> str:
        return f"{prompt.rstrip()}\n\n{INSTRUCTION}"

    def choose(self, step: int, token: int) -> tuple[int, str]:
        """The token this row takes at `step` given the sampler's `token`, and its part."""
        part = self.part
        if self.queue:  # a marker being forced
            token = self.queue.pop(0)
        elif part == "restate" and (
            token in self.eos or self.restated >= self.values["max_tokens"] or "\n" in self.decode([token])
        ):
            part, self.part = "transition", "transition"
            self.queue = list(self.transition)
            token = self.queue.pop(0)
        elif part == "restate":
            self.restated += 1
        if part == "transition" and not self.queue:
            self.part = "answer"
            self.answer_start = step + 1
        return token, part

    def report(self) -> dict:
        return {"restatement_tokens": self.restated, "answer_start": self.answer_start}

    def reference_text(self, reference: str) -> str:
        """A reference answer as it follows “Answer:” in a reply: after one space."""
        return " " + reference.lstrip()

    def context_tokens(self, token_ids: list[int]) -> list[int]:
        """The reply's tokens that come before the answer (the whole reply and the transition when
        the answer never began): what a reference answer is scored after."""
        if self.answer_start is not None:
            return token_ids[: self.answer_start]
        return token_ids + (self.transition if self.part == "restate" else self.queue)
