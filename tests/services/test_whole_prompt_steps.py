"""A colocated engine lets a prompt that its step budget would cut into chunks beside running decodes
take a whole step, where each stream can take the one late gap that makes (the step policy,
`StepPolicy.takes_whole_step`): through the engine thread with the real model, clock-driven gaps."""

from __future__ import annotations

import asyncio

from services.runtime.engine_thread import EngineThread
from shared.engine.sampling_params import SamplingParams
from shared.settings import WorkerServiceSettings

ON_TIME_S = 0.0005  # on the test's clock: within the 1 ms target
PROMPT = list(range(1000, 1100))  # 100 tokens: more than a step beside decodes may take under a 1 ms target


def settings(model_path: str) -> WorkerServiceSettings:
    # a 1 ms inter-token target: beside a decode no prompt fits in a step, so the budget gives it the
    # least chunk; a TTFT target so short that any prompt has waited long enough to spend the last late gap
    return WorkerServiceSettings.model_validate({
        "model": {"path": model_path, "dtype": "float32"}, "kv_cache": {"memory_bytes": 32 * 2**20},
        "worker": {"elastic_threads": False},
        "targets": {"itl_ms": 1.0, "itl_percentile": 90, "ttft_ms": 1e-6},
    })  # fmt: skip


def test_a_held_back_prompt_takes_a_whole_step_only_where_every_stream_can_take_a_late_gap(model_path: str) -> None:
    now = [0.0]

    async def run() -> None:
        thread = EngineThread(clock=lambda: now[0])
        engine = await thread.load(settings(model_path))
        assert thread.stall_for_prompts(first_token_seen=True)

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
        # the stall's gap was on time on this clock: the ledger counts what the stream saw, not the plan
        assert await prefill_beside_the_streams("whole again") == 1 and thread.num_pauses == 2
        thread.shutdown()

    asyncio.run(run())


def test_whole_prompt_steps_need_a_percentile_target(model_path: str) -> None:
    every_gap = settings(model_path).model_copy(deep=True)
    every_gap.targets.itl_percentile = 100

    async def run() -> None:
        thread = EngineThread()
        await thread.load(every_gap)
        assert not thread.stall_for_prompts(first_token_seen=True)
        thread.shutdown()

    asyncio.run(run())
