"""Prometheus metrics of a worker, defined once. Names follow vLLM's where the meaning matches,
so dashboards built for vLLM read these; `llmd_*` ones are the prefill->decode handoff's own.

Each worker has its own registry (not prometheus_client's global one), so several workers can
live in one process in tests without their series colliding.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import CounterMetricFamily

if TYPE_CHECKING:  # the gateway imports this module too, and has no use for torch
    from shared.engine.engine import EngineStats

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
LABELS = ("model_name", "worker_id")
KV_TRANSPORTS = ("shm", "nixl", "tcp", "redis")  # the `transport` label of llmd_handoff_bytes (services/kv_transfer)


class PhaseSeconds:
    """A counter family `NAME_total{phase=...}` read at scrape time from running totals of seconds
    per phase that the code keeps anyway (an engine's `StepPhases`, a gateway's delivery loop), so
    the hot path never touches a Prometheus object."""

    def __init__(self, registry: CollectorRegistry, name: str, doc: str, labels: Mapping[str, str]) -> None:
        self._name, self._doc, self._labels = name, doc, dict(labels)
        self._read: Callable[[], Mapping[str, float]] = dict
        registry.register(self)

    def track(self, read: Callable[[], Mapping[str, float]]) -> None:
        self._read = read

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self._name, self._doc, labels=[*self._labels, "phase"])
        for phase, seconds in list(self._read().items()):
            family.add_metric([*self._labels.values(), phase], seconds)
        yield family


class WorkerMetrics:
    """One worker's series. Engine counters are cumulative in `EngineStats`; `observe_engine`
    turns them into Prometheus counter increments."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str, worker_id: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name, "worker_id": worker_id}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, LABELS, registry=self.registry).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, LABELS, registry=self.registry).labels(**labels)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=LATENCY_BUCKETS, registry=self.registry).labels(**labels)

        self.num_requests_running = gauge("vllm:num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent.")
        self.prefix_cache_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.num_preemptions = counter("vllm:num_preemptions", "Preemptions of running requests.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens prefilled.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.")
        self.time_to_first_token = histogram(
            "vllm:time_to_first_token_seconds", "From the request entering the requests stream to its first token."
        )
        handoff_bytes = Counter(
            "llmd_handoff_bytes", "KV bytes moved between prefill and decode workers, by transport.",
            (*LABELS, "transport"), registry=self.registry,
        )
        # every transport's series from the start, so that a zero reads as "none went this way"
        self.handoff_bytes = {t: handoff_bytes.labels(**labels, transport=t) for t in KV_TRANSPORTS}
        self.handoff_failures = counter(
            "llmd_handoff_failures", "Direct KV transfers that failed (the decode worker died, stalled or refused "
            "them); each request was offered to another decode worker."
        )
        self.handoff_seconds = histogram(
            "llmd_handoff_seconds", "From a request's prefill finishing to its KV being ready on a decode worker."
        )
        self.handoffs_streamed = counter(
            "llmd_handoffs_streamed", "Handoffs whose KV went over the data port layer by layer while the prefill "
            "ran (LLMD_WORKER__KV_STREAM_MIN_TOKENS); llmd_handoff_seconds then counts only what was left after it."
        )
        self.local_prefills = counter(
            "llmd_local_prefills", "Requests a decode worker prefilled itself, without a handoff: it cached all "
            "but a few tokens of their prompt (LLMD_ROUTING__LOCAL_PREFILL_MAX_TOKENS)."
        )
        self.torch_threads = gauge(
            "llmd_torch_threads", "Torch threads the engine steps on: its share of the host's core lease (0 while "
            "idle), or the fixed count."
        )
        self.lent_seconds = counter(
            "llmd_lent_seconds", "Seconds a decode worker with work lent its cores to a prefilling neighbour, "
            "pacing its steps to the inter-token target (docs/scheduling.md)."
        )
        self.stream_pauses = counter(
            "llmd_stream_pauses", "Times a paced decode worker paused its streams to give a long prompt beside it "
            "every core, or an engine let a prompt of its own take a whole step beside them, each stream taking "
            "one late gap within LLMD_TARGETS__ITL_PERCENTILE."
        )
        self.paced_steps = counter(
            "llmd_paced_steps", "Steps a paced decode worker planned, lending its cores until the step was due."
        )
        self.paced_steps_late = counter(
            "llmd_paced_steps_late", "Planned steps whose tokens still came later than the inter-token target "
            "after the step before: the step outran the pacer's estimate by more than its slack. Beside the "
            "gateway's vllm:inter_token_latency_seconds, tells the pacer's late gaps from the delivery's."
        )
        self.engine_phases = PhaseSeconds(
            self.registry, "llmd_engine_phase_seconds", "Seconds the engine's steps spent in each phase (schedule, "
            "prepare, forward, logits, sample, update, outputs; shared/engine/step_phases.py).", labels,
        )
        # a running total read at scrape time, beside the phases: their seconds per step
        self.engine_steps = gauge("llmd_engine_steps", "Engine steps that computed something, since the start.")
        self._last_stats: EngineStats | None = None
        self._lent_s = 0.0
        self._stream_pauses = 0
        self._paced_steps = 0
        self._paced_steps_late = 0

    def observe_engine(self, stats: EngineStats) -> None:
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting + stats.num_importing)
        self.kv_cache_usage.set(stats.kv.usage)
        last = self._last_stats
        self.prefix_cache_queries.inc(stats.kv.prefix_queries - (last.kv.prefix_queries if last else 0))
        self.prefix_cache_hits.inc(stats.kv.prefix_hits - (last.kv.prefix_hits if last else 0))
        self.num_preemptions.inc(stats.num_preemptions - (last.num_preemptions if last else 0))
        self._last_stats = stats

    def track_engine_steps(self, phase_seconds: Callable[[], Mapping[str, float]], num_steps: Callable[[], int]) -> None:
        self.engine_phases.track(phase_seconds)
        self.engine_steps.set_function(num_steps)

    def observe_pacing(self, lent_s: float, stream_pauses: int, paced_steps: int, paced_steps_late: int) -> None:
        """The engine thread's running totals of time lent, pauses and planned steps."""
        self.lent_seconds.inc(lent_s - self._lent_s)
        self.stream_pauses.inc(stream_pauses - self._stream_pauses)
        self.paced_steps.inc(paced_steps - self._paced_steps)
        self.paced_steps_late.inc(paced_steps_late - self._paced_steps_late)
        self._lent_s, self._stream_pauses = lent_s, stream_pauses
        self._paced_steps, self._paced_steps_late = paced_steps, paced_steps_late

    def render(self) -> bytes:
        return generate_latest(self.registry)
