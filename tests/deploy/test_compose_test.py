"""What `make compose-test` (deploy/compose_test.py) reads off a running stack: no engine needed."""

from __future__ import annotations

import json

import pytest

from deploy.compose_test import ComposeTestError, check_stream, counter, decode_tokens, shares, worker_host

METRICS = """\
# HELP llmd_worker_tokens_total Output tokens received, by the worker that produced them.
# TYPE llmd_worker_tokens_total counter
llmd_worker_tokens_total{model_name="m",worker_id="prefill-4f2a9c1b7d3e-7-ab12"} 9.0
llmd_worker_tokens_total{model_name="m",worker_id="decode-0c1d2e3f4a5b-7-cd34"} 120.0
llmd_worker_tokens_total{model_name="m",worker_id="decode-9a8b7c6d5e4f-8-ef56"} 36.0
llmd_worker_tokens_created{model_name="m",worker_id="decode-9a8b7c6d5e4f-8-ef56"} 1.7e+09
llmd_migrations_total{model_name="m"} 1.0
"""


def stream(texts: list[str], completion_tokens: int, finish: str | None = "length", done: bool = True) -> list[str]:
    chunks = [{"choices": [{"index": 0, "text": text, "finish_reason": None}]} for text in texts]
    chunks[-1]["choices"][0]["finish_reason"] = finish
    chunks.append({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": completion_tokens}})
    return [f"data: {json.dumps(chunk)}" for chunk in chunks] + (["data: [DONE]"] if done else [])


def test_decode_tokens_counts_decode_workers_only() -> None:
    assert decode_tokens(METRICS) == {"decode-0c1d2e3f4a5b-7-cd34": 120.0, "decode-9a8b7c6d5e4f-8-ef56": 36.0}


def test_counter_reads_the_total_not_the_created_timestamp() -> None:
    assert counter(METRICS, "llmd_migrations_total") == 1.0
    assert counter(METRICS, "llmd_worker_tokens_total") == 165.0


def test_worker_host_is_the_container_hostname_in_a_worker_id() -> None:
    assert worker_host("decode-0c1d2e3f4a5b-7-cd34") == "0c1d2e3f4a5b"
    assert worker_host("decode-my-host-12-ab12") == "my-host"


def test_shares_name_the_containers_and_count_only_the_new_tokens() -> None:
    names = {"0c1d2e3f4a5b": "llmd-decode-1", "9a8b7c6d5e4f": "llmd-decode-2", "4f2a9c1b7d3e": "llmd-prefill-1"}
    before = {"decode-0c1d2e3f4a5b-7-cd34": 100.0}
    after = {"decode-0c1d2e3f4a5b-7-cd34": 130.0, "decode-9a8b7c6d5e4f-8-ef56": 10.0}
    assert shares(before, after, names) == "llmd-decode-1 75% (30 tokens), llmd-decode-2 25% (10 tokens)"
    assert shares(after, after, names) == "llmd-decode-1 0% (0 tokens), llmd-decode-2 0% (0 tokens)"


def test_a_complete_stream_passes() -> None:
    assert check_stream(stream(["a"] * 3, 3), 3).startswith("3 of 3 tokens")


@pytest.mark.parametrize(
    "lines",
    [
        stream(["a"] * 3, 2),  # tokens lost
        stream(["a"] * 3, 3, done=False),  # cut off before the end
        stream(["a"] * 3, 3, finish="abort"),  # ended by an error
        [*stream(["a"] * 3, 3)[:-2], "data: [DONE]"],  # no usage
    ],
)
def test_an_incomplete_stream_fails(lines: list[str]) -> None:
    with pytest.raises(ComposeTestError, match="did not complete"):
        check_stream(lines, 3)
