"""Structured output on CUDA in the model's own dtype (bfloat16): the grammar's token mask applied
on the GPU, and a constrained answer handed from a prefill engine to a decode engine through GPU
KV blocks, as the services do."""

from __future__ import annotations

import json

import pytest
import torch

from shared.engine.constraint import StructuredSpec
from shared.engine.engine import Engine
from shared.model.loader import LoadedModel
from shared.text.tokenizer import Tokenizer
from tests.engine.test_structured import PERSON, check_every_kind_of_constraint, constrained, make_engine, run
from tests.engine.test_structured import prompt, tokenizer  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def cuda_engine(loaded: LoadedModel) -> Engine:
    return make_engine(loaded, device="cuda", dtype="auto")


def test_every_kind_of_constraint_holds_on_cuda(
    loaded_model: LoadedModel, tokenizer: Tokenizer, prompt: list[int]
) -> None:
    check_every_kind_of_constraint(cuda_engine(loaded_model), tokenizer, prompt)


def test_split_across_cuda_engines_matches_one_engine(loaded_model: LoadedModel, prompt: list[int]) -> None:
    params = constrained(StructuredSpec("json_schema", json.dumps(PERSON)), seed=31)
    [(expected, _)] = run(cuda_engine(loaded_model), {"one": (prompt, params)}).values()
    prefill, decode = cuda_engine(loaded_model), cuda_engine(loaded_model)
    prefill.add_request("split", prompt, params, stop_after_prefill=True)
    while prefill.has_unfinished:
        prefill.step()
    handoff = prefill.export_handoff("split")
    blocks = prefill.read_kv_blocks("split", list(range(handoff.num_blocks)))
    assert blocks.device.type == "cpu"  # what the transports carry: shared memory, sockets, NIXL's DRAM
    assert decode.import_handoff(handoff, blocks)
    prefill.release("split")
    output = list(handoff.output_token_ids)
    while decode.has_unfinished:
        output += [t for out in decode.step() for t in out.new_token_ids]
    assert output == expected
