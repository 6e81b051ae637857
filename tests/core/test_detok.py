"""Incremental detokenisation (feedback/core/detok.py) with the real SmolLM2 byte-level BPE tokenizer."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from feedback.core.detok import IncrementalDecoder

FFFD = "\ufffd"

TEXTS = [
    "Hello, world!",
    "The answer is 42.",
    "café crème brûlée, naïve façade, Ærøskøbing",
    "日本語のテキストと中文字符",
    "emoji: 😀👍🏽🎉 and flags 🇫🇷🇯🇵",
    "family 👨‍👩‍👧‍👦 zwj",
    "  leading spaces",
    "trailing spaces   ",
    "\nleading newline",
    "trailing newlines\n\n",
    " \n 混合 text: ë 🙂 \t end \n",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math 𝑥² + 𝑦² = 𝑧²",
    "Ελληνικά и русский текст, עברית, العربية",
    "a literal replacement char \ufffd in the middle",
    "",
]


@pytest.fixture(scope="module")
def tok(embedded_lm):
    return embedded_lm.tokenizer


def full_decode(tok, ids, skip=True):
    return tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def stream(tok, ids, skip=True):
    dec = IncrementalDecoder(tok, skip_special_tokens=skip)
    pieces = [dec.push(i) for i in ids]
    return dec, pieces, dec.flush()


def check_stream(tok, ids):
    """The invariants every token stream must satisfy."""
    full = full_decode(tok, ids)
    dec = IncrementalDecoder(tok)
    emitted = ""
    for n, token_id in enumerate(ids, start=1):
        piece = dec.push(token_id)
        assert isinstance(piece, str)
        if FFFD not in full:
            assert FFFD not in piece, (ids[:n], piece)
        emitted += piece
        assert full.startswith(emitted)
        # nothing complete is held back: once the text so far decodes cleanly, it is all out
        so_far = full_decode(tok, ids[:n])
        if not so_far.endswith(FFFD):
            assert emitted == so_far, (ids[:n], emitted, so_far)
    rest = dec.flush()
    assert emitted + rest == full
    assert dec.flush() == ""  # flushing twice gives nothing new
    return full


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_stream_equals_full_decode(tok, text):
    ids = tok(text, add_special_tokens=False)["input_ids"]
    full = check_stream(tok, ids)
    assert full == text  # byte-level BPE round-trips exactly (no normalisation, no clean-up)


def test_multibyte_characters_really_are_split_across_tokens(tok):
    """Guard for the tests above: some tokens end inside a UTF-8 character, so the hold-back path runs."""
    text = "emoji: 😀👍🏽🎉 and flags 🇫🇷🇯🇵 𝔘𝔫𝔦"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    partial = [full_decode(tok, ids[:n]) for n in range(1, len(ids) + 1)]
    assert any(p.endswith(FFFD) for p in partial)
    _, pieces, rest = stream(tok, ids)
    assert "".join(pieces) + rest == text
    assert "" in pieces  # at least one token was held back
    assert all(FFFD not in p for p in pieces)


def test_special_tokens_are_skipped(tok):
    eos = tok.eos_token_id
    dec = IncrementalDecoder(tok)
    assert dec.push(eos) == ""
    assert dec.flush() == ""

    ids = tok("Hi there", add_special_tokens=False)["input_ids"]
    ids2 = tok(" again 😀", add_special_tokens=False)["input_ids"]
    stream_ids = ids + [eos, tok.convert_tokens_to_ids("<|im_start|>")] + ids2 + [eos]
    _, pieces, rest = stream(tok, stream_ids)
    assert pieces[len(ids)] == "" and pieces[len(ids) + 1] == ""
    assert pieces[-1] == ""
    assert "".join(pieces) + rest == "Hi there again 😀" == full_decode(tok, stream_ids)


def test_special_tokens_kept_when_not_skipping(tok):
    eos = tok.eos_token_id
    ids = tok("ok", add_special_tokens=False)["input_ids"] + [eos]
    _, pieces, rest = stream(tok, ids, skip=False)
    assert pieces[-1] == tok.eos_token == "<|im_end|>"
    assert "".join(pieces) + rest == full_decode(tok, ids, skip=False) == "ok<|im_end|>"


def test_incomplete_character_at_end_is_released_by_flush(tok):
    ids = tok("x😀", add_special_tokens=False)["input_ids"]
    # cut the stream inside the emoji: find a prefix that decodes to a trailing U+FFFD
    cut = next(n for n in range(1, len(ids)) if full_decode(tok, ids[:n]).endswith(FFFD))
    dec, pieces, rest = stream(tok, ids[:cut])
    assert FFFD not in "".join(pieces)
    assert "".join(pieces) + rest == full_decode(tok, ids[:cut])
    assert rest.endswith(FFFD)


alphabet = st.one_of(
    st.characters(codec="utf-8", exclude_categories=("Cs",)),
    st.sampled_from(list("aZ9 \n\t.,éßœ中文日本😀🎉👍🏽\u200d🇫🇷 ")),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet=alphabet, max_size=40))
def test_stream_equals_full_decode_random_text(tok, text):
    ids = tok(text, add_special_tokens=False)["input_ids"]
    check_stream(tok, ids)


@pytest.fixture(scope="module")
def byte_fragment_ids(tok):
    """Tokens that on their own decode to an incomplete UTF-8 sequence (U+FFFD)."""
    ids = [i for i in range(len(tok)) if FFFD in tok.decode([i])]
    assert len(ids) > 50
    return ids


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_arbitrary_token_sequences_round_trip(tok, byte_fragment_ids, data):
    """A model can emit any id sequence, including invalid UTF-8: the stream still equals the full decode."""
    any_id = st.integers(min_value=0, max_value=len(tok) - 1)
    ids = data.draw(st.lists(st.one_of(st.sampled_from(byte_fragment_ids), any_id), max_size=16))
    _, pieces, rest = stream(tok, ids)
    assert "".join(pieces) + rest == full_decode(tok, ids)


def test_sentencepiece_style_spaces_survive_streaming():
    """With a Metaspace decoder a word token decoded alone loses its leading space ("▁world" ->
    "world"); the decoder's context window must keep the spaces between streamed words."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, "▁hello": 2, "▁world": 3, "▁a": 4, "!": 5}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    sp_tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>")
    assert sp_tok.decode([3]) == "world"  # the trap this test is about

    assert sp_tok("hello world a", add_special_tokens=False)["input_ids"] == [2, 3, 4]
    ids = [2, 3, 4, 3, 5]  # "hello world a world!"
    _, pieces, rest = stream(sp_tok, ids + [1])
    assert pieces[:5] == ["hello", " world", " a", " world", "!"]
    assert "".join(pieces) + rest == full_decode(sp_tok, ids) == "hello world a world!"
