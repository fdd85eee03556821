"""bench.decode_step times decode steps: every prompt is prefilled before the first timed step."""

from __future__ import annotations

from bench import decode_step
from shared.model.loader import LoadedModel


def test_the_engine_it_times_has_every_prompt_prefilled(loaded_model: LoadedModel) -> None:
    # prompts of 100 tokens take a step each on a CPU (shared/engine/policy/prompt_order.py): four need four
    engine = decode_step.decode_engine(loaded_model, "float32", 4, 100)
    outputs = engine.step()
    assert sorted(out.req_id for out in outputs) == ["0", "1", "2", "3"]
    assert all(len(out.new_token_ids) == 1 for out in outputs)  # one token each: a decode step
