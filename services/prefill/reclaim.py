"""Takes over the requests of prefill workers that died.

A request's stream entry is acknowledged only after its handoff, so a worker killed mid-way
leaves its entries pending. A live worker claims entries idle for longer than a heartbeat TTL
whose consumer's heartbeat has lapsed, or that it owns itself without holding them (an earlier
life under the same id, or an admission that crashed). An entry delivered more than
`max_deliveries` times is a poison pill (its admission crashed every time, or it took down the
workers that held it): it goes to the dead-letter stream instead of being tried forever.

Requests a gateway routed to one worker (`requests:<worker_id>`, same consumer group) may also
never have been read by it: once that worker's heartbeat lapses (or it deregistered after a
drain), live workers read its stream as consumers of the group themselves, and delete the
stream once it has been empty and quiet for ROUTED_STREAM_GRACE_S.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from shared.protocol import GenerateRequest, ProtocolError, decode
from shared.streams import PREFILL_GROUP, Bus

DEAD_LETTER_MAXLEN = 10_000
# a gateway routes only to workers whose heartbeat it saw moments ago: after this long, nothing more arrives
ROUTED_STREAM_GRACE_S = 60.0


@dataclass(slots=True)
class Claimed:
    stream: str
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

    async def claim(self, stream: str, count: int, held_entry_ids: set[bytes]) -> list[Claimed]:
        """Claim up to `count` abandoned entries; XCLAIM's idle check makes two claimers never share one."""
        redis = self.bus.redis
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
            Claimed(stream, entry_id, fields or {}, by_id[entry_id]["times_delivered"] + 1,
                    _text(by_id[entry_id]["consumer"]))
            for entry_id, fields in entries
            if entry_id in by_id
        ]

    async def orphaned_streams(self) -> list[tuple[str, str]]:
        """(worker id, stream) of the routed-request streams whose worker is gone."""
        keys, redis = self.bus.keys, self.bus.redis
        worker_ids = sorted(_text(w) for w in await redis.smembers(keys.routed_workers) if _text(w) != self.consumer)
        if not worker_ids:
            return []
        alive = await redis.mget([keys.alive(w) for w in worker_ids])
        return [(w, keys.routed_requests(w)) for w, beat in zip(worker_ids, alive) if beat is None]

    async def read_orphans(self, stream: str, count: int) -> list[Claimed]:
        """Entries routed to a gone worker that it never read, now delivered to this one."""
        reply = await self.bus.redis.xreadgroup(PREFILL_GROUP, self.consumer, {stream: ">"}, count=count)
        return [Claimed(stream, entry_id, fields or {}, 1, "") for _, entries in reply or [] for entry_id, fields in entries]

    async def remove_if_exhausted(self, worker_id: str, stream: str) -> bool:
        """Delete a gone worker's stream once everything in it is acknowledged and it has been quiet
        for ROUTED_STREAM_GRACE_S; True if it was."""
        redis = self.bus.redis
        if not await redis.exists(stream):
            await redis.srem(self.bus.keys.routed_workers, worker_id)
            return True
        groups = await redis.xinfo_groups(stream)
        group = next((g for g in groups if _text(g["name"]) == PREFILL_GROUP), None)
        if group is None or group["pending"] or group.get("lag"):
            return False
        last_ms = int(_text((await redis.xinfo_stream(stream))["last-generated-id"]).split("-")[0])
        if time.time() * 1000 - last_ms < ROUTED_STREAM_GRACE_S * 1000:
            return False
        pipe = redis.pipeline(transaction=True)
        pipe.delete(stream)
        pipe.srem(self.bus.keys.routed_workers, worker_id)
        await pipe.execute()
        return True

    async def dead_letter(self, claimed: Claimed, reason: str) -> None:
        keys = self.bus.keys
        pipe = self.bus.redis.pipeline(transaction=True)
        fields = {**claimed.fields, b"reason": reason.encode(), b"entry_id": claimed.entry_id}
        pipe.xadd(keys.dead_letter, fields, maxlen=DEAD_LETTER_MAXLEN, approximate=True)  # type: ignore[arg-type]
        pipe.xack(claimed.stream, PREFILL_GROUP, claimed.entry_id)
        await pipe.execute()


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
