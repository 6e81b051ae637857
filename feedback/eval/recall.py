"""Long-context key-fact recall: does the model find a fact it was given, far back in a long text?

A synthetic needle-in-a-haystack set, built locally and seeded (no download):
- **Facts** of four templated kinds, item i taking kind `KINDS[i % 4]`: a number (a vault's
  five-digit access code), a name (a project's lead engineer, first and last name), a date (the day
  an observatory opened) and a two-hop fact (an object is kept in a room; the room belongs to a
  museum in a city; the question asks for the city). Each kind's values come from fixed pools,
  drawn with `random.Random(f"{seed}/{item}/fact")`.
- **Distractor text**: the built-in corpus (`corpus.builtin(split)`, CPython's language reference
  topics), its documents shuffled per item (`random.Random(f"{seed}/{item}/filler")`). An item uses
  the same fact and the same filler at every length and depth (a shorter text is a prefix of a
  longer one's filler), so the grid compares like with like.
- **Placement**: a text of `length` tokens (the document alone: filler plus the fact's sentences;
  the instruction, the question and the chat template come on top, `prompt_tokens`) with the fact
  at `depth` % of it: the filler is cut to what is left after the fact, and the fact goes in at the
  sentence boundary nearest to depth % of the filler (a word boundary when no sentence end or
  blank line lies within 3 % of the length). The document is re-tokenised and the filler recut
  until its token count is the length (the joins may merge a token or two); `tokens` and
  `depth_actual` record what was built. For a two-hop fact the sentence that holds the answer sits at
  the depth, the bridging one at (depth + 50) mod 100 %.
- **Prompt**: the document, then "Answer the question using the text above. Reply with the answer
  only." and the question, through the model's chat template.

Each instance (item × length × depth) is one batched engine run (`engine.start_run`) with every
row (the baseline and the strategies), greedy, with the gold answer as the run's reference, so
its log-probability after the question comes from the engine's one reference-scoring path
(`quality.reference_ppl`: with the row's strategy where one parallel pass scores it exactly, else
the plain model's, which `gold_scored_with_strategy` says).

Scoring is an exact match suited to the templates (`candidates`): the reply's values of the fact's
kind (numbers of four or more digits; pool names; dates; pool cities) must be exactly the gold one —
the gold value and nothing else of its kind ("Marta Okafor or Jonas Petrov" is wrong, and so is
"Okafor" alone). Per row: accuracy per length × depth, the difference grid from the baseline, and,
per strategy row against the baseline over the same instances, McNemar's exact test (a two-sided
binomial test on the discordant pairs) and a paired bootstrap of the gold answer's log-probability
(`perplexity.paired_bootstrap`, the items as its documents: with 10 or more items whole items —
every cell of one fact together — are resampled, with fewer each item's cells in moving blocks).
Instances of one fact at several lengths and depths are not independent, so McNemar's p treats them
as if they were: read it as a description of these facts, as the bootstrap's label says of fewer
than 10 items.
"""

from __future__ import annotations

import bisect
import math
import random
import re
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np

from feedback.core.bounds import Bound
from feedback.core.budget import ENV as BUDGET_ENV
from feedback.core.budget import Budget
from feedback.core.engine import start_run
from feedback.core.model import LoadedModel
from feedback.core.records import MAX_NEW_TOKENS_CAP, SEED, RowSpec, RunConfig, answer_text
from feedback.errors import FeedbackError, check_stop
from feedback.eval.corpus import builtin
from feedback.eval.perplexity import BOOTSTRAP, paired_bootstrap

KINDS = ("number", "name", "date", "two_hop")
MIN_LENGTH = 64  # tokens of text: room for a fact and some distractor text around it
ITEMS = Bound("items", 1, 1000, integer=True)
LENGTH = Bound("lengths", MIN_LENGTH, None, integer=True)  # each length; the model's context caps it
DEPTH = Bound("depths", 0, 100)  # each depth, % of the text before the fact
NEW_TOKENS = Bound("max new tokens", 1, MAX_NEW_TOKENS_CAP, integer=True)
MAX_GRID_VALUES = 64  # lengths or depths in one job
SPLITS = ("dev", "test")
SNAP_SHARE = 0.03  # a sentence boundary within 3 % of the length is used; else a word boundary
INSTRUCTION = "Answer the question using the text above. Reply with the answer only."

# ---- the fact templates and their value pools ----
VAULTS = [
    "amber",
    "basalt",
    "cedar",
    "copper",
    "ember",
    "falcon",
    "garnet",
    "harbor",
    "indigo",
    "juniper",
    "lantern",
    "marble",
    "nickel",
    "onyx",
    "pewter",
    "quartz",
    "saffron",
    "tundra",
    "velvet",
    "willow",
]
PROJECTS = [
    "Albatross",
    "Bluebell",
    "Cormorant",
    "Driftwood",
    "Evergreen",
    "Foxglove",
    "Glacier",
    "Heron",
    "Ironwood",
    "Kestrel",
    "Larkspur",
    "Moonstone",
    "Nightjar",
    "Orchid",
    "Pinecone",
    "Riverstone",
    "Sandpiper",
    "Thistle",
    "Wavecrest",
    "Yarrow",
]
FIRST_NAMES = [
    "Amara",
    "Bruno",
    "Camila",
    "Dmitri",
    "Elena",
    "Farid",
    "Greta",
    "Hiro",
    "Ingrid",
    "Jonas",
    "Keiko",
    "Lucas",
    "Marta",
    "Nikolai",
    "Olga",
    "Pablo",
    "Rania",
    "Soren",
    "Tamsin",
    "Viktor",
]
LAST_NAMES = [
    "Okafor",
    "Lindqvist",
    "Moreau",
    "Takahashi",
    "Novak",
    "Castillo",
    "Brennan",
    "Haddad",
    "Kowalski",
    "Ferreira",
    "Nakamura",
    "Oyelaran",
    "Petrov",
    "Quintero",
    "Rasmussen",
    "Salazar",
    "Thornton",
    "Ueda",
    "Varga",
    "Whitfield",
]
OBSERVATORIES = [
    "Redfern",
    "Ashcombe",
    "Millbrook",
    "Stonehaven",
    "Larchmont",
    "Brightwater",
    "Oakridge",
    "Fernhill",
    "Kingsbury",
    "Thornbury",
    "Westmere",
    "Holloway",
    "Greyfield",
    "Harrowgate",
    "Elmstead",
    "Dunmore",
]
MONTHS = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
]
OBJECTS = [
    "silver compass",
    "jade mask",
    "bronze bell",
    "ivory chess set",
    "glass harp",
    "copper lantern",
    "oak cradle",
    "gold astrolabe",
    "marble bust",
    "clay flute",
    "pearl comb",
    "iron key",
]
ROOMS = ["east", "west", "blue", "green", "north", "amber", "map", "garden", "tower", "river"]
CITIES = [
    "Lisbon",
    "Oslo",
    "Nairobi",
    "Santiago",
    "Hanoi",
    "Montreal",
    "Tbilisi",
    "Valletta",
    "Bergen",
    "Cusco",
    "Dakar",
    "Kyoto",
    "Tallinn",
    "Perth",
    "Quito",
    "Seville",
]


@dataclass(frozen=True)
class Fact:
    """One key fact: its sentences (the first holds the answer; a two-hop fact's second is the
    bridge), the question and the gold answer."""

    kind: str
    sentences: tuple[str, ...]
    question: str
    answer: str


def make_fact(kind: str, rng: random.Random) -> Fact:
    """A fact of `kind` with values drawn from `rng`."""
    if kind == "number":
        vault, code = rng.choice(VAULTS), str(rng.randint(10_000, 99_999))
        return Fact(
            kind,
            (f"The access code for the {vault} vault is {code}.",),
            f"What is the access code for the {vault} vault?",
            code,
        )
    if kind == "name":
        project, name = rng.choice(PROJECTS), f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}"
        return Fact(
            kind,
            (f"The lead engineer of Project {project} is {name}.",),
            f"Who is the lead engineer of Project {project}?",
            name,
        )
    if kind == "date":
        place = rng.choice(OBSERVATORIES)
        date = f"{rng.choice(MONTHS)} {rng.randint(1, 28)}, {rng.randint(1890, 1995)}"
        return Fact(
            kind,
            (f"The {place} observatory opened on {date}.",),
            f"On what date did the {place} observatory open?",
            date,
        )
    if kind == "two_hop":
        thing, room, city = rng.choice(OBJECTS), rng.choice(ROOMS), rng.choice(CITIES)
        return Fact(
            kind,
            (f"The {room} room belongs to the museum in {city}.", f"The {thing} is kept in the {room} room."),
            f"In which city is the {thing} kept?",
            city,
        )
    raise FeedbackError(f"unknown fact kind {kind!r}; kinds: {', '.join(KINDS)}")


# ---- exact match, suited to the templates ----
_MONTH = "|".join(MONTHS)
_DATES = [
    re.compile(rf"\b({_MONTH})\s+(\d{{1,2}})(?:st|nd|rd|th)?,?\s+(\d{{4}})\b", re.IGNORECASE),
    re.compile(rf"\b(\d{{1,2}})(?:st|nd|rd|th)?\s+(?:of\s+)?({_MONTH}),?\s+(\d{{4}})\b", re.IGNORECASE),
]
_ISO = re.compile(r"\b(\d{4})-(\d{2})-(\d{2})\b")
_NUMBER = re.compile(r"\d(?:[\d,]*\d)?")


def _date(month: str, day: str, year: str) -> str:
    return f"{month.capitalize()} {int(day)}, {int(year)}"


def _words(text: str, pool: list[str]) -> set[str]:
    return {w for w in pool if re.search(rf"(?<![\w]){re.escape(w)}(?![\w])", text, re.IGNORECASE)}


def candidates(kind: str, text: str) -> set[str]:
    """The values of a fact's kind that a reply names: numbers of four or more digits (commas
    dropped), the pools' first and last names, dates ("March 4, 1987", "4 March 1987",
    "1987-03-04"), the pools' cities."""
    if kind == "number":
        return {n for n in (m.replace(",", "") for m in _NUMBER.findall(text)) if len(n) >= 4}
    if kind == "name":
        return _words(text, FIRST_NAMES + LAST_NAMES)
    if kind == "date":
        found = {_date(m[0], m[1], m[2]) for m in _DATES[0].findall(text)}
        found |= {_date(m[1], m[0], m[2]) for m in _DATES[1].findall(text)}
        found |= {_date(MONTHS[int(mo) - 1], d, y) for y, mo, d in _ISO.findall(text) if 1 <= int(mo) <= 12}
        return found
    if kind == "two_hop":
        return _words(text, CITIES)
    raise FeedbackError(f"unknown fact kind {kind!r}")


def gold_values(fact: Fact) -> set[str]:
    return candidates(fact.kind, fact.answer)


def is_right(fact: Fact, reply: str) -> bool:
    """Exactly the gold value of the fact's kind in the reply: all of it, nothing else of its kind."""
    return candidates(fact.kind, reply) == gold_values(fact)


# ---- the configuration ----
def _values(value, bound: Bound, what: str) -> list:
    """A list of numbers from a list or "256, 1024" text, each inside `bound`: sorted, no repeats."""
    if isinstance(value, str):
        parts = [p for p in re.split(r"[,\s]+", value.strip()) if p]
    elif isinstance(value, (list, tuple)):
        parts = list(value)
    else:
        raise FeedbackError(f"{bound.name} must be a list of numbers, got {value!r:.80}")
    if not parts:
        raise FeedbackError(f"{bound.name}: give at least one {what}")
    if len(parts) > MAX_GRID_VALUES:
        raise FeedbackError(f"{bound.name}: at most {MAX_GRID_VALUES} values, got {len(parts)}")
    return sorted({bound.check(p) for p in parts})


def parse_lengths(value) -> list[int]:
    return _values(value, LENGTH, "length in tokens")


def parse_depths(value) -> list[float]:
    return [float(d) for d in _values(value, DEPTH, "depth in %")]


@dataclass
class RecallConfig:
    items: int = 4  # facts, one kind after another (KINDS)
    lengths: list[int] = field(default_factory=lambda: [256, 512, 1024, 2048, 4096])  # tokens of text
    depths: list[float] = field(default_factory=lambda: [0.0, 25.0, 50.0, 75.0, 100.0])  # % before the fact
    seed: int = 0  # facts, fillers and the bootstrap
    max_new_tokens: int = 24
    split: str = "test"  # the built-in corpus split the distractor text comes from
    bootstrap: int = 2000  # resamples of the gold log-probability's 95% CI (0: none)

    def validate(self, context: int | None = None) -> RecallConfig:
        """Checked, each refusal naming its field; with `context` a length beyond the model's
        window is refused at once (the exact fit, with the question and new tokens, is checked
        once the texts are built: `plan`)."""
        self.items = ITEMS.check(self.items)
        self.lengths = parse_lengths(self.lengths)
        self.depths = parse_depths(self.depths)
        self.max_new_tokens = NEW_TOKENS.check(self.max_new_tokens)
        self.bootstrap = BOOTSTRAP.check(self.bootstrap)
        self.seed = SEED.check(self.seed)
        if self.split not in SPLITS:
            raise FeedbackError(f"split must be dev or test, got {self.split!r}")
        if context is not None:
            too_long = [n for n in self.lengths if n >= context]
            if too_long:
                raise FeedbackError(
                    f"lengths: {too_long[0]:,} tokens is beyond the model's context of {context:,} "
                    "tokens (the question and the answer need room too)"
                )
        return self

    def to_dict(self) -> dict:
        return asdict(self)


# ---- building the texts ----
@dataclass
class Instance:
    """One prompt of the grid: a fact at a depth of a text of a length."""

    item: int
    fact: Fact
    length: int
    depth: float
    document: str
    tokens: int  # the document's tokens as built
    depth_actual: float  # % of the other tokens before the answer's sentence, as built
    prompt: str
    prompt_tokens: int = 0
    gold_tokens: int = 0

    def summary(self) -> dict:
        return {
            "item": self.item,
            "kind": self.fact.kind,
            "length": self.length,
            "depth": self.depth,
            "tokens": self.tokens,
            "depth_actual": round(self.depth_actual, 2),
            "prompt_tokens": self.prompt_tokens,
            "question": self.fact.question,
            "answer": self.fact.answer,
        }


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@dataclass
class Filler:
    """One item's distractor text and where each of its tokens starts."""

    text: str
    starts: list[int]
    ends: list[int]

    def cut(self, n: int) -> str:
        """The text of the first `n` tokens."""
        return self.text[: self.ends[n - 1]] if n > 0 else ""


def filler_for(tokenizer, split: str, seed: int, item: int, tokens: int) -> Filler:
    """The item's filler: the split's documents in a seeded order, joined by blank lines, at least
    `tokens` tokens long."""
    docs = builtin(split)
    random.Random(f"{seed}/{item}/filler").shuffle(docs)
    parts, chars, n = [], 0, 0
    while chars < 6 * tokens + 2000 and n < 50 * len(docs):  # cycles through the split again if it must
        parts.append(docs[n % len(docs)].text)
        chars += len(parts[-1]) + 2
        n += 1
    text = "\n\n".join(parts)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    if len(enc["input_ids"]) < tokens:
        raise FeedbackError(f"the built-in {split} split has too little text for {tokens:,} tokens")
    return Filler(text, [s for s, _ in enc["offset_mapping"]], [e for _, e in enc["offset_mapping"]])


_BOUNDARY = re.compile(r"[.!?:]\s+|\n\s*\n\s*")  # a sentence's end or a blank line (lines are wrapped)


def _snap(cut: str, starts: list[int], k: int, tolerance: int) -> int:
    """A character position in `cut` near its token `k`: the nearest sentence boundary within
    `tolerance` tokens, else the nearest word boundary."""
    if k <= 0:
        return 0
    n = bisect.bisect_left(starts, len(cut))  # tokens in `cut`
    if k >= n:
        return len(cut)
    token_at = lambda pos: bisect.bisect_left(starts, pos)  # noqa: E731 -- tokens starting before pos
    best = min(
        [0, len(cut)] + [m.end() for m in _BOUNDARY.finditer(cut)], key=lambda pos: abs(token_at(pos) - k)
    )
    if abs(token_at(best) - k) <= tolerance:
        return best
    pos = starts[k]
    spaces = [m.start() for m in re.finditer(r"\s", cut[max(0, pos - 200) : pos + 200])]
    return min((max(0, pos - 200) + s for s in spaces), key=lambda s: abs(s - pos), default=pos)


def _insert(text: str, at: int, sentence: str) -> tuple[str, int]:
    """`sentence` put into `text` at `at`, spaced as a sentence; (new text, where the sentence starts)."""
    left, right = text[:at], text[at:]
    if left and not left[-1].isspace():
        left += " "
    joined = left + sentence + ("" if not right or right[0].isspace() else " ") + right
    return joined, len(left)


def build_document(
    tokenizer, filler: Filler, fact: Fact, length: int, depth: float
) -> tuple[str, int, float]:
    """(document, its tokens, the answer sentence's actual depth %) for one instance."""
    answer_depth = [depth] + ([(depth + 50.0) % 100.0] if len(fact.sentences) > 1 else [])
    fact_tokens = [len(_ids(tokenizer, " " + s)) for s in fact.sentences]
    tolerance = max(2, round(SNAP_SHARE * length))
    n = length - sum(fact_tokens)
    if n < 1:
        raise FeedbackError(
            f"lengths: {length} tokens cannot hold the fact ({sum(fact_tokens)} tokens) and any text"
        )
    doc, tokens, start = "", 0, 0
    for _ in range(6):  # recut the filler until the joins' merges are accounted for
        cut = filler.cut(n)
        places = sorted(
            (
                (_snap(cut, filler.starts, round(d / 100.0 * n), tolerance), i)
                for i, d in enumerate(answer_depth)
            ),
            reverse=True,
        )  # from the end: earlier positions hold
        doc = cut
        for at, i in places:
            doc, _ = _insert(doc, at, fact.sentences[i])
        start = doc.find(fact.sentences[0])
        tokens = len(_ids(tokenizer, doc))
        if tokens == length or n + (length - tokens) < 1:
            break
        n += length - tokens
    before = len(_ids(tokenizer, doc[:start].rstrip())) if start > 0 else 0
    depth_actual = 100.0 * before / max(1, tokens - fact_tokens[0])
    return doc, tokens, depth_actual


def prompt_text(document: str, question: str) -> str:
    return f"{document}\n\n{INSTRUCTION}\nQuestion: {question}"


def plan(lm: LoadedModel, cfg: RecallConfig) -> list[Instance]:
    """Every instance of the grid, built and tokenised (no forward): items × lengths × depths, in
    that order within each length and depth. A prompt that would not fit the model's context with
    the new tokens and the gold answer is refused naming the lengths."""
    cfg.validate(lm.context_length)
    tok, out = lm.tokenizer, []
    longest = max(cfg.lengths)
    for item in range(cfg.items):
        fact = make_fact(KINDS[item % len(KINDS)], random.Random(f"{cfg.seed}/{item}/fact"))
        filler = filler_for(tok, cfg.split, cfg.seed, item, longest + 64)
        gold = len(_ids(tok, fact.answer))
        for length in cfg.lengths:
            for depth in cfg.depths:
                doc, tokens, actual = build_document(tok, filler, fact, length, depth)
                prompt = prompt_text(doc, fact.question)
                inst = Instance(
                    item, fact, length, depth, doc, tokens, actual, prompt, len(lm.encode(prompt)), gold
                )
                need = inst.prompt_tokens + max(cfg.max_new_tokens, gold)
                if need > lm.context_length:
                    fits = lm.context_length - max(cfg.max_new_tokens, gold) - (inst.prompt_tokens - tokens)
                    raise FeedbackError(
                        f"lengths: {length:,} tokens of text make a {inst.prompt_tokens:,}-token prompt "
                        "with the question and chat template; with max new tokens "
                        f"{cfg.max_new_tokens} it exceeds the model context of {lm.context_length:,} "
                        f"tokens (the longest length that fits is about {fits:,})"
                    )
                out.append(inst)
    order = {(L, d): n for n, (L, d) in enumerate((L, d) for L in cfg.lengths for d in cfg.depths)}
    out.sort(key=lambda x: (order[(x.length, x.depth)], x.item))
    return out


# ---- what a job costs ----
def work(instances: list[Instance], rows: list[RowSpec], max_new_tokens: int) -> tuple[int, int, str]:
    """(token-forwards scored, tokens decoded, how) of running these instances with these rows:
    each prompt prefilled once, then each row's gold answer scored after the prompt (a
    prompt-level row's after its reply, at most max new tokens), and rows × max new tokens decoded."""
    scored = decoded = 0
    for inst in instances:
        scored += inst.prompt_tokens
        for row in rows:
            extra = max_new_tokens if row.strategy == "restate" else 0
            scored += inst.prompt_tokens + extra + inst.gold_tokens
        decoded += len(rows) * max_new_tokens
    if not instances:
        return scored, decoded, "nothing"
    lo, hi = min(i.prompt_tokens for i in instances), max(i.prompt_tokens for i in instances)
    prompts = (
        f"1 prompt of {lo:,} tokens"
        if len(instances) == 1
        else (f"{len(instances)} prompts of {lo:,}" + (f" to {hi:,}" if hi != lo else "") + " tokens")
    )
    return (
        scored,
        decoded,
        f"{prompts}, {len(rows)} rows: each prompt once and each row's gold answer after it",
    )


def _over(budget: Budget, scored: int, decoded: int) -> bool:
    return (budget.scored_tokens is not None and scored > budget.scored_tokens) or (
        budget.decoded_tokens is not None and decoded > budget.decoded_tokens
    )


def check_budget(
    budget: Budget,
    instances: list[Instance],
    rows: list[RowSpec],
    max_new_tokens: int,
    items_name: str = "items",
) -> None:
    """The scoring and decoding budgets' refusals, before anything runs, naming the setting over
    and the most items that would fit (else: shorter lengths or fewer depths)."""
    scored, decoded, how = work(instances, rows, max_new_tokens)
    if not _over(budget, scored, decoded):
        return
    if budget.scored_tokens is not None and scored > budget.scored_tokens:
        over = (
            f"this request would score {scored:,} token-forwards ({how}); the budget is "
            f"{budget.scored_tokens:,} per request ({BUDGET_ENV['scored_tokens']})"
        )
    else:
        over = (
            f"this request would decode {decoded:,} tokens ({len(instances)} prompts x {len(rows)} rows x "
            f"{max_new_tokens} new tokens); the budget is {budget.decoded_tokens:,} per request "
            f"({BUDGET_ENV['decoded_tokens']})"
        )
    items = sorted({i.item for i in instances})
    fit = 0
    for k in range(1, len(items) + 1):
        if _over(budget, *work([i for i in instances if i.item <= items[k - 1]], rows, max_new_tokens)[:2]):
            break
        fit = k
    hint = (
        f"It fits with {items_name} {fit}."
        if fit
        else "Not even one item fits: use shorter lengths, fewer depths or fewer new tokens."
    )
    raise FeedbackError(f"{over}. {hint}")


# ---- the statistics ----
def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p: a binomial test of b successes in b + c discordant pairs at 1/2."""
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(b, c) + 1))
    return min(1.0, 2 * tail / 2**n)


def gold_bootstrap(diffs: dict[int, list[float]], resamples: int, seed: int) -> dict:
    """Mean per-instance difference of the gold answer's log-probability and its paired 95% CI,
    the items (facts) as the bootstrap's documents (see the module docstring)."""
    values = [v for vs in diffs.values() for v in vs]
    if not values:
        return {"mean_diff": None, "ci95": None, "method": "none", "instances": 0}
    if len(values) < 2:  # one difference resampled is itself again: no interval
        return {
            "mean_diff": float(values[0]),
            "ci95": None,
            "method": "one prompt: no interval",
            "instances": 1,
        }
    arrays = [np.asarray(vs, dtype=float) for vs in diffs.values() if vs]
    lo, hi, method = paired_bootstrap(arrays, resamples, seed)
    if method == "documents":
        method = f"items resampled ({len(arrays)} items, every cell of an item together)"
    elif method != "none":
        method = (
            f"cells resampled in moving blocks within each of fewer than 10 items ({len(arrays)}): "
            "these facts only"
        )
    ci = None if resamples == 0 or not math.isfinite(lo) else [lo, hi]
    return {"mean_diff": float(np.mean(values)), "ci95": ci, "method": method, "instances": len(values)}


def summarise(
    records: list[dict],
    row_names: list[str],
    lengths: list[int],
    depths: list[float],
    resamples: int = 2000,
    seed: int = 0,
) -> dict:
    """Accuracy per length × depth per row, the difference grids from the first row (the
    baseline), and per strategy row McNemar's exact p and the gold log-probability's bootstrap CI.
    Works on any instances done so far (a stopped job's)."""
    base = row_names[0]
    grid = {name: [[None] * len(depths) for _ in lengths] for name in row_names}
    counts = [[0] * len(depths) for _ in lengths]
    right = {name: [[0] * len(depths) for _ in lengths] for name in row_names}
    for r in records:
        li, di = lengths.index(r["length"]), depths.index(r["depth"])
        counts[li][di] += 1
        for name in row_names:
            right[name][li][di] += bool(r["rows"][name]["right"])
    for name in row_names:
        for li in range(len(lengths)):
            for di in range(len(depths)):
                if counts[li][di]:
                    grid[name][li][di] = right[name][li][di] / counts[li][di]
    n = len(records)
    rows: dict[str, dict] = {}
    for name in row_names:
        scores = [
            r["rows"][name]["gold_logprob"] for r in records if r["rows"][name]["gold_logprob"] is not None
        ]
        k = sum(bool(r["rows"][name]["right"]) for r in records)
        rows[name] = {
            "accuracy": k / n if n else None,
            "right": k,
            "instances": n,
            "mean_gold_logprob": float(np.mean(scores)) if scores else None,
            "gold_scored_with_strategy": all(r["rows"][name]["gold_scored_with_strategy"] for r in records),
        }
    difference, tests = {}, {}
    for name in row_names[1:]:
        difference[name] = [
            [None if g is None else g - b for g, b in zip(gr, br)] for gr, br in zip(grid[name], grid[base])
        ]
        b = sum(bool(r["rows"][base]["right"]) and not r["rows"][name]["right"] for r in records)
        c = sum(bool(r["rows"][name]["right"]) and not r["rows"][base]["right"] for r in records)
        test = {"mcnemar": {"baseline_only_right": b, "strategy_only_right": c, "p": mcnemar_exact(b, c)}}
        if rows[name]["gold_scored_with_strategy"]:
            diffs: dict[int, list[float]] = {}
            for r in records:
                s, t = r["rows"][name]["gold_logprob"], r["rows"][base]["gold_logprob"]
                if s is not None and t is not None:
                    diffs.setdefault(r["item"], []).append(s - t)
            test["gold_logprob"] = gold_bootstrap(diffs, resamples, seed)
        else:
            test["gold_logprob"] = {
                "mean_diff": None,
                "ci95": None,
                "instances": 0,
                "method": "not scored with the strategy: a recurrent strategy's gold answer is "
                "scored by the plain model (one parallel pass cannot apply it exactly)",
            }
        tests[name] = test
    return {
        "instances": n,
        "lengths": list(lengths),
        "depths": list(depths),
        "rows": rows,
        "accuracy": grid,
        "counts": counts,
        "difference": difference,
        "tests": tests,
    }


# ---- running ----
def run_instance(
    lm: LoadedModel,
    inst: Instance,
    rows: list[RowSpec],
    max_new_tokens: int,
    stop: threading.Event | None = None,
    budget: Budget | None = None,
) -> dict:
    """One engine run of every row on one instance: each row's reply, the kind's values it names,
    whether it is right, and the gold answer's log-probability after the prompt (nats, summed over
    its tokens)."""
    cfg = RunConfig(
        prompt=inst.prompt,
        model=lm.name,
        max_new_tokens=max_new_tokens,
        rows=rows,
        reference=inst.fact.answer,
    )
    run = start_run(lm, cfg, stop, budget=budget)
    for _ in run:
        pass
    check_stop(stop, "the recall job")
    gold_n = len(run.reference_ids or [])
    out = inst.summary() | {"rows": {}}
    for row in run.result.rows:
        reply = answer_text(row)
        ppl = row.metrics.get("reference_ppl")
        out["rows"][row.name] = {
            "reply": reply,
            "found": sorted(candidates(inst.fact.kind, reply)),
            "right": is_right(inst.fact, reply),
            "gold_logprob": -gold_n * math.log(ppl) if ppl is not None else None,
            "gold_scored_with_strategy": bool(
                row.metrics.get("reference_ppl_with_strategy", row.strategy is None)
            ),
            "tokens": len(row.token_ids),
            "stop_reason": row.stop_reason,
        }
    return out


def row_specs(rows: list[RowSpec]) -> list[dict]:
    return [{"name": r.name, "strategy": r.strategy, "params": dict(r.params)} for r in rows]


def evaluate_recall(
    lm: LoadedModel,
    cfg: RecallConfig,
    rows: list[RowSpec],
    instances: list[Instance] | None = None,
    on_instance: Callable[[dict], None] | None = None,
    stop: threading.Event | None = None,
    budget: Budget | None = None,
) -> dict:
    """Run the grid (`plan`, unless its `instances` are given) with every row, the first row the
    baseline; `on_instance` hears each instance's record (with `done` and `total`) as it finishes."""
    if not rows or rows[0].strategy is not None:
        raise FeedbackError("the first row must be the baseline (no strategy)")
    started = time.perf_counter()
    instances = instances if instances is not None else plan(lm, cfg)
    if budget is not None:
        check_budget(budget, instances, rows, cfg.max_new_tokens)
    records = []
    for n, inst in enumerate(instances, start=1):
        check_stop(stop, "the recall job")
        rec = run_instance(lm, inst, rows, cfg.max_new_tokens, stop, budget)
        records.append(rec)
        if on_instance:
            on_instance(rec | {"done": n, "total": len(instances)})
    return recall_result(lm.name, cfg, rows, records, time.perf_counter() - started)


def recall_result(
    model: str, cfg: RecallConfig, rows: list[RowSpec], records: list[dict], wall_seconds: float
) -> dict:
    """A whole grid's result from its instances' records, however many calls ran them (in order)."""
    result = summarise(records, [r.name for r in rows], cfg.lengths, cfg.depths, cfg.bootstrap, cfg.seed)
    return result | {
        "config": cfg.to_dict(),
        "model": model,
        "row_specs": row_specs(rows),
        "kinds": [KINDS[i % len(KINDS)] for i in range(cfg.items)],
        "items": records,
        "wall_seconds": wall_seconds,
    }


# ---- text output ----
def grid_lines(
    grid: list[list[float | None]], lengths: list[int], depths: list[float], signed: bool = False
) -> list[str]:
    """A length × depth grid as aligned text (— for a cell with no instances)."""
    head = "length \\ depth" + "".join(f"{d:>8g}%" for d in depths)
    lines = [head]
    for length, values in zip(lengths, grid):
        cells = "".join(f"{'—' if v is None else format(v, '+.2f' if signed else '.2f'):>9}" for v in values)
        lines.append(f"{length:>14,}" + cells)
    return lines


def report_lines(res: dict) -> list[str]:
    """The command line's table: each row's grid, each strategy's difference grid, and the tests."""
    cfg, names = res["config"], list(res["rows"])
    lines = [
        f"recall: {cfg['items']} items x {len(res['lengths'])} lengths x {len(res['depths'])} depths = "
        f"{res['instances']} prompts; rows {', '.join(names)}; greedy, {cfg['max_new_tokens']} new tokens "
        f"at most; "
        f"{res['wall_seconds']:.1f} s",
        "",
    ]
    for name in names:
        lines += [
            f"accuracy, {name} (rows: length in tokens, columns: depth of the fact):",
            *grid_lines(res["accuracy"][name], res["lengths"], res["depths"]),
            "",
        ]
    for name in names[1:]:
        lines += [
            f"accuracy difference, {name} − {names[0]}:",
            *grid_lines(res["difference"][name], res["lengths"], res["depths"], signed=True),
            "",
        ]
    lines.append(f"{'row':16} {'accuracy':>12} {'gold log-prob':>14}   vs {names[0]}")
    for name in names:
        r = res["rows"][name]
        acc = "n/a" if r["accuracy"] is None else f"{r['accuracy']:.1%} ({r['right']}/{r['instances']})"
        lp = "n/a" if r["mean_gold_logprob"] is None else f"{r['mean_gold_logprob']:.3f}"
        vs = ""
        if name in res["tests"]:
            t = res["tests"][name]
            m, g = t["mcnemar"], t["gold_logprob"]
            vs = (
                f"McNemar: {m['baseline_only_right']} only {names[0]} right, {m['strategy_only_right']} only "
                f"{name} right, exact p = {m['p']:.3g}; "
            )
            if g["mean_diff"] is None:
                vs += f"gold log-prob: {g['method']}"
            else:
                ci = f" [{g['ci95'][0]:+.3f}, {g['ci95'][1]:+.3f}]" if g["ci95"] else ""
                vs += f"Δ gold log-prob {g['mean_diff']:+.3f} nats{ci} (95% CI, {g['method']})"
        lines.append(f"{name:16} {acc:>12} {lp:>14}   {vs}".rstrip())
    return lines
