"""Structured output on the real model: every kind of constraint holds token by token, a seeded
constrained answer is the same alone, in a crowd, split across a prefill and a decode engine, and
re-run from part of its output (as after a crash), and unconstrained rows are left alone."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from shared.engine.constraint import GrammarError, StructuredSpec
from shared.engine.engine import Engine
from shared.engine.kv_handoff import Handoff
from shared.engine.request import ReqId
from shared.engine.sampler import Sampler, SamplingInput, build_sampling_batch
from shared.engine.sampling_params import SamplingParams, SamplingParamsError
from shared.model.loader import LoadedModel
from shared.settings import EngineSettings, KVCacheSettings, ModelSettings
from shared.text.tokenizer import Tokenizer

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0},
                   "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 3}},
    "required": ["name", "age", "pets"],
}  # fmt: skip
GRAMMAR = 'root ::= "The answer is " [0-9]+ "."'


@pytest.fixture(scope="module")
def tokenizer(model_path: str) -> Tokenizer:
    return Tokenizer.from_path(model_path)


@pytest.fixture(scope="module")
def prompt(tokenizer: Tokenizer) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": "Describe a person as JSON."}])


def make_engine(loaded: LoadedModel, device: str = "cpu", dtype: str = "float32") -> Engine:
    settings = EngineSettings(
        model=ModelSettings(dtype=dtype, device=device),  # type: ignore[arg-type]
        kv_cache=KVCacheSettings(memory_bytes=64 * 2**20),
    )
    return Engine(settings, loaded)


@pytest.fixture(scope="module")
def engine(loaded_model: LoadedModel) -> Engine:
    return make_engine(loaded_model)


def run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, tuple[list[int], str]]:
    """Token ids and finish reason of every request, run together."""
    for req_id, (prompt, params) in requests.items():
        engine.add_request(req_id, prompt, params)
    outputs: dict[str, list[int]] = {req_id: [] for req_id in requests}
    reasons: dict[str, str] = {}
    while engine.has_unfinished:
        for out in engine.step():
            outputs[out.req_id] += out.new_token_ids
            if out.finish_reason is not None:
                reasons[out.req_id] = out.finish_reason
    engine.check_invariants()
    return {req_id: (outputs[req_id], reasons[req_id]) for req_id in requests}


def constrained(spec: StructuredSpec, max_tokens: int = 48, temperature: float = 1.0, seed: int = 5) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, structured=spec)


def text_of(tokenizer: Tokenizer, token_ids: list[int]) -> str:
    return tokenizer.decode(token_ids)


def test_every_kind_of_constraint_holds(engine: Engine, tokenizer: Tokenizer, prompt: list[int]) -> None:
    check_every_kind_of_constraint(engine, tokenizer, prompt)


def check_every_kind_of_constraint(engine: Engine, tokenizer: Tokenizer, prompt: list[int]) -> None:
    specs = {
        "schema": StructuredSpec("json_schema", json.dumps(PERSON)),
        "object": StructuredSpec("json_object"),
        "regex": StructuredSpec("regex", r"[A-Z][a-z]{2,8} (is|was) [0-9]{1,3}"),
        "choice": StructuredSpec.choice(["red", "green", "blue"]),
        "grammar": StructuredSpec("grammar", GRAMMAR),
    }
    requests = {name: (prompt, constrained(spec, max_tokens=64, seed=i)) for i, (name, spec) in enumerate(specs.items())}
    results = run(engine, requests)
    texts = {name: text_of(tokenizer, token_ids) for name, (token_ids, _) in results.items()}
    assert {name: reason for name, (_, reason) in results.items()} == dict.fromkeys(specs, "stop"), texts
    jsonschema.validate(json.loads(texts["schema"]), PERSON)
    assert isinstance(json.loads(texts["object"]), dict)
    assert re.fullmatch(r"[A-Z][a-z]{2,8} (is|was) [0-9]{1,3}", texts["regex"])
    assert texts["choice"] in ("red", "green", "blue")
    assert re.fullmatch(r"The answer is [0-9]+\.", texts["grammar"])


def test_an_answer_cut_by_max_tokens_ends_with_length_as_a_prefix(
    engine: Engine, tokenizer: Tokenizer, prompt: list[int]
) -> None:
    spec = StructuredSpec("json_schema", json.dumps(PERSON))
    [(token_ids, reason)] = run(engine, {"cut": (prompt, constrained(spec, max_tokens=6))}).values()
    assert reason == "length" and len(token_ids) == 6
    text = text_of(tokenizer, token_ids)
    assert text and '{"name": "'.startswith(text[:10])  # the start of an answer that would validate


def test_seeded_constrained_answer_ignores_its_neighbours(engine: Engine, prompt: list[int]) -> None:
    params = constrained(StructuredSpec("json_schema", json.dumps(PERSON)), seed=123)
    [alone] = run(engine, {"alone": (prompt, params)}).values()
    crowd = run(engine, {
        "free": (prompt, SamplingParams(max_tokens=30, temperature=0.9, seed=1)),
        "same": (prompt, params),
        "other": (prompt, constrained(StructuredSpec("json_object"), seed=9)),
        "greedy": (prompt, SamplingParams(max_tokens=20, temperature=0.0)),
    })  # fmt: skip
    assert crowd["same"] == alone


def test_a_rerun_from_part_of_the_output_continues_the_same_answer(engine: Engine, prompt: list[int]) -> None:
    params = constrained(StructuredSpec("json_schema", json.dumps(PERSON)), seed=77)
    [(full, reason)] = run(engine, {"first": (prompt, params)}).values()
    engine.add_request("rerun", prompt, params, output_token_ids=full[:7])
    rest: list[int] = []
    while engine.has_unfinished:
        rest += [t for out in engine.step() for t in out.new_token_ids]
    assert full[:7] + rest == full and reason == "stop"


def test_split_across_prefill_and_decode_engines_matches_one_engine(
    engine: Engine, loaded_model: LoadedModel, prompt: list[int]
) -> None:
    params = constrained(StructuredSpec("json_schema", json.dumps(PERSON)), seed=31)
    [(expected, _)] = run(engine, {"one": (prompt, params)}).values()
    prefill, decode = make_engine(loaded_model), make_engine(loaded_model)
    prefill.add_request("split", prompt, params, stop_after_prefill=True)
    while prefill.has_unfinished:
        prefill.step()
    handoff = prefill.export_handoff("split")
    assert decode.import_handoff(handoff, prefill.read_kv_blocks("split", list(range(handoff.num_blocks))))
    prefill.release("split")
    output = list(handoff.output_token_ids)
    while decode.has_unfinished:
        output += [t for out in decode.step() for t in out.new_token_ids]
    assert output == expected


def test_reserved_before_the_prefill_and_given_the_first_token_after_matches_one_engine(
    engine: Engine, loaded_model: LoadedModel, prompt: list[int]
) -> None:
    """The order of a handoff streamed layer by layer: the decode engine reserves blocks for the
    whole prompt first, the first token (which the grammar must accept) comes with the last byte."""
    params = constrained(StructuredSpec("json_schema", json.dumps(PERSON)), seed=32)
    [(expected, _)] = run(engine, {"alone": (prompt, params)}).values()
    prefill, decode = make_engine(loaded_model), make_engine(loaded_model)
    early = Handoff(ReqId("early"), list(prompt), [], [], [], params, seed=32, num_cached_tokens=0,
                    num_blocks=-(-len(prompt) // decode.block_size), first_token_pending=True)
    needed = decode.reserve_import(early)
    assert needed == list(range(early.num_blocks))

    prefill.add_request("early", prompt, params, stop_after_prefill=True)
    outputs = []
    while prefill.has_unfinished:
        outputs += prefill.step()
    [first] = outputs
    decode.write_kv_blocks("early", needed, prefill.read_kv_blocks("early", needed))
    decode.add_first_token("early", first.new_token_ids[0], None, None, first.num_cached_tokens)
    decode.commit_import("early")
    prefill.release("early")
    output = list(first.new_token_ids)
    while decode.has_unfinished:
        output += [t for out in decode.step() for t in out.new_token_ids]
    assert output == expected


def test_the_constraint_survives_the_params_round_trip() -> None:
    params = constrained(StructuredSpec("regex", "[0-9]+"))
    assert SamplingParams.from_dict(params.to_dict()) == params
    assert SamplingParams.from_dict(SamplingParams().to_dict()).structured is None


def test_bad_constraints_are_refused_before_they_run(engine: Engine, prompt: list[int]) -> None:
    with pytest.raises(GrammarError, match="json_schema"):
        engine.add_request("bad-schema", prompt, constrained(StructuredSpec("json_schema", '{"type": "strin"}')))
    with pytest.raises(GrammarError, match="grammar"):
        engine.add_request("bad-grammar", prompt, constrained(StructuredSpec("grammar", "root ::= ")))
    with pytest.raises(GrammarError, match="kind"):
        StructuredSpec("yaml")  # type: ignore[arg-type]
    with pytest.raises(SamplingParamsError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured=StructuredSpec("json_object"))
    assert not engine.has_unfinished


def test_only_constrained_rows_are_masked() -> None:
    vocab = 70
    rows = [SamplingInput(SamplingParams(temperature=0.0), 0, [1], []) for _ in range(3)]
    assert build_sampling_batch(rows, [0], vocab, "cpu").allowed is None  # nothing to pay without a grammar
    bitmask = torch.full((3, 3), -1, dtype=torch.int32)  # every token
    bitmask[1] = torch.tensor([0, 1 << 5, 0])  # only token 37
    batch = build_sampling_batch(rows, [0], vocab, "cpu", bitmask)
    logits = torch.zeros((3, vocab))
    logits[:, 3] = 5.0
    assert Sampler()(logits, batch).token_ids == [3, 37, 3]
