"""KV over NIXL (NVIDIA's transfer library, which vLLM, SGLang and Dynamo use; its UCX backend moves
host memory over TCP or RDMA): the decode worker READs the prefill worker's pool blocks straight
into its reserved ones, with no copy on either side.

    prefill                                          decode
      pool registered with its agent at start          pool registered with its agent at start
      heartbeat: kv_nixl = agent metadata + layout
      KVReady(location nixl:<agent>;<its blocks>) -->  blocks and bytes checked against the reservation
                                                       metadata of that live worker's heartbeat loaded
      serves the read (progress) <------------------   READ its blocks -> the reserved blocks, notification
      notification: its blocks may be released         DONE: commit (the request joins the next step)

Why the decode worker reads (as vLLM's NixlConnector does): the reserved blocks are then written
by nobody but their owner, which ends its read (releasing the request cancels it, and the
peer's connection is dropped) before a cancel or an expired reservation frees them; a WRITE
from the prefill worker could still be landing in blocks already handed to another request.
The reader also sees completion itself and commits without waiting for another message.

No progress thread: the wrapper's busy-polls about a core per agent even when idle (0.6 of a
core measured on 2 loaded cores). Each worker makes every call into its agent on one helper
thread of its own, which polls (every POLL_PAUSE_S) only while a transfer is in flight: a read on the decode side;
on the prefill side the wait for a read's notification, which also serves the read (over TCP,
UCX moves the bytes of a READ only while the side being read progresses). Every operation
has a deadline (handoff_timeout_s).
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import astuple, dataclass
from typing import Any

import msgpack
import numpy as np

from services.kv_transfer.base import KVTransferError

logger = logging.getLogger(__name__)

NIXL_SCHEME = "nixl:"
BACKEND = "UCX"
# between two rounds of progress while a transfer is in flight: each round moves whatever the
# sockets hold, and on 2 loaded cores polling without a pause moved 64 MiB at 0.1-0.4 GB/s where
# a 0.05-1 ms pause gave 0.7-0.9 GB/s, at a fraction of the CPU
POLL_PAUSE_S = 1e-4
_BUILDS = ("nixl._api", "nixl_cu13._api", "nixl_cu12._api")  # the meta-package picks the CUDA build; else any


def nixl_api() -> Any | None:
    """NIXL's Python API, or None where no build of it is installed (`pip install nixl-cu12`)."""
    for name in _BUILDS:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    return None


def address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


@dataclass(frozen=True, slots=True)
class PoolLayout:
    """Where a pool's blocks lie: segment s (one layer's K or V) of block b is `segment` bytes at
    base + b * block_stride + s * segment_stride, in the order of `Engine.kv_block_views`."""

    base: int
    num_blocks: int
    num_segments: int
    segment: int
    block_stride: int
    segment_stride: int

    @classmethod
    def of(cls, pool: memoryview, block_views: Callable[[list[int]], list[memoryview] | None]) -> PoolLayout:
        """The layout of `pool` (`Engine.kv_pool_view`), read off the views of its first two blocks
        and checked against its last one."""
        first, second = block_views([0]), block_views([1])
        assert first is not None and second is not None, "a pool in host memory has views"
        base, segment, num_segments = address(first[0]), len(first[0]), len(first)
        block_stride = address(second[0]) - base
        segment_stride = address(first[1]) - base if num_segments > 1 else segment
        span = (num_segments - 1) * segment_stride + segment  # of one block, from its first byte
        num_blocks = (address(pool) + len(pool) - base - span) // block_stride + 1
        layout = cls(base, num_blocks, num_segments, segment, block_stride, segment_stride)
        last = block_views([num_blocks - 1])
        assert last is not None and [address(v) for v in last] == layout.descriptors([num_blocks - 1])[:, 0].tolist(), (
            "the pool's blocks are not laid out at a fixed stride"
        )
        return layout

    def descriptors(self, block_ids: Sequence[int]) -> np.ndarray:
        """[address, length, device] of every segment of these blocks, block by block: NIXL's Nx3
        transfer descriptors. Raises KVTransferError for a block outside the pool."""
        blocks = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        outside = blocks[(blocks < 0) | (blocks >= self.num_blocks)]
        if outside.size:
            raise KVTransferError(f"KV blocks {sorted(set(outside.tolist()))} outside a pool of {self.num_blocks}")
        segments = np.arange(self.num_segments, dtype=np.uint64) * np.uint64(self.segment_stride)
        starts = np.uint64(self.base) + blocks.astype(np.uint64)[:, None] * np.uint64(self.block_stride) + segments
        out = np.zeros((starts.size, 3), dtype=np.uint64)
        out[:, 0], out[:, 1] = starts.reshape(-1), self.segment
        return out


def parse_location(location: str) -> tuple[str, list[int]]:
    """(the prefill worker's agent name, its pool blocks) of a NIXL location."""
    agent, _, blocks = location.removeprefix(NIXL_SCHEME).rpartition(";")
    try:
        return agent, [int(b) for b in blocks.split(",") if b]
    except ValueError as e:
        raise KVTransferError(f"malformed NIXL location {location!r}") from e


def location_of(agent: str, block_ids: Sequence[int]) -> str:
    return f"{NIXL_SCHEME}{agent};{','.join(map(str, block_ids))}"


def notification(req_id: str, attempt: int) -> bytes:
    return msgpack.packb([req_id, attempt])


# -- the helper thread ----------------------------------------------------------------------------


class _Operation(ABC):
    """One call sequence into the agent, on the helper thread: `begin`, then `poll` until it
    returns True (done), raises, passes its deadline or is stopped; `end` always runs."""

    def __init__(self, timeout_s: float) -> None:
        self.deadline = time.monotonic() + timeout_s
        self.stopped = False  # set from the event loop; read on the helper thread
        self.future: asyncio.Future[None] | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    def begin(self, transport: NixlTransport) -> None:
        pass

    @abstractmethod
    def poll(self, transport: NixlTransport) -> bool:
        """One round of progress; True once the operation is done."""

    def end(self, transport: NixlTransport, error: BaseException | None) -> None:
        pass

    def settle(self, error: BaseException | None) -> None:
        assert self.loop is not None and self.future is not None
        future = self.future

        def resolve() -> None:
            if future.done():
                return
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)

        self.loop.call_soon_threadsafe(resolve)


class _Read(_Operation):
    """The decode side: READ `source` blocks of a peer's pool into `dest` blocks of this one."""

    def __init__(self, peer: str, advertisement: bytes, source: list[int], dest: list[int], note: bytes,
                 timeout_s: float) -> None:
        super().__init__(timeout_s)
        self.peer, self.advertisement, self.source, self.dest, self.note = peer, advertisement, source, dest, note
        self.handle: Any = None

    def begin(self, transport: NixlTransport) -> None:
        layout = transport.load_peer(self.peer, self.advertisement)
        local = transport.layout
        assert local is not None
        if (layout.segment, layout.num_segments) != (local.segment, local.num_segments):
            raise KVTransferError(
                f"{self.peer}'s blocks are {layout.num_segments} segments of {layout.segment} bytes, this pool's "
                f"{local.num_segments} of {local.segment}"
            )
        agent = transport.agent
        remote = agent.get_xfer_descs(layout.descriptors(self.source), "DRAM")
        into = agent.get_xfer_descs(local.descriptors(self.dest), "DRAM")
        self.handle = agent.initialize_xfer("READ", into, remote, self.peer, self.note)
        if agent.transfer(self.handle) == "ERR":
            raise KVTransferError(f"NIXL refused to start the read from {self.peer}")

    def poll(self, transport: NixlTransport) -> bool:
        state = transport.agent.check_xfer_state(self.handle)
        if state == "ERR":
            raise KVTransferError(f"the NIXL read from {self.peer} failed (the peer died or dropped the connection)")
        return state == "DONE"

    def end(self, transport: NixlTransport, error: BaseException | None) -> None:
        try:
            if self.handle is not None:
                # releasing a read in flight cancels it: nothing lands in the blocks from here on
                transport.agent.release_xfer_handle(self.handle)
        finally:
            if error is not None:
                transport.drop_peer(self.peer)  # and its connection: the next transfer starts afresh


class _ReadEnd(_Operation):
    """The prefill side: progress (which serves the read) until `peer` says it read the blocks."""

    def __init__(self, peer: str, note: bytes, timeout_s: float) -> None:
        super().__init__(timeout_s)
        self.peer, self.note = peer, note

    def poll(self, transport: NixlTransport) -> bool:
        return transport.take_notification(self.peer, self.note)


_CLOSE = object()


class NixlTransport:
    """One worker's NIXL agent over its KV pool. Every call into the agent runs on one helper
    thread (the agent is not thread-safe without locks of its own), which sleeps while nothing
    is in flight."""

    def __init__(self, name: str, timeout_s: float, devices: str = "") -> None:
        self.name = name
        self.timeout_s = timeout_s
        self.devices = devices  # the network devices UCX listens and connects on ("lo"); empty: every one
        self.agent: Any = None
        self.layout: PoolLayout | None = None
        self.advertisement = b""  # WorkerStatus.kv_nixl; empty until the pool is registered
        self._peers: dict[str, tuple[bytes, PoolLayout]] = {}  # agent name -> its advertisement, layout
        self._notes: dict[str, dict[bytes, float]] = {}  # notifications not yet taken, with when they came
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._reads: dict[tuple[str, int], _Read] = {}

    def register(self, pool: memoryview, block_views: Callable[[list[int]], list[memoryview] | None]) -> None:
        """Create the agent (UCX backend, no progress thread) and register the pool's memory."""
        api = nixl_api()
        if api is None:
            raise RuntimeError("NIXL is not installed (pip install nixl-cu12)")
        if self.devices:  # read by UCX as it starts (the backend's own `ucx_devices` leaves it listening on all)
            os.environ.setdefault("UCX_NET_DEVICES", self.devices)
        self.agent = api.nixl_agent(self.name, api.nixl_agent_config(enable_prog_thread=False, backends=[BACKEND]))
        if BACKEND not in self.agent.backends:
            raise RuntimeError(f"NIXL has no {BACKEND} backend here (its plugins: {self.agent.get_plugin_list()})")
        self.layout = PoolLayout.of(pool, block_views)
        self.agent.register_memory([(address(pool), len(pool), 0, "")], "DRAM")
        self.advertisement = msgpack.packb({"md": self.agent.get_agent_metadata(), "layout": astuple(self.layout)})
        self._thread = threading.Thread(target=self._run, name="nixl", daemon=True)
        self._thread.start()

    async def close(self) -> None:
        if self._thread is not None:
            self._inbox.put(_CLOSE)
            await asyncio.to_thread(self._thread.join)

    # -- what the workers call ---------------------------------------------------------------------

    async def read(self, location: str, peer: str, advertisement: bytes, dest: list[int], req_id: str,
                   attempt: int) -> None:
        """Read `peer`'s blocks that a KVReady's `location` names into this pool's `dest` blocks;
        raises KVTransferError unless every byte landed. `stop` ends it early."""
        named, source = parse_location(location)
        if named != peer:
            raise KVTransferError(f"the KV of {req_id!r} is {peer}'s to send; its location names {named!r}")
        if len(source) != len(dest):
            raise KVTransferError(f"{len(source)} KV blocks offered for {req_id!r}; its reservation holds {len(dest)}")
        op = _Read(peer, advertisement, source, dest, notification(req_id, attempt), self.timeout_s)
        self._reads[(req_id, attempt)] = op
        try:
            await self._submit(op)
        finally:
            if self._reads.get((req_id, attempt)) is op:
                del self._reads[(req_id, attempt)]

    async def stop(self, req_id: str, attempt: int) -> None:
        """End a read into this pool, if one runs; returns once nothing writes its blocks."""
        op = self._reads.get((req_id, attempt))
        if op is not None and op.future is not None:
            op.stopped = True
            await asyncio.wait([op.future])

    async def until_read(self, peer: str, req_id: str, attempt: int) -> None:
        """Serve `peer`'s read of a transfer until it says it has the bytes (or the deadline:
        by then the peer has given up on it too, and the blocks may go)."""
        await self._submit(_ReadEnd(peer, notification(req_id, attempt), self.timeout_s))

    async def _submit(self, op: _Operation) -> None:
        if self._thread is None:
            raise KVTransferError("NIXL is not set up on this worker (its KV pool is not registered)")
        op.loop = asyncio.get_running_loop()
        op.future = op.loop.create_future()
        self._inbox.put(op)
        try:
            await asyncio.shield(op.future)
        except asyncio.CancelledError:
            op.stopped = True
            raise

    # -- on the helper thread ----------------------------------------------------------------------

    def load_peer(self, name: str, advertisement: bytes) -> PoolLayout:
        known = self._peers.get(name)
        if known is not None and known[0] == advertisement:
            return known[1]
        if known is not None:  # the worker restarted under the same id
            self.drop_peer(name)
        try:
            ad = msgpack.unpackb(advertisement)
            layout = PoolLayout(*(int(x) for x in ad["layout"]))
            loaded = self.agent.add_remote_agent(ad["md"])
        except Exception as e:  # NIXL raises its own error types for metadata it cannot load
            raise KVTransferError(f"could not load {name}'s NIXL metadata: {e}") from e
        loaded = loaded.decode() if isinstance(loaded, bytes) else loaded  # names come back as bytes
        if loaded != name:
            self.agent.remove_remote_agent(loaded)
            raise KVTransferError(f"the NIXL metadata advertised by {name} is agent {loaded!r}'s")
        self._peers[name] = (advertisement, layout)
        return layout

    def drop_peer(self, name: str) -> None:
        if self._peers.pop(name, None) is not None:
            try:
                self.agent.remove_remote_agent(name)
            except Exception as e:  # already disconnected: nothing is left to drop
                logger.debug("removing NIXL agent %s: %s", name, e)

    def take_notification(self, peer: str, note: bytes) -> bool:
        notes = self._notes.get(peer)
        if notes is not None and notes.pop(note, None) is not None:
            return True
        return False

    def _collect_notifications(self) -> None:
        now = time.monotonic()
        for peer, messages in self.agent.get_new_notifs().items():
            notes = self._notes.setdefault(peer.decode() if isinstance(peer, bytes) else peer, {})
            notes.update(dict.fromkeys(messages, now))
        for notes in self._notes.values():  # a notification nobody waits for any more (its wait timed out)
            for note in [n for n, at in notes.items() if now - at > 2 * self.timeout_s]:
                del notes[note]

    def _run(self) -> None:
        pending: list[_Operation] = []
        while True:
            try:
                item = self._inbox.get(block=not pending)  # nothing in flight: sleep, no polling
            except queue.Empty:
                item = None
            if item is _CLOSE:
                for op in pending:
                    self._finish(op, KVTransferError("the worker is stopping"))
                return
            if item is not None:
                try:
                    item.begin(self)
                    pending.append(item)
                except Exception as e:
                    self._finish(item, e)
            if any(isinstance(op, _ReadEnd) for op in pending):
                self._collect_notifications()
            for op in list(pending):
                error: BaseException | None = None
                try:
                    if op.stopped:
                        error = KVTransferError("stopped")
                    elif not op.poll(self):
                        if time.monotonic() < op.deadline:
                            continue
                        error = KVTransferError(f"the NIXL transfer ran past its deadline of {self.timeout_s}s")
                except Exception as e:
                    error = e
                pending.remove(op)
                self._finish(op, error)
            if pending:
                time.sleep(POLL_PAUSE_S)

    def _finish(self, op: _Operation, error: BaseException | None) -> None:
        try:
            op.end(self, error)
        except Exception as e:
            logger.warning("ending a NIXL transfer: %s", e)
        if error is not None and not isinstance(error, KVTransferError):
            error = KVTransferError(f"NIXL: {error}")
        op.settle(error)
