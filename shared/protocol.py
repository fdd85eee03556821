"""Every message that crosses Redis, with its codec. Nothing else builds wire dicts.

Each message is a msgpack map carrying `v` (schema version) and `type`. Flow of one request:

  gateway --GenerateRequest--> requests stream (consumer group "prefill")
  prefill --TokenUpdate(first token)--> replies:<gateway_id>          (TTFT does not wait for decode)
  prefill --HandoffOffer--> inbox:<decode_id>                         (decode picked by load)
  decode  --HandoffAccept(needed block positions | rejected)--> inbox:<prefill_id>
  prefill --KV bytes (tmpfs, data port or Redis: services/kv_transfer), then KVReady--> inbox:<decode_id>
  decode  --TokenUpdate(batched per gateway, every step)--> replies:<gateway_id>
  gateway --Cancel--> inbox of the worker holding the request (and a cancel mark for queued ones)

A gateway may route a request to one prefill worker (requests:<prefill_id>) and name a decode
worker (`decode_hint`); it learns what each worker caches from KVEvents on the kv_events stream
and, after a gap, from the worker's KVSnapshot.

`attempt` fences stale work: a request re-run after a worker died gets attempt + 1 and the
gateway ignores updates of older attempts. `index` (position of the first token of an update
in the output) lets the gateway drop duplicates after a take-over.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, TypeVar

import msgpack

from shared.engine.sampling_params import SamplingParams

SCHEMA_VERSION = 2  # 2: a TokenBatch travels as columns

M = TypeVar("M", bound="Message")
_REGISTRY: dict[str, type[Message]] = {}


class ProtocolError(ValueError):
    pass


@dataclass(slots=True)
class Message:
    TYPE: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # explicit form: slots=True rebuilds the class, so the zero-argument super() would name the old one
        super(Message, cls).__init_subclass__(**kwargs)
        if cls.TYPE:
            _REGISTRY[cls.TYPE] = cls

    def to_wire(self) -> dict[str, Any]:
        # shallow, unlike dataclasses.asdict, which copies every list it meets: msgpack packs the
        # fields as they are, and a step's messages are encoded while the engine waits for the GIL
        body = {f.name: getattr(self, f.name) for f in fields(self)}
        body["v"] = SCHEMA_VERSION
        body["type"] = self.TYPE
        return body

    @classmethod
    def from_wire(cls: type[M], body: dict[str, Any]) -> M:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in body.items() if k in known})


def encode(msg: Message) -> bytes:
    return msgpack.packb(msg.to_wire(), use_bin_type=True)


def decode(data: bytes) -> Message:
    try:
        body = msgpack.unpackb(data, raw=False)
    except (msgpack.UnpackException, ValueError) as e:
        raise ProtocolError(f"undecodable message: {e}") from e
    if not isinstance(body, dict):
        raise ProtocolError(f"message is a {type(body).__name__}, expected a map")
    version = body.get("v")
    if version != SCHEMA_VERSION:
        raise ProtocolError(f"message schema version {version!r}, this build speaks {SCHEMA_VERSION}")
    cls = _REGISTRY.get(body.get("type", ""))
    if cls is None:
        raise ProtocolError(f"unknown message type {body.get('type')!r}")
    try:
        return cls.from_wire(body)
    except TypeError as e:
        raise ProtocolError(f"malformed {cls.TYPE} message: {e}") from e


def decode_as(data: bytes, cls: type[M]) -> M:
    msg = decode(data)
    if not isinstance(msg, cls):
        raise ProtocolError(f"expected a {cls.TYPE} message, got {msg.TYPE}")
    return msg


@dataclass(slots=True)
class GenerateRequest(Message):
    """A prompt to run. `output_token_ids` is non-empty when the gateway re-runs a request
    whose worker died: the new run continues after those tokens."""

    TYPE: ClassVar[str] = "generate"
    req_id: str
    gateway_id: str
    prompt_token_ids: list[int]
    params: dict[str, Any]
    seed: int
    attempt: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    deadline: float | None = None  # unix time after which the request is dropped
    num_deliveries: int = 0
    decode_hint: str | None = None  # the decode worker to offer it first (it caches most of the prompt)

    @property
    def sampling_params(self) -> SamplingParams:
        return SamplingParams.from_dict(self.params)


@dataclass(slots=True)
class TokenUpdate:
    """New tokens of one request; `finish_reason` set on the last update, `error` on failure.

    `worker_id` names the worker holding the request now: the sender, except in the update
    without tokens a prefill worker sends once a handoff is complete, which names the decode
    worker (the gateway re-runs the request if that worker dies)."""

    req_id: str
    attempt: int
    index: int
    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[list[float]]] | None = None  # per token: [[token_id, logprob], ...]
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    worker_id: str = ""
    error: str | None = None


@dataclass(slots=True)
class TokenBatch(Message):
    """All of one step's updates for the requests of one gateway: one round trip per step."""

    TYPE: ClassVar[str] = "tokens"
    updates: list[TokenUpdate]

    def to_wire(self) -> dict[str, Any]:
        """One list per TokenUpdate field, and a field equal in every update (the worker, most
        often) once: a step's batch for a hundred requests packs as a dozen lists, not a
        hundred maps each spelling out its keys (a fifth of the size, a tenth of the time)."""
        updates = self.updates
        columns: dict[str, Any] = {}
        constant: list[str] = []
        for name in _UPDATE_FIELDS:
            column = [getattr(u, name) for u in updates]
            if column and column.count(column[0]) == len(column):
                columns[name] = column[0]
                constant.append(name)
            else:
                columns[name] = column
        return {"v": SCHEMA_VERSION, "type": self.TYPE, "n": len(updates), "constant": constant, "columns": columns}

    @classmethod
    def from_wire(cls, body: dict[str, Any]) -> TokenBatch:
        num, columns, constant = body["n"], body["columns"], set(body["constant"])
        if set(columns) != set(_UPDATE_FIELDS):
            raise TypeError(f"columns {sorted(columns)}, expected {sorted(_UPDATE_FIELDS)}")
        lists = [[columns[name]] * num if name in constant else columns[name] for name in _UPDATE_FIELDS]
        if any(len(column) != num for column in lists):
            raise TypeError(f"a column's length is not the batch's {num} updates")
        return cls(updates=[TokenUpdate(*row) for row in zip(*lists)])


_UPDATE_FIELDS = tuple(f.name for f in fields(TokenUpdate))


@dataclass(slots=True)
class HandoffOffer(Message):
    TYPE: ClassVar[str] = "handoff_offer"
    req_id: str
    attempt: int
    gateway_id: str
    prefill_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    output_logprobs: list[float]
    output_top_logprobs: list[list[list[float]]]
    params: dict[str, Any]
    seed: int
    num_cached_tokens: int
    num_blocks: int
    deadline: float | None = None
    # how the prefill worker's pool stores KV (kernels/kv_quant.py format name): the blocks move as
    # those bytes, so a decode worker with another format refuses the offer; empty: not stated
    kv_cache_dtype: str = ""
    # sent while the prefill runs, to stream its KV layer by layer: the blocks hold every token's KV,
    # and the first sampled token comes with KVReady (num_cached_tokens too)
    first_token_pending: bool = False


@dataclass(slots=True)
class HandoffAccept(Message):
    """Decode's answer: blocks reserved, send these positions; or rejected (no room)."""

    TYPE: ClassVar[str] = "handoff_accept"
    req_id: str
    attempt: int
    decode_id: str
    needed_blocks: list[int] | None  # None: rejected, offer it elsewhere
    kv_shm: str = ""  # the decode worker's shared-memory marker (services/kv_transfer); empty: none
    kv_token: str = ""  # one-time token a TCP transfer into these blocks must show; empty: no TCP
    refused: str = ""  # why this worker can never take the offer (a KV cache dtype mismatch); empty: it may


@dataclass(slots=True)
class KVReady(Message):
    TYPE: ClassVar[str] = "kv_ready"
    req_id: str
    attempt: int
    block_positions: list[int]
    location: str  # connector-specific address of the bytes
    num_bytes: int
    # for an offer with first_token_pending: the token the prefill sampled, as TokenUpdate has it
    first_token_ids: list[int] = field(default_factory=list)
    first_logprobs: list[float] | None = None
    first_top_logprobs: list[list[list[float]]] | None = None
    num_cached_tokens: int = 0


@dataclass(slots=True)
class Cancel(Message):
    """Stop a request. `attempt` fences the cancel: a worker holding a later attempt (the request
    was re-queued meanwhile) ignores it; None cancels whatever attempt is held."""

    TYPE: ClassVar[str] = "cancel"
    req_id: str
    reason: str = "client disconnected"
    attempt: int | None = None

    def covers(self, attempt: int) -> bool:
        """Whether this cancel applies to `attempt` of its request."""
        return self.attempt is None or self.attempt >= attempt


@dataclass(slots=True)
class WorkerStatus(Message):
    """A worker's heartbeat: liveness plus the load figures used to pick a decode worker and to
    plan the pools (`busy_s`, `num_steps` and `num_prefilled` count up from the worker's start)."""

    TYPE: ClassVar[str] = "worker_status"
    worker_id: str
    role: str  # "prefill" | "decode"
    inbox: str
    free_blocks: int
    total_blocks: int
    num_running: int
    num_waiting: int
    timestamp: float
    draining: bool = False
    health_port: int | None = None  # of /health and /metrics, so tools find workers started with port 0
    busy_s: float = 0.0  # seconds spent in engine steps that computed something
    num_steps: int = 0
    num_prefilled: int = 0  # requests whose first token this worker computed
    kv_transports: list[str] = field(default_factory=list)  # what it speaks, best first (services/kv_transfer)
    kv_shm: str = ""  # its shared-memory marker; empty: no shared tmpfs
    kv_host: str = ""  # its address for KV: where its data port listens, where its KV connections come from
    kv_port: int | None = None  # a decode worker's KV data port; None: it receives no KV over TCP
    kv_nixl: bytes = b""  # its NIXL agent metadata and pool layout (services/kv_transfer/nixl.py); empty: none
    num_queued_tokens: int = 0  # prompt tokens admitted and not yet prefilled (prefill workers)


@dataclass(slots=True)
class KVEvents(Message):
    """The net change of a worker's prefix cache since its previous KVEvents: block hashes (chained
    over their prefix, shared/engine/block_pool.py) that became findable or were evicted.

    `seq` counts a worker's messages from 1 within one `epoch` (one process life); a reader that
    sees a gap, or a new epoch, rebuilds that worker from its KVSnapshot."""

    TYPE: ClassVar[str] = "kv_events"
    worker_id: str
    role: str
    epoch: str
    seq: int
    block_size: int
    stored: list[bytes]
    removed: list[bytes]


@dataclass(slots=True)
class KVSnapshot(Message):
    """Every hash a worker's prefix cache holds after its KVEvents number `seq` of `epoch`."""

    TYPE: ClassVar[str] = "kv_snapshot"
    worker_id: str
    role: str
    epoch: str
    seq: int
    block_size: int
    block_hashes: list[bytes]
