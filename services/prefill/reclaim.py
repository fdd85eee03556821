"""Takes over the requests of prefill workers that died.

A request's stream entry is acknowledged only after its handoff, so a worker killed mid-way
leaves its entries pending. A live worker claims entries idle for longer than a heartbeat TTL
whose consumer's heartbeat has lapsed, or that it owns itself without holding them (an earlier
life under the same id, or an admission that crashed). An entry delivered more than
`max_deliveries` times is a poison pill (its admission crashed every time, or it took down the
workers that held it): it goes to the dead-letter stream instead of being tried forever.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.protocol import GenerateRequest, ProtocolError, decode
from shared.streams import PREFILL_GROUP, Bus

DEAD_LETTER_MAXLEN = 10_000


@dataclass(slots=True)
class Claimed:
    entry_id: bytes
    fields: dict[bytes, bytes]
    num_deliveries: int  # including this one
    previous_consumer: str

    @property
    def request(self) -> GenerateRequest | None:
        try:
            msg = decode(self.fields[b"m"])
        except (KeyError, ProtocolError):
            return None
        return msg if isinstance(msg, GenerateRequest) else None


class Reclaimer:
    def __init__(self, bus: Bus, consumer: str, min_idle_s: float) -> None:
        self.bus = bus
        self.consumer = consumer
        self.min_idle_ms = int(min_idle_s * 1000)

    async def claim(self, count: int, held_entry_ids: set[bytes]) -> list[Claimed]:
        """Claim up to `count` abandoned entries; XCLAIM's idle check makes two claimers never share one."""
        redis, stream = self.bus.redis, self.bus.keys.requests
        pending = await redis.xpending_range(
            stream, PREFILL_GROUP, min="-", max="+", count=max(count * 4, 16), idle=self.min_idle_ms
        )
        if not pending:
            return []
        consumers = sorted({_text(p["consumer"]) for p in pending})
        alive = await redis.mget([self.bus.keys.alive(c) for c in consumers])
        dead = {c for c, beat in zip(consumers, alive) if beat is None and c != self.consumer}
        abandoned = [
            p for p in pending
            if _text(p["consumer"]) in dead or (_text(p["consumer"]) == self.consumer and p["message_id"] not in held_entry_ids)
        ][:count]
        if not abandoned:
            return []
        by_id = {p["message_id"]: p for p in abandoned}
        entries = await redis.xclaim(
            stream, PREFILL_GROUP, self.consumer, min_idle_time=self.min_idle_ms, message_ids=list(by_id)
        )
        return [
            Claimed(entry_id, fields or {}, by_id[entry_id]["times_delivered"] + 1, _text(by_id[entry_id]["consumer"]))
            for entry_id, fields in entries
            if entry_id in by_id
        ]

    async def dead_letter(self, claimed: Claimed, reason: str) -> None:
        keys = self.bus.keys
        pipe = self.bus.redis.pipeline(transaction=True)
        fields = {**claimed.fields, b"reason": reason.encode(), b"entry_id": claimed.entry_id}
        pipe.xadd(keys.dead_letter, fields, maxlen=DEAD_LETTER_MAXLEN, approximate=True)  # type: ignore[arg-type]
        pipe.xack(keys.requests, PREFILL_GROUP, claimed.entry_id)
        await pipe.execute()


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
