"""The wire codec: every message survives a round trip, a TokenBatch travels as columns, and
what is malformed is refused with a ProtocolError that says why."""

import msgpack
import pytest

from shared.protocol import (
    SCHEMA_VERSION,
    Cancel,
    GenerateRequest,
    ProtocolError,
    TokenBatch,
    TokenUpdate,
    decode,
    encode,
)


def _update(i: int, **changes: object) -> TokenUpdate:
    fields: dict = dict(req_id=f"cmpl-{i}-0", attempt=0, index=10 + i, token_ids=[100 + i], worker_id="decode-a",
                        num_prompt_tokens=128)
    return TokenUpdate(**(fields | changes))


def test_a_token_batch_round_trips_with_varying_and_constant_fields() -> None:
    updates = [_update(i) for i in range(5)]
    updates[2] = _update(2, finish_reason="length", logprobs=[-0.5], top_logprobs=[[[101, -0.5], [7, -1.25]]])
    updates[3] = _update(3, worker_id="decode-b", error="the worker failed", token_ids=[])
    batch = TokenBatch(updates)
    assert decode(encode(batch)) == batch


def test_a_token_batch_packs_a_field_equal_in_every_update_once() -> None:
    body = msgpack.unpackb(encode(TokenBatch([_update(i) for i in range(64)])))
    assert "worker_id" in body["constant"] and body["columns"]["worker_id"] == "decode-a"
    assert "req_id" not in body["constant"] and len(body["columns"]["req_id"]) == 64


def test_an_empty_token_batch_round_trips() -> None:
    assert decode(encode(TokenBatch([]))) == TokenBatch([])


def test_a_token_batch_with_a_short_column_is_refused() -> None:
    body = msgpack.unpackb(encode(TokenBatch([_update(0), _update(1)])))
    body["columns"]["req_id"] = ["only-one"]
    with pytest.raises(ProtocolError, match="length"):
        decode(msgpack.packb(body))


def test_a_token_batch_missing_a_column_is_refused() -> None:
    body = msgpack.unpackb(encode(TokenBatch([_update(0), _update(1)])))
    del body["columns"]["index"]
    with pytest.raises(ProtocolError, match="columns"):
        decode(msgpack.packb(body))


def test_other_messages_round_trip_with_their_lists_intact() -> None:
    request = GenerateRequest(req_id="r", gateway_id="g", prompt_token_ids=[1, 2, 3], params={"max_tokens": 4},
                              seed=7, output_token_ids=[9])
    assert decode(encode(request)) == request
    assert decode(encode(Cancel("r", "client disconnected", 1))) == Cancel("r", "client disconnected", 1)


def test_another_schema_version_is_refused_by_name() -> None:
    body = msgpack.unpackb(encode(Cancel("r", "x")))
    body["v"] = SCHEMA_VERSION - 1
    with pytest.raises(ProtocolError, match=f"schema version {SCHEMA_VERSION - 1}"):
        decode(msgpack.packb(body))
