"""Every setting, defined once: `BaseModel` sections composed into one `BaseSettings` per service.

Environment variables use the prefix `LLMD_` and `__` for nesting, e.g.
`LLMD_KV_CACHE__BLOCK_SIZE=32` or `LLMD_REDIS__URL=redis://host:6379/0`. The settings ignore
other variables, so each process warns once at start about an `LLMD_` variable that names no
setting (`warn_unknown_settings`): a misspelt one would otherwise fall back to its default unseen.
"""

from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Mapping
from typing import Literal

from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "LLMD_"

logger = logging.getLogger(__name__)


class ModelSettings(BaseModel):
    path: str = Field("default", description="a .gguf file or a Hugging Face checkpoint folder; 'default' = SmolLM2-135M-Instruct")
    name: str | None = Field(None, description="model id served by the API (default: derived from the path)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="auto: bfloat16 on CUDA and on CPUs with native bf16, else float32")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: CUDA when present")
    max_model_len: int | None = Field(None, ge=16, description="context length cap (default: the model's)")
    disk_cache: bool = Field(
        True, description="keep a GGUF's converted weights and tokenizer under ~/.cache/llmd/models (starts in ~1 s, not ~10)")


KVCacheDType = Literal["auto", "float32", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2", "int8"]


class KVCacheSettings(BaseModel):
    block_size: int = Field(16, ge=1, le=256, description="tokens per KV block (a power of two)")
    memory_bytes: int | None = Field(None, ge=1, description="KV pool size in bytes; overrides memory_fraction")
    memory_fraction: float = Field(0.1, gt=0, le=0.95, description="share of available memory for the KV pool")
    enable_prefix_caching: bool = Field(True, description="share full blocks of common prefixes")
    dtype: KVCacheDType = Field(
        "auto", description="how the KV pool stores keys and values: auto = the model's dtype; bfloat16/float16 "
        "halve a float32 model's; fp8_e4m3, fp8_e5m2 and int8 store 8 bits with a float32 scale per token and kv "
        "head (a quarter of float32, plus the scales); prefill and decode workers must agree")

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"block_size must be a power of two, got {v}")
        return v


KVReservation = Literal["paged", "max_length"]


class SchedulerSettings(BaseModel):
    max_num_batched_tokens: int = Field(2048, ge=16, description="token budget of one engine step")
    max_num_seqs: int = Field(128, ge=1, description="cap on requests running at once")
    enable_chunked_prefill: bool = Field(True, description="split long prompts across steps")
    long_prefill_token_threshold: int = Field(
        0, ge=0, description="with chunked prefill, the most prompt tokens one request takes in a step, so that "
        "shorter prompts behind a long one are prefilled beside its chunks instead of after it; 0: no cap")
    kv_reservation: KVReservation = Field(
        "paged", description="paged: KV blocks are taken as a request grows; max_length: a request is admitted only "
        "when blocks for its prompt + max_tokens are free, and takes them all at admission (as servers before "
        "PagedAttention, e.g. FasterTransformer and Orca, reserved); for comparison")


class LatencyTargetSettings(BaseModel):
    """The latency a deployment promises its users. The pool planner sizes the prefill pool to the TTFT
    target and the decode pool to the inter-token target; the step policy (shared/engine/policy) fits
    steps beside decodes to the inter-token target and paces a CPU decode worker to it while a
    neighbour on its cores prefills."""

    ttft_ms: float = Field(5000.0, gt=0, description="time to first token (default: about 5x an unloaded "
                           "256-token prompt on a 2-core AVX2 CPU in float32)")
    itl_ms: float = Field(200.0, gt=0, description="time between two tokens of one request (default: a chat "
                          "user's reading pace, DistServe's chatbot target)")
    itl_percentile: int = Field(
        100, gt=0, le=100, description="itl_ms holds for this percentile of each request's gaps; below 100 (90 is "
        "DistServe's p90) a long prompt may take a whole step, or a paced decode worker pause its streams once "
        "for one beside it, where each stream can take one more late gap within it (docs/scheduling.md); 100: every gap")


class EngineSettings(BaseModel):
    model: ModelSettings = ModelSettings()
    kv_cache: KVCacheSettings = KVCacheSettings()
    scheduler: SchedulerSettings = SchedulerSettings()
    torch_threads: int | None = Field(None, ge=1, description="intra-op threads for torch on CPU")
    targets: LatencyTargetSettings | None = Field(
        None, description="the latency targets the step policy keeps (shared/engine/policy); None: none, prompts "
        "take the scheduler's whole token budget (offline use)")


class RedisSettings(BaseModel):
    url: str = Field("redis://127.0.0.1:6379/0", description="redis:// or rediss:// (TLS), with user:password if needed")
    namespace: str = Field("llmd", description="prefix of every key and stream this deployment uses")
    socket_timeout_s: float = Field(5.0, gt=0, description="bound on one Redis call, so outages surface quickly")
    max_connections: int = Field(
        64, ge=4, description="most connections one service opens to Redis; beyond them a call waits up to "
        "socket_timeout_s for a free one, so a burst of requests queues rather than fails")


class _Base(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_nested_delimiter="__", extra="ignore")

    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    redis: RedisSettings = RedisSettings()
    targets: LatencyTargetSettings = LatencyTargetSettings()


class EngineServiceSettings(_Base):
    """What an engine-owning settings object exposes to `shared.engine` code."""

    model: ModelSettings = ModelSettings()
    kv_cache: KVCacheSettings = KVCacheSettings()
    scheduler: SchedulerSettings = SchedulerSettings()
    torch_threads: int | None = Field(None, ge=1, description="intra-op torch threads (default: torch's)")

    @property
    def engine(self) -> EngineSettings:
        return EngineSettings(
            model=self.model, kv_cache=self.kv_cache, scheduler=self.scheduler, torch_threads=self.torch_threads,
            targets=self.targets,
        )

    @model_validator(mode="after")
    def _budget_covers_a_block(self) -> EngineServiceSettings:
        if self.scheduler.max_num_batched_tokens < self.kv_cache.block_size:
            raise ValueError(
                f"scheduler.max_num_batched_tokens ({self.scheduler.max_num_batched_tokens}) must be at least "
                f"kv_cache.block_size ({self.kv_cache.block_size})"
            )
        return self


def parse_cpu_list(text: str) -> set[int]:
    """The CPUs of a list like '0', '0-3' or '0,2,4-5' (Linux cpuset syntax); empty for ''."""
    cpus: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        first, sep, last = part.partition("-")
        last = last if sep else first
        if not (first.isdigit() and last.isdigit()) or int(last) < int(first):
            raise ValueError(f"cpus {text!r} is not a CPU list like '0', '0-1' or '0,2' (at {part!r})")
        cpus.update(range(int(first), int(last) + 1))
    return cpus


class KVEventSettings(BaseModel):
    """A worker's reports of what its prefix cache holds, which gateways route by (services/runtime/kv_events.py)."""

    enabled: bool = Field(True, description="publish KV events (blocks stored and evicted) and snapshots")
    stream_maxlen: int = Field(100_000, ge=100, description="the kv_events stream is trimmed to about this many")
    snapshot_interval_s: float = Field(2.0, gt=0, description="how often a changed cache is snapshotted; a "
                                       "router that missed events catches up within about this long")
    snapshot_ttl_s: float = Field(60.0, gt=0, description="a snapshot key outlives its worker this long")


class WorkerSettings(BaseModel):
    worker_id: str | None = Field(None, description="unique id (default: host-pid-random)")
    health_host: str = Field("127.0.0.1", description="listen address of /health and /metrics")
    health_port: int = Field(9100, ge=0, le=65535, description="/health and /metrics; 0 picks a free port")
    heartbeat_interval_s: float = Field(0.5, gt=0, description="how often a worker publishes its status")
    heartbeat_ttl_s: float = Field(3.0, gt=0, description="a worker silent this long is treated as dead")
    max_deliveries: int = Field(3, ge=1, description="deliveries of one request before it is dead-lettered")
    handoff_timeout_s: float = Field(10.0, gt=0, description="bound on waiting for the other side of a KV handoff")
    kv_shm_dir: str = Field(
        "/dev/shm", description="tmpfs through which KV handoffs go between workers that share it (one host, or "
        "containers given one /dev/shm); empty = no shared tmpfs: KV goes over the data port")
    kv_transport: Literal["auto", "shm", "nixl", "tcp", "redis"] = Field(
        "auto", description="auto: shared tmpfs where the two workers share one, else NIXL where both have it "
        "(pip install nixl-cu12), else the data port, Redis only when none works; shm, nixl or tcp: that one or "
        "Redis; redis: always Redis")
    kv_tcp_host: str = Field(
        "127.0.0.1", description="listen address of a decode worker's KV data port (0.0.0.0 in containers)")
    kv_tcp_port: int = Field(0, ge=0, le=65535, description="the KV data port; 0 picks a free one")
    kv_tcp_advertise: str = Field(
        "", description="address other workers reach this one at and see its KV connections come from (default: "
        "kv_tcp_host, or this host's address when that is 0.0.0.0); a decode worker accepts KV only from addresses "
        "that live prefill workers advertise")
    kv_stream_min_tokens: int = Field(
        512, ge=0, description="a prompt of at least this many tokens to compute, bound for a decode worker reached "
        "over the data port, sends its KV layer by layer while it prefills (the decode worker reserves blocks "
        "first), so little of the transfer is left once the first token is out; 0: never")
    stuck_after_s: float = Field(30.0, gt=0, description="no engine progress this long while busy = stuck")
    cpus: str = Field("", description="CPUs the worker runs on, e.g. '0', '0-1' or '0,2'; empty = any")
    elastic_threads: bool = Field(
        True, description="on the CPU, lend idle cores to the other workers on them and borrow theirs (up to the "
        "torch threads), through a core lease in core_lease_dir"
    )
    core_lease_dir: str = Field(
        "/dev/shm", description="directory (a tmpfs) shared by the workers of one host, holding their core lease"
    )
    kv_events: KVEventSettings = KVEventSettings()

    @field_validator("cpus")
    @classmethod
    def _cpu_list(cls, v: str) -> str:
        parse_cpu_list(v)
        return v

    @model_validator(mode="after")
    def _ttl_covers_heartbeats(self) -> WorkerSettings:
        if self.heartbeat_ttl_s <= self.heartbeat_interval_s:
            raise ValueError(
                f"heartbeat_ttl_s ({self.heartbeat_ttl_s}) must exceed heartbeat_interval_s ({self.heartbeat_interval_s})"
            )
        return self


class GatewaySettings(BaseModel):
    gateway_id: str | None = Field(None, description="unique id (default: host-pid-random)")
    host: str = Field("127.0.0.1", description="listen address (0.0.0.0 in containers)")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port of the OpenAI API")
    listen_fd: int | None = Field(None, ge=0, description="serve on this inherited listening socket instead of "
                                  "binding host:port (the launcher binds the port itself: a port in use fails at "
                                  "once, and nothing can take it while the gateway starts)")
    api_keys: str = Field("", description="comma-separated accepted bearer tokens; empty = no auth")
    max_queued_requests: int = Field(512, ge=1, description="in-flight requests beyond which new ones get 429")
    max_queued_prompt_tokens: int = Field(1_000_000, ge=1, description="in-flight prompt tokens beyond which 429")
    max_body_bytes: int = Field(4 * 2**20, ge=1024, description="larger request bodies get 413")
    request_timeout_s: float = Field(600.0, gt=0, description="per-request deadline")
    default_max_tokens: int = Field(16, ge=1, description="max_tokens when a completions request gives none")
    max_n: int = Field(16, ge=1, description="cap on the n parameter")

    @property
    def api_key_list(self) -> list[str]:
        return [k.strip() for k in self.api_keys.split(",") if k.strip()]


class RoutingSettings(BaseModel):
    """How the gateway picks workers by what they cache (services/gateway/router.py)."""

    enabled: bool = Field(True, description="route by cached prefix; off (or with no KV events from the workers) "
                          "every request goes to the shared requests stream and decode is chosen by load")
    load_weight: float = Field(0.0, ge=0, description="prefill: one queued prompt token ahead costs this many "
                               "cached tokens (0: the cache decides while max_imbalance_tokens holds, as "
                               "SGLang's router does; measured best of 0, 1 and 4 by bench-routing)")
    max_imbalance_tokens: int = Field(4096, ge=0, description="prefill workers queued this many prompt tokens "
                                      "beyond the least queued one get no routed requests")
    max_decode_imbalance_requests: int = Field(4, ge=0, description="decode workers running this many requests "
                                               "beyond the least busy one get no hint")
    min_advantage_blocks: int = Field(2, ge=1, description="route by cache only when the best worker caches at "
                                      "least this many blocks more than the worst candidate")
    local_prefill_max_tokens: int = Field(256, ge=0, description="a request whose best decode worker caches all "
                                          "of its prompt but at most this many tokens is prefilled on that worker, "
                                          "with no prefill worker and no KV handoff (0: never)")


class PlannerSettings(BaseModel):
    """Damping of the pool planner (services/pool_planner), which sizes the pools to the latency targets."""

    target_load: float = Field(0.8, gt=0, le=1, description="a pool whose load (share of its targets used) "
                               "stays above this gets a worker")
    low_load: float = Field(0.4, gt=0, lt=1, description="a pool gives a worker back when its load would stay "
                            "below this without it")
    window_s: float = Field(10.0, gt=0, description="the heartbeats over which load is measured")
    scale_up_after_s: float = Field(10.0, ge=0, description="load above target_load this long adds a worker")
    scale_down_after_s: float = Field(60.0, ge=0, description="load below low_load this long drains a worker")
    hold_s: float = Field(30.0, ge=0, description="no second change of a pool within this long of the last")
    interval_s: float = Field(2.0, gt=0, description="how often the planner looks")

    @model_validator(mode="after")
    def _low_below_target(self) -> PlannerSettings:
        if self.low_load >= self.target_load:
            raise ValueError(f"low_load ({self.low_load}) must be below target_load ({self.target_load})")
        return self


class WorkerServiceSettings(EngineServiceSettings):
    """Settings of a prefill or decode worker process."""

    worker: WorkerSettings = WorkerSettings()


class GatewayServiceSettings(_Base):
    gateway: GatewaySettings = GatewaySettings()
    model: ModelSettings = ModelSettings()
    planner: PlannerSettings = PlannerSettings()
    routing: RoutingSettings = RoutingSettings()


class PlannerServiceSettings(_Base):
    """What the launcher's --planner reads."""

    planner: PlannerSettings = PlannerSettings()


def service_settings() -> list[type[BaseSettings]]:
    """Every service's settings class: each subclass of `_Base`, all defined above."""
    found: list[type[BaseSettings]] = []
    pending: list[type[BaseSettings]] = [_Base]
    while pending:
        cls = pending.pop()
        found.append(cls)
        pending.extend(cls.__subclasses__())
    return found


def env_names(model: type[BaseModel], prefix: str = ENV_PREFIX) -> set[str]:
    """The variable of every field, nested sections joined with `__` as pydantic-settings does."""
    names: set[str] = set()
    for field_name, field in model.model_fields.items():
        name = prefix + field_name.upper()
        names.add(name)
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            names |= env_names(field.annotation, name + "__")
    return names


def unknown_settings(environ: Mapping[str, str]) -> dict[str, str | None]:
    """Each `LLMD_` variable of `environ` that names no setting, with the closest setting's name (None if none is
    close). A name is known when any service reads it, since the launcher gives them all one environment; names
    compare as pydantic-settings compares them, without regard to case."""
    known = set().union(*(env_names(settings) for settings in service_settings()))
    # a section's name is known (it takes JSON) but makes a poor suggestion: suggest fields only
    fields = [name for name in known if not any(other.startswith(name + "__") for other in known)]
    unknown = sorted(name for name in environ if name.upper().startswith(ENV_PREFIX) and name.upper() not in known)
    return {name: next(iter(difflib.get_close_matches(name.upper(), fields, n=1)), None) for name in unknown}


def warn_unknown_settings(environ: Mapping[str, str] = os.environ) -> None:
    """Log one warning per `LLMD_` variable that names no setting; call once, where a process builds its settings."""
    for name, closest in unknown_settings(environ).items():
        hint = f"; did you mean {closest}?" if closest else ""
        logger.warning("%s is not a setting and is ignored%s", name, hint)
