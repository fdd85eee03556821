"""Request.num_sure_output_tokens: what a paced decode worker may plan late gaps on
(shared/engine/policy/late_gaps.py), so it must never exceed what the request can produce."""

from __future__ import annotations

import pytest

from shared.engine.constraint import StructuredSpec
from shared.engine.request import ReqId, Request
from shared.engine.sampling_params import SamplingParams


def sure_tokens(num_prompt: int = 10, max_model_len: int = 1000, **params: object) -> int:
    request = Request(ReqId("r"), list(range(num_prompt)), SamplingParams(**params), seed=0, eos_token_ids=(2,),
                      max_model_len=max_model_len)  # fmt: skip
    return request.num_sure_output_tokens


def test_only_the_length_ends_an_ignore_eos_request() -> None:
    assert sure_tokens(max_tokens=96, ignore_eos=True) == 96
    assert sure_tokens(max_tokens=96, ignore_eos=True, num_prompt=950) == 50  # the context ends it first


@pytest.mark.parametrize(
    "params",
    [
        {"max_tokens": 96},  # an EOS may come at any token
        {"max_tokens": 96, "ignore_eos": True, "stop_token_ids": [7]},
        {"max_tokens": 96, "ignore_eos": True, "stop": ["\n"]},  # the gateway matches them on text
        {"max_tokens": 96, "ignore_eos": True, "structured": StructuredSpec.choice(["a", "b"])},  # it ends when complete
    ],
)
def test_a_request_that_may_stop_sooner_is_sure_of_its_min_tokens_at_most(params: dict[str, object]) -> None:
    assert sure_tokens(**params) == 0
    if "stop" not in params and "structured" not in params:
        assert sure_tokens(**params, min_tokens=30) == 30
