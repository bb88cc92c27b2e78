"""Incremental text: the pieces a growing output hands out concatenate to its full decoding, never
hold half a character, and stop strings cut the text exactly where a whole decoding finds them
first, also when they span tokens."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given
from hypothesis import strategies as st

from runners.engine.text import IncrementalText
from runners.text import ByteLevelTokenizer

decode = ByteLevelTokenizer().decode


def byte_ids(data: bytes) -> list[int]:
    return list(data)


def feed(
    ids: Sequence[int], stops: tuple[str, ...] = (), min_tokens: int = 0
) -> tuple[IncrementalText, list[str], int]:
    """Push ``ids`` one at a time (a prompt of 3 ids before them), collecting every stable piece
    as a streaming client would see it; return the text, the pieces and the tokens fed."""
    prompt = [65, 66, 67]
    text = IncrementalText(decode, stops, include_stop=False)
    pieces: list[str] = []
    sent = 0
    tokens = list(prompt)
    for count, token in enumerate(ids, start=1):
        tokens.append(token)
        stopped = text.push(tokens, len(prompt), count > min_tokens)
        pieces.append(text.text[sent : text.stable])
        sent = max(sent, text.stable)
        if stopped:
            return text, pieces, count
    text.flush(tokens, len(prompt))
    pieces.append(text.text[sent:])
    return text, pieces, len(ids)


@given(st.binary(max_size=60))
def test_pieces_concatenate_to_the_whole_decoding_of_any_bytes(data: bytes) -> None:
    text, pieces, _ = feed(byte_ids(data))
    assert text.text == decode(byte_ids(data))
    assert "".join(pieces) == text.text


@given(st.text(max_size=30), st.lists(st.integers(256, 300), max_size=3))
def test_valid_utf8_never_hands_out_a_partial_character(text: str, specials: list[int]) -> None:
    ids = byte_ids(text.encode("utf-8")) + specials  # special ids have no text
    result, pieces, _ = feed(ids)
    assert result.text == text
    assert all("\ufffd" not in piece for piece in pieces)


alphabet = st.text(alphabet="abc", min_size=1, max_size=30)


@given(alphabet, st.lists(st.text(alphabet="abc", min_size=1, max_size=3), min_size=1, max_size=3))
def test_stop_strings_cut_where_the_whole_text_first_has_one(text: str, stops: list[str]) -> None:
    ids = byte_ids(text.encode())
    result, pieces, fed = feed(ids, tuple(stops))
    firsts = [text.find(s) + len(s) for s in stops if s in text]
    if not firsts:  # never stopped: everything fed
        assert (result.stopped, result.text, fed) == (False, text, len(ids))
        return
    end = min(firsts)  # the stop completes with the token ending at ``end``
    cut = min(text.find(s) for s in stops if s in text[:end])
    assert result.stopped and fed == end
    assert result.text == text[:cut]
    assert "".join(pieces) == result.text  # nothing past the cut was ever handed out


def test_a_stop_string_is_held_back_until_it_is_ruled_out() -> None:
    text = IncrementalText(decode, ("abc",), include_stop=False)
    tokens = [1]
    for char, stable in (("x", 1), ("a", 1), ("b", 1), ("d", 4)):
        tokens.append(ord(char))
        assert not text.push(tokens, 1, True)
        assert text.stable == stable, char


def test_min_tokens_delays_the_match_and_include_stop_keeps_it() -> None:
    early = IncrementalText(decode, ("b",), include_stop=False)
    assert not early.push([0, ord("b")], 1, False)  # within min_tokens: not matched
    assert early.text == "b"
    kept = IncrementalText(decode, ("bc",), include_stop=True)
    assert not kept.push([0, ord("a"), ord("b")], 1, True)
    assert kept.push([0, ord("a"), ord("b"), ord("c")], 1, True)
    assert kept.text == "abc"
