"""Offline API: `LLM(model).generate(prompts, params)`, for tests, benchmarks and scripts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tqdm import tqdm

from shared.engine.engine import Engine, RequestOutput
from shared.engine.sampling_params import SamplingParams
from shared.model.loader import load_model
from shared.settings import EngineSettings, KVCacheSettings, ModelSettings, SchedulerSettings
from shared.text.detokenizer import IncrementalDetokenizer
from shared.text.tokenizer import Tokenizer


# an offline batch has every prompt at once and no stream waiting on a step: twice a server's
# batch, as vLLM's LLM class takes on a CPU (256 sequences, 4,096 tokens a step)
OFFLINE_SCHEDULER = SchedulerSettings(max_num_seqs=256, max_num_batched_tokens=4096)


@dataclass(slots=True)
class CompletionOutput:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    num_cached_tokens: int = 0


class LLM:
    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str = "auto",
        device: str = "auto",
        settings: EngineSettings | None = None,
        kv_cache: KVCacheSettings | None = None,
        scheduler: SchedulerSettings | None = None,
    ) -> None:
        settings = settings or EngineSettings(
            model=ModelSettings(path=model or "default", dtype=dtype, device=device),  # type: ignore[arg-type]
            kv_cache=kv_cache or KVCacheSettings(),
            scheduler=scheduler or OFFLINE_SCHEDULER,
        )
        loaded = load_model(settings.model.path, settings.model.disk_cache)
        self.tokenizer = Tokenizer.from_path(str(loaded.path), settings.model.disk_cache)
        # the detokenisers' table, built now: within the first generate its 0.3 s and the memory it
        # frees would show as that generate's time and the next one's fresh pages
        self.tokenizer.byte_pieces()
        self.engine = Engine(settings, loaded)
        self._next_id = 0

    def generate(
        self,
        prompts: Sequence[str] | Sequence[list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[CompletionOutput]:
        """Run every prompt to completion; outputs come back in prompt order."""
        all_params = [params or SamplingParams()] * len(prompts) if not isinstance(params, Sequence) else list(params)
        if len(all_params) != len(prompts):
            raise ValueError(f"got {len(all_params)} sampling params for {len(prompts)} prompts")
        outputs: dict[str, CompletionOutput] = {}
        detokenizers: dict[str, IncrementalDetokenizer] = {}
        for prompt, p in zip(prompts, all_params):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            req_id = f"offline-{self._next_id}"
            self._next_id += 1
            self.engine.add_request(req_id, ids, p)
            outputs[req_id] = CompletionOutput(prompt_token_ids=ids)
            detokenizers[req_id] = IncrementalDetokenizer(self.tokenizer, ids, stop=list(p.stop))
        with tqdm(total=len(prompts), desc="generating", unit="req", disable=not use_tqdm) as progress:
            while self.engine.has_unfinished:
                for out in self.engine.step():
                    if self._record(outputs[out.req_id], detokenizers[out.req_id], out):
                        progress.update(1)
        return list(outputs.values())

    def _record(self, completion: CompletionOutput, detok: IncrementalDetokenizer, out: RequestOutput) -> bool:
        completion.token_ids.extend(out.new_token_ids)
        completion.logprobs.extend(out.new_logprobs or [])
        completion.top_logprobs.extend(out.new_top_logprobs or [])
        completion.num_cached_tokens = out.num_cached_tokens
        completion.text += detok.add(out.new_token_ids)
        if detok.stopped and not out.is_finished:
            self.engine.abort_request(out.req_id)
            completion.finish_reason = "stop"
            return True
        if out.is_finished:
            completion.finish_reason = "stop" if detok.stopped else out.finish_reason
            completion.text += "" if detok.stopped else detok.flush()
            return True
        return False
