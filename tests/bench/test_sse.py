from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from bench.serving.sse import SSEDecoder

STREAM = (
    ": keep-alive\n\n"
    'data: {"text": "héllo"}\n\n'
    'event: message\r\nid: 7\r\ndata: {"a":\r\ndata: 1}\r\n\r\n'
    "data:no-space\n\n"
    "data: [DONE]\n\n"
).encode()
EVENTS = ['{"text": "héllo"}', '{"a":\n1}', "no-space", "[DONE]"]


def test_decodes_data_and_skips_comments_and_other_fields() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(STREAM) == EVENTS
    assert decoder.flush() == []


@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=12))
def test_any_split_of_the_bytes_gives_the_same_events(cuts: list[int]) -> None:
    bounds = [0, *sorted(cuts), len(STREAM)]
    decoder = SSEDecoder()
    events = [event for a, b in itertools.pairwise(bounds) for event in decoder.feed(STREAM[a:b])]
    assert events + decoder.flush() == EVENTS


def test_event_is_held_until_its_blank_line() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"data: 1\n") == []
    assert decoder.feed(b"\n") == ["1"]


def test_flush_returns_an_event_cut_off_by_the_end_of_stream() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"data: 1\n\ndata: 2") == ["1"]
    assert decoder.flush() == ["2"]
