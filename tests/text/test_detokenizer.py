from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.text import IncrementalDetokenizer, Tokenizer

HELLO, WORLD, BANG = 19556, 905, 17  # "Hello", " world", "!"
SMILE = [40303, 218]  # " 😀" split as b" \xf0\x9f\x98" + b"\x80"
IM_END = 2


def feed_one_by_one(detok: IncrementalDetokenizer, token_ids: list[int]) -> list[str]:
    return [detok.add([token_id]) for token_id in token_ids]


class _WindowOnly:
    """The tokenizer posing as a vocabulary without byte pieces (as SentencePiece's): the window path."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def byte_pieces(self, skip_special_tokens: bool = True) -> None:
        return None


@pytest.fixture(params=["bytes", "window"])
def text_path(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def tok(tokenizer: Tokenizer, text_path: str) -> Tokenizer:
    """The tokenizer each test's detokenizers read: its byte pieces, or a window of decodes."""
    return tokenizer if text_path == "bytes" else _WindowOnly(tokenizer)  # type: ignore[return-value]


def test_each_token_emits_its_text_at_once(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, prompt_token_ids=[])
    assert feed_one_by_one(detok, [HELLO, WORLD, BANG]) == ["Hello", " world", "!"]
    assert detok.flush() == ""
    assert not detok.stopped and detok.finish_reason is None
    assert detok.num_output_tokens == 3


def test_character_split_across_tokens_waits_for_its_last_byte(
    tokenizer: Tokenizer, tok: Tokenizer, text_path: str
) -> None:
    assert tokenizer.encode(" 😀") == SMILE
    detok = IncrementalDetokenizer(tok, prompt_token_ids=tokenizer.encode("Hi"))
    # the byte path emits the space at once; a window holds back the whole token
    assert feed_one_by_one(detok, SMILE) == ([" ", "😀"] if text_path == "bytes" else ["", " 😀"])


def test_cjk_split_across_tokens(tokenizer: Tokenizer, tok: Tokenizer) -> None:
    ids = tokenizer.encode("你好")
    detok = IncrementalDetokenizer(tok, prompt_token_ids=[])
    deltas = feed_one_by_one(detok, ids)
    assert deltas == ["", "你", "", "好"]


def test_prompt_context_keeps_leading_space(tokenizer: Tokenizer, tok: Tokenizer) -> None:
    prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    detok = IncrementalDetokenizer(tok, prompt_ids)
    assert detok.add([HELLO, WORLD]) == "Hello world"


def test_prompt_cut_mid_character_is_not_used_as_context(tokenizer: Tokenizer, tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, prompt_token_ids=[HELLO, SMILE[0]])
    assert detok.add([SMILE[1]]) + detok.flush() == "\ufffd"
    assert tokenizer.decode([SMILE[1]]) == "\ufffd"


def test_special_tokens_skipped_or_kept(tok: Tokenizer) -> None:
    skipping = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    keeping = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    assert skipping.add([HELLO, IM_END]) + skipping.flush() == "Hello"
    assert keeping.add([HELLO, IM_END]) + keeping.flush() == "Hello<|im_end|>"


def test_stop_string_truncates_and_reports(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=["world"])
    assert feed_one_by_one(detok, [HELLO, WORLD, BANG]) == ["Hello", " ", ""]
    assert detok.stopped
    assert detok.finish_reason == "stop"
    assert detok.stop_str == "world"
    assert detok.num_output_tokens == 2
    assert detok.flush() == ""


def test_possible_stop_prefix_is_held_then_released_at_flush(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=["ld!?"])
    assert feed_one_by_one(detok, [HELLO, WORLD]) == ["Hello", " wor"]
    assert detok.flush() == "ld"
    assert not detok.stopped


def test_held_prefix_released_when_text_diverges(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=["ld?"])
    assert feed_one_by_one(detok, [HELLO, WORLD, BANG]) == ["Hello", " wor", "ld!"]


def test_stop_string_spanning_tokens_hides_all_of_it(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=["lo wo"])
    assert feed_one_by_one(detok, [HELLO, WORLD]) == ["Hel", ""]
    assert detok.stop_str == "lo wo"


def test_earliest_stop_string_wins(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=["world", "llo"])
    assert detok.add([HELLO, WORLD]) == "He"
    assert detok.stop_str == "llo"
    assert detok.num_output_tokens == 1


def test_tokens_after_stop_are_ignored(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=["Hello"])
    assert detok.add([HELLO, WORLD, BANG]) == ""
    assert detok.add([WORLD]) == ""
    assert detok.num_output_tokens == 1


def test_stop_string_found_in_flushed_text(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=["\ufffd"])
    assert detok.add([HELLO, SMILE[0]]) + detok.flush() == "Hello "
    assert detok.stop_str == "\ufffd"


def test_decodes_only_a_small_window_per_token(tokenizer: Tokenizer) -> None:
    spy = _DecodeSpy(tokenizer)
    detok = IncrementalDetokenizer(spy, tokenizer.encode("A prompt of several tokens here"))  # type: ignore[arg-type]
    output_ids = tokenizer.encode(" the quick brown fox 😀 jumps" * 40)
    text = "".join(detok.add([token_id]) for token_id in output_ids) + detok.flush()
    assert text == tokenizer.decode(output_ids)
    assert max(spy.window_sizes) <= 8
    assert len(spy.window_sizes) <= 2 * len(output_ids) + 2


class _DecodeSpy:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.window_sizes: list[int] = []

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        self.window_sizes.append(len(token_ids))
        return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def byte_pieces(self, skip_special_tokens: bool = True) -> None:
        return None


def test_byte_pieces_skip_special_tokens_only_when_asked(tokenizer: Tokenizer) -> None:
    skipping = tokenizer.byte_pieces(skip_special_tokens=True)
    keeping = tokenizer.byte_pieces(skip_special_tokens=False)
    assert skipping is not None and keeping is not None  # SmolLM2's vocabulary is byte-level BPE
    assert (skipping[IM_END], keeping[IM_END]) == (b"", b"<|im_end|>")
    assert skipping[HELLO] == keeping[HELLO] == b"Hello"
    assert tokenizer.byte_pieces() is skipping  # built once


def test_ids_past_the_vocabulary_are_skipped_as_decode_skips_them(tokenizer: Tokenizer, tok: Tokenizer) -> None:
    ids = [HELLO, tokenizer.vocab_size + 5, WORLD]
    detok = IncrementalDetokenizer(tok, [])
    assert detok.add(ids) + detok.flush() == tokenizer.decode(ids) == "Hello world"


@pytest.fixture(scope="module")
def partial_char_ids(tokenizer: Tokenizer) -> list[int]:
    """Tokens whose bytes are not valid UTF-8 on their own (pieces of multi-byte characters)."""
    ids = []
    for token_id in range(tokenizer.vocab_size):
        try:
            tokenizer.token_bytes(token_id).decode()
        except UnicodeDecodeError:
            ids.append(token_id)
    return ids


def _token_ids(tokenizer: Tokenizer, partial_char_ids: list[int]) -> st.SearchStrategy[list[int]]:
    emoji_and_cjk = st.characters(codec="utf-8", categories=["So", "Lo", "Zs", "Ll", "Nd", "Po"])
    text_ids = st.text(emoji_and_cjk, max_size=12).map(lambda text: tokenizer.encode(text))
    any_ids = st.lists(st.integers(0, tokenizer.vocab_size - 1), max_size=4)
    partial_ids = st.lists(st.sampled_from(partial_char_ids), max_size=4)
    pieces = st.lists(st.one_of(text_ids, any_ids, partial_ids), max_size=6)
    return pieces.map(lambda lists: [token_id for ids in lists for token_id in ids])


def _feed_in_chunks(detok: IncrementalDetokenizer, token_ids: list[int], sizes: list[int]) -> list[str]:
    deltas, start = [], 0
    for size in sizes:
        deltas.append(detok.add(token_ids[start : start + size]))
        start += size
    deltas.append(detok.add(token_ids[start:]))
    deltas.append(detok.flush())
    return deltas


@settings(max_examples=300, deadline=None)
@given(data=st.data(), skip_special_tokens=st.booleans(), prompt=st.sampled_from(["", "Say something:", "你好"]),
       window=st.booleans())
def test_deltas_concatenate_to_full_decode(
    tokenizer: Tokenizer, partial_char_ids: list[int], data: st.DataObject, skip_special_tokens: bool, prompt: str,
    window: bool,
) -> None:
    token_ids = data.draw(_token_ids(tokenizer, partial_char_ids))
    sizes = data.draw(st.lists(st.integers(0, 3), max_size=len(token_ids)))
    tok: Tokenizer = _WindowOnly(tokenizer) if window else tokenizer  # type: ignore[assignment]
    detok = IncrementalDetokenizer(tok, tokenizer.encode(prompt), skip_special_tokens=skip_special_tokens)
    deltas = _feed_in_chunks(detok, token_ids, sizes)
    full = tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
    assert "".join(deltas) == full
    offset = 0
    for delta in deltas:
        # A U+FFFD in a delta must be one the full text has too (never a half-decoded character).
        assert all(full[offset + i] == "\ufffd" for i, char in enumerate(delta) if char == "\ufffd")
        offset += len(delta)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), window=st.booleans())
def test_stop_string_cuts_exactly_before_first_occurrence(
    tokenizer: Tokenizer, partial_char_ids: list[int], data: st.DataObject, window: bool
) -> None:
    token_ids = data.draw(_token_ids(tokenizer, partial_char_ids))
    full = tokenizer.decode(token_ids)
    if full:
        start = data.draw(st.integers(0, len(full) - 1))
        stop = full[start : start + data.draw(st.integers(1, 4))]
    else:
        stop = data.draw(st.text(min_size=1, max_size=3))
    sizes = data.draw(st.lists(st.integers(0, 3), max_size=len(token_ids)))
    tok: Tokenizer = _WindowOnly(tokenizer) if window else tokenizer  # type: ignore[assignment]
    detok = IncrementalDetokenizer(tok, [], stop=[stop])
    deltas = _feed_in_chunks(detok, token_ids, sizes)
    cut = full.find(stop)
    assert "".join(deltas) == (full if cut < 0 else full[:cut])
    assert detok.stop_str == (None if cut < 0 else stop)
