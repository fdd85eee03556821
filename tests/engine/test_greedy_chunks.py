"""A wide plain greedy batch never holds its whole logits, through the greedy head (the default model's LM
head is its embedding table) or by chunks of rows, with the same tokens."""

from shared.engine.engine import Engine
from shared.engine.sampling_params import SamplingParams
from shared.model.loader import LoadedModel
from shared.settings import EngineSettings, KVCacheSettings, ModelSettings


def _greedy_tokens(loaded: LoadedModel, chunk_rows: int | None, head: bool = True) -> dict[str, list[int]]:
    engine = Engine(EngineSettings(model=ModelSettings(dtype="float32", device="cpu"),
                                   kv_cache=KVCacheSettings(memory_bytes=2**26)), loaded)
    if chunk_rows is not None:
        engine.runner.greedy_chunk_rows = chunk_rows
    assert engine.runner.greedy_head is not None
    if not head:
        engine.runner.greedy_head = None
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for i in range(7):
        engine.add_request(str(i), [1 + i, 20 + 3 * i, 300 + 7 * i, 4000 + i], params)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished:
        for out in engine.step():
            tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
    return tokens


def test_chunked_greedy_logits_give_the_whole_batchs_tokens(loaded_model: LoadedModel) -> None:
    whole = _greedy_tokens(loaded_model, None)
    assert _greedy_tokens(loaded_model, chunk_rows=3) == whole  # 7 rows, wider than 3: the greedy head
    assert _greedy_tokens(loaded_model, chunk_rows=3, head=False) == whole  # chunks of 3, 3 and 1
    assert all(len(t) == 4 for t in whole.values()) and len(whole) == 7
