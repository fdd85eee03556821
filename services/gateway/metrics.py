"""Prometheus metrics of a gateway: what clients experience, measured where they connect.

Names follow vLLM's where the meaning matches (dashboards built for vLLM read these); the
`llmd_*` ones are the gateway's own. Each gateway has its own registry, so several can live
in one test process.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from services.gateway.router import Route
from services.pool_planner.policy import PoolLoad
from shared.metrics import LATENCY_BUCKETS, PhaseSeconds

# where a gateway's time goes as tokens flow back (`llmd_gateway_phase_seconds_total`): routing each
# worker's batch to its requests, turning updates into text (detokenising, stop strings, their
# metrics), and writing server-sent events (chunks' JSON and the writes)
ROUTE, DETOKENIZE, SSE = "route", "detokenize", "sse"
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)


class GatewayMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str, queue_depth: Callable[[], float]) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}

        def histogram(name: str, doc: str, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> Histogram:
            return Histogram(name, doc, ["model_name"], buckets=buckets, registry=self.registry).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, ["model_name"], registry=self.registry).labels(**labels)

        self.e2e_request_latency = histogram(
            "vllm:e2e_request_latency_seconds", "From an API request's arrival to its last token."
        )
        self.time_to_first_token = histogram(
            "vllm:time_to_first_token_seconds", "From an API request's arrival to its first output token."
        )
        self.inter_token_latency = histogram(
            "vllm:inter_token_latency_seconds", "Gap between successive tokens of one request.", TOKEN_GAP_BUCKETS
        )
        self.request_queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "From an API request's arrival to its requests being on the requests stream (validation, "
            "tokenisation, admission); the wait for a prefill worker shows in the time to first token.",
        )
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of admitted requests (once per prompt).")
        self.generation_tokens = counter("vllm:generation_tokens", "Output tokens delivered to clients.")
        self.cancellations = Counter(
            "llmd_cancellations", "Requests the gateway cancelled on the workers, by reason.",
            ["model_name", "reason"], registry=self.registry,
        )
        # running totals kept where the work is done (a clock read or two per batch), read at scrape time
        self.phase_seconds: dict[str, float] = dict.fromkeys((ROUTE, DETOKENIZE, SSE), 0.0)
        PhaseSeconds(self.registry, "llmd_gateway_phase_seconds", "Seconds the gateway spent routing token batches, "
                     "detokenising and writing server-sent events.", labels).track(lambda: self.phase_seconds)
        self.requests_rejected = counter("llmd_requests_rejected", "API requests answered 429 (gateway at capacity).")
        self.migrations = counter(
            "llmd_migrations", "Requests re-queued off a dead decode worker, continuing after the tokens streamed."
        )
        self.worker_tokens = Counter(
            "llmd_worker_tokens", "Output tokens received, by the worker that produced them.",
            ["model_name", "worker_id"], registry=self.registry,
        )
        self._worker_tokens: dict[str, Counter] = {}  # worker id -> its child of worker_tokens
        self.routed_requests = Counter(
            "llmd_routed_requests", "Requests routed, by stage (prefill, decode), by what decided (overlap: the "
            "worker caching most of the prompt; load: the shared stream, or no decode hint; local: prefilled on the "
            "decode worker that caches all but a few of its tokens) and worker ('' for load).",
            ["model_name", "stage", "by", "worker_id"], registry=self.registry,
        )
        self.routed_matched_blocks = Counter(
            "llmd_routed_matched_blocks", "Prompt blocks the chosen worker cached as the router saw it (for load: the "
            "best any worker cached), by stage and worker.", ["model_name", "stage", "worker_id"], registry=self.registry,
        )
        self.worker_prompt_tokens = Counter(
            "llmd_worker_prompt_tokens", "Prompt tokens prefilled, by the worker that computed the first token.",
            ["model_name", "worker_id"], registry=self.registry,
        )
        self.worker_cached_tokens = Counter(
            "llmd_worker_cached_tokens", "Of those, tokens found in the worker's prefix cache: with "
            "llmd_worker_prompt_tokens, each worker's prefix hit rate.", ["model_name", "worker_id"],
            registry=self.registry,
        )
        self._model_name = model_name
        self.planner_load = Gauge(
            "llmd_planner_load", "Each pool's load against its latency targets (services/pool_planner): 1 means "
            "its requests just meet them.", ["model_name", "role"], registry=self.registry,
        )
        self.planner_recommended_workers = Gauge(
            "llmd_planner_recommended_workers", "Workers each pool needs to bring its load to the planner's "
            "target_load: the replica count for an autoscaler.", ["model_name", "role"], registry=self.registry,
        )
        queue = Gauge("llmd_queue_depth", "Requests in flight on the workers (admitted, not finished).",
                      ["model_name"], registry=self.registry)
        queue.labels(**labels).set_function(queue_depth)

    def cancelled(self, reason: str) -> None:
        self.cancellations.labels(model_name=self._model_name, reason=reason).inc()

    def observe_pools(self, pools: list[PoolLoad], target_load: float) -> None:
        for pool in pools:
            labels = {"model_name": self._model_name, "role": pool.role}
            if pool.load is not None:
                self.planner_load.labels(**labels).set(pool.load)
            self.planner_recommended_workers.labels(**labels).set(pool.recommended(target_load))

    def observe_route(self, route: Route) -> None:
        for choice in (route.prefill, route.decode):
            worker_id = choice.worker_id or ""
            self.routed_requests.labels(self._model_name, choice.stage, choice.by, worker_id).inc()
            self.routed_matched_blocks.labels(self._model_name, choice.stage, worker_id).inc(choice.num_matched_blocks)

    def prefilled_by(self, worker_id: str, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        self.worker_prompt_tokens.labels(model_name=self._model_name, worker_id=worker_id).inc(num_prompt_tokens)
        self.worker_cached_tokens.labels(model_name=self._model_name, worker_id=worker_id).inc(num_cached_tokens)

    def tokens_from(self, worker_id: str, num_tokens: int) -> None:
        counter = self._worker_tokens.get(worker_id)
        if counter is None:  # once per worker: `labels` costs microseconds, and this runs for every update
            counter = self._worker_tokens[worker_id] = self.worker_tokens.labels(
                model_name=self._model_name, worker_id=worker_id)
        counter.inc(num_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
