"""A colocated engine lets a prompt that its step budget would cut into chunks beside running decodes
take a whole step, where each stream can take the one late gap that makes (services/late_gaps.py,
`WholePromptSteps`): through the engine thread with the real model, clock-driven gaps."""

from __future__ import annotations

import asyncio

from services.engine_thread import EngineThread
from shared.engine.sampling_params import SamplingParams
from shared.settings import WorkerServiceSettings

ITL_TARGET_S = 1.0
ON_TIME_S = 0.95
PROMPT = list(range(1000, 1100))  # 100 tokens: more than a step beside decodes may take under a 1 ms target


def settings(model_path: str) -> WorkerServiceSettings:
    # a 1 ms step target: beside a decode no prompt fits, so the budget gives it the least chunk
    return WorkerServiceSettings.model_validate({
        "model": {"path": model_path, "dtype": "float32"}, "kv_cache": {"memory_bytes": 32 * 2**20},
        "worker": {"elastic_threads": False}, "targets": {"itl_ms": 1.0},
    })  # fmt: skip


def test_a_held_back_prompt_takes_a_whole_step_only_where_every_stream_can_take_a_late_gap(model_path: str) -> None:
    now = [0.0]

    async def run() -> None:
        thread = EngineThread(clock=lambda: now[0])
        engine = await thread.load(settings(model_path))
        # waited_s is measured on the real clock: after_s 0 lets a prompt spend the streams' last late gap
        thread.stall_for_prompts(ITL_TARGET_S, percentile=90, after_s=0.0)

        async def step() -> list[str]:
            now[0] += ON_TIME_S
            return [out.req_id for out in await thread.step()]

        async def prefill_beside_the_streams(req_id: str) -> int:
            """Steps until `req_id` has its token; how many it took."""
            await thread.call(engine.add_request, req_id, PROMPT, SamplingParams(max_tokens=1, temperature=0))
            steps = 1
            while req_id not in await step():
                steps += 1
            return steps

        # a stream of unsure length (no ignore_eos), young: none of its 3 gaps may be late
        await thread.call(engine.add_request, "unsure", [1, 2, 3, 4], SamplingParams(max_tokens=30, temperature=0))
        for _ in range(4):
            await step()
        assert engine.prompt_held_back() is None  # nothing waits
        assert await prefill_beside_the_streams("chunked") > 1 and thread.num_pauses == 0
        while engine.has_unfinished:
            await step()

        # a stream of sure length plans on all of it: 95 gaps may have 9 late, so the prompt goes whole
        sure = SamplingParams(max_tokens=96, temperature=0, ignore_eos=True)
        await thread.call(engine.add_request, "sure", [1, 2, 3, 4], sure)
        await step()  # its first token: no gap before it in a colocated engine
        assert await prefill_beside_the_streams("whole") == 1 and thread.num_pauses == 1
        # the stall's gap was 0.95 s here, on time: the ledger counts what the stream saw, not the plan
        assert await prefill_beside_the_streams("whole again") == 1 and thread.num_pauses == 2
        thread.shutdown()

    asyncio.run(run())
