"""What a prefill worker keeps per request it holds, and per reporting interval."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from services.kv_transfer import KVPeer
from services.kv_transfer.tcp_layers import LayerStream
from shared.engine.engine import RequestOutput
from shared.engine.kv_handoff import Handoff
from shared.protocol import GenerateRequest

MIB = 2**20


@dataclass(slots=True)
class Tally:
    """What the worker did since its last report."""

    num_prefilled: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_handoffs: int = 0
    num_handoff_bytes: int = 0
    handoff_s: float = 0.0
    ttft_s: float = 0.0

    def line(self, interval_s: float) -> str | None:
        if not self.num_prefilled and not self.num_handoffs:
            return None
        line = (
            f"last {interval_s:.0f}s: prefilled {self.num_prefilled} requests ({self.num_prompt_tokens} prompt tokens, "
            f"{100 * self.num_cached_tokens / max(1, self.num_prompt_tokens):.0f}% from the prefix cache)"
        )
        if self.num_handoffs:
            line += (
                f"; {self.num_handoffs} handoffs moved {self.num_handoff_bytes / MIB:.1f} MiB at "
                f"{self.num_handoff_bytes / MIB / max(self.handoff_s, 1e-6):.0f} MiB/s, "
                f"{1000 * self.handoff_s / self.num_handoffs:.0f} ms each, "
                f"{100 * self.handoff_s / max(self.ttft_s, 1e-6):.0f}% of TTFT"
            )
        return line


@dataclass(slots=True, eq=False)
class Tracked:
    """A request this worker has read and not yet acknowledged."""

    msg: GenerateRequest
    stream: str  # the requests stream its entry is on: the shared one, or one routed to this worker
    entry_id: bytes
    arrived_at: float  # unix time it entered the requests stream
    prefilled_at: float | None = None  # monotonic
    decode_id: str | None = None  # the decode worker that reserved blocks for it
    peer: KVPeer | None = None  # how to reach it with the KV: its heartbeat's and its accept's KV fields
    cancelled: bool = False
    handoff: asyncio.Task[None] | None = None
    first: RequestOutput | None = None  # what its prefill step gave: the first token
    prefill_over: asyncio.Event = field(default_factory=asyncio.Event)  # `first` is in, or it was cancelled
    kv_stream: LayerStream | None = None  # its KV going layer by layer while it prefills
    # taken on the engine thread right after the step that finished its prefill
    export: Handoff | None = None
    kv_block_ids: list[int] | None = None

    @property
    def req_id(self) -> str:
        return self.msg.req_id

    @property
    def first_index(self) -> int:
        """Output position of the token this worker samples: a re-run continues after the streamed tokens."""
        return len(self.msg.output_token_ids)

    @property
    def num_prefill_tokens(self) -> int:
        return len(self.msg.prompt_token_ids) + len(self.msg.output_token_ids)


def entry_time(entry_id: bytes) -> float:
    """When Redis appended the entry (its id is milliseconds-sequence)."""
    return int(entry_id.split(b"-")[0]) / 1000
