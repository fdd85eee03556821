"""The CUDA path (Triton kernels, decode CUDA graphs) gives the CPU path's greedy tokens."""

from __future__ import annotations

import pytest
import torch

from shared.engine.engine import Engine
from shared.engine.sampling_params import SamplingParams
from shared.model.loader import LoadedModel
from shared.settings import EngineSettings, KVCacheSettings, ModelSettings, SchedulerSettings

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def greedy_tokens(loaded: LoadedModel, device: str, prompts: list[list[int]]) -> list[list[int]]:
    engine = Engine(EngineSettings(
        model=ModelSettings(dtype="float32", device=device),  # type: ignore[arg-type]
        kv_cache=KVCacheSettings(memory_bytes=2**28),
        scheduler=SchedulerSettings(max_num_seqs=32),
    ), loaded)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished:
        for o in engine.step():
            out[o.req_id] += o.new_token_ids
    engine.check_invariants()
    return list(out.values())


def test_cuda_graph_decode_matches_cpu(loaded_model: LoadedModel) -> None:
    # 5 requests replay the 8-wide graph with 3 padded rows
    prompts = [list(range(100, 100 + n)) for n in (3, 17, 40, 129, 300)]
    assert greedy_tokens(loaded_model, "cuda", prompts) == greedy_tokens(loaded_model, "cpu", prompts)
