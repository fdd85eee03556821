"""KV over a plain TCP socket of the project's own, worker to worker across hosts: no third-party
service, and no copy on either side where the pool is in host memory (the bytes leave from the
prefill worker's pool blocks and land in the decode worker's reserved ones).

    prefill: TcpSender                             decode: TcpReceiver on kv_tcp_host:kv_tcp_port
      connect -------------------------------------> refused unless a live prefill heartbeat names the address
      frame TransferHeader ------------------------> `claim`: token, req_id, attempt, sender, block and
                                                      byte counts checked against the reservation
      <--------------------------------------------- frame {ok} | {error}
      the blocks' bytes (sendmsg from the pool) ----> recvmsg_into the reserved blocks' memory, nothing else
      <--------------------------------------------- frame {ok}: every byte landed (`settle`) | {error}

A frame is a u32 LE length and a msgpack map. The bytes are those of `Engine.read_blocks`, in
its order; or, where the header says `num_layers`, frames of one layer's blocks each, in any order
(`recv_layers`, sent by tcp_layers.py while the prefill computes them). Each end runs its socket on a helper thread under one deadline for the whole
transfer (`timeout_s`), so a stalled or dead peer ends it within that bound. The receiver only
reports that the bytes landed; the decode worker commits the blocks on the KVReady that the
prefill worker sends after the last frame, so a half-written block never joins a step.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import msgpack

from services.kv_transfer.base import KVTransferError

logger = logging.getLogger(__name__)

TCP_SCHEME = "tcp:"
MAX_FRAME_BYTES = 64 * 1024
IOV_BATCH = 256  # buffers per sendmsg/recvmsg_into call: 3 MiB of float32 SmolLM2 blocks
SOCKET_BUFFER_BYTES = 4 * 2**20

T = TypeVar("T")


@dataclass(slots=True, frozen=True)
class TransferHeader:
    """What a sender says before the bytes: the reservation's one-time token (HandoffAccept.kv_token)
    and what it is about to send."""

    token: str
    req_id: str
    attempt: int
    prefill_id: str
    num_blocks: int
    num_bytes: int
    num_layers: int = 0  # > 0: the bytes come layer by layer, in frames (tcp_layers.py)

    @classmethod
    def from_frame(cls, body: dict[str, Any]) -> TransferHeader:
        try:
            return cls(
                token=str(body["token"]), req_id=str(body["req_id"]), attempt=int(body["attempt"]),
                prefill_id=str(body["prefill_id"]), num_blocks=int(body["num_blocks"]),
                num_bytes=int(body["num_bytes"]), num_layers=int(body.get("num_layers", 0)),
            )  # fmt: skip
        except (KeyError, TypeError, ValueError) as e:
            raise KVTransferError(f"malformed KV transfer header: {e!r}") from e


Claim = Callable[[TransferHeader, str], Awaitable[list[memoryview]]]  # raises KVTransferError to refuse
Settle = Callable[[TransferHeader, str | None], Awaitable[None]]  # the error, or None: every byte landed
IsPeer = Callable[[str], Awaitable[bool]]


# -- blocking socket I/O under a deadline (helper threads) --------------------------------------


def _arm(sock: socket.socket, deadline: float) -> None:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise KVTransferError("the KV transfer ran past its deadline")
    sock.settimeout(remaining)


def _advance(views: list[memoryview], i: int, offset: int, num: int) -> tuple[int, int]:
    """(first view not yet done, bytes of it done) after `num` more bytes from view i at offset."""
    num += offset
    while i < len(views) and num >= len(views[i]):
        num -= len(views[i])
        i += 1
    return i, num


def send_views(sock: socket.socket, views: list[memoryview], deadline: float) -> None:
    i, offset = 0, 0
    while i < len(views):
        _arm(sock, deadline)
        try:
            sent = sock.sendmsg([views[i][offset:], *views[i + 1 : i + IOV_BATCH]])
        except TimeoutError as e:
            raise KVTransferError("the KV transfer ran past its deadline: the peer stopped reading") from e
        i, offset = _advance(views, i, offset, sent)


def recv_into_views(sock: socket.socket, views: list[memoryview], deadline: float) -> None:
    """Fill `views` exactly, in order; a peer that closes first is an error."""
    i, offset = 0, 0
    while i < len(views):
        _arm(sock, deadline)
        try:
            received = sock.recvmsg_into([views[i][offset:], *views[i + 1 : i + IOV_BATCH]])[0]
        except TimeoutError as e:
            raise KVTransferError("the KV transfer ran past its deadline: the peer stopped sending") from e
        if received == 0:
            done = sum(len(v) for v in views[:i]) + offset
            raise KVTransferError(f"the peer closed the connection after {done} of {sum(map(len, views))} bytes")
        i, offset = _advance(views, i, offset, received)


def recv_layers(sock: socket.socket, views: list[memoryview], num_layers: int, idle_s: float) -> None:
    """Fill `views` (per block, per layer, K then V: `Engine.kv_block_views`' order) from frames
    {layer, first, count} each followed by those blocks' K and V bytes of that layer, in any
    order, each block of each layer once; {wait} frames only say the sender is alive. The peer
    may be silent at most `idle_s` at a time: a long prefill sends as it computes."""
    per_block = 2 * num_layers
    num_blocks, leftover = divmod(len(views), per_block)
    if leftover:
        raise KVTransferError(f"{len(views)} pieces of memory cannot hold whole blocks of {num_layers} layers")
    landed = [bytearray(num_blocks) for _ in range(num_layers)]
    remaining = num_blocks * num_layers
    while remaining:
        deadline = time.monotonic() + idle_s
        frame = recv_frame(sock, deadline)
        if frame.get("wait") is True:
            continue
        try:
            layer, first, count = int(frame["layer"]), int(frame["first"]), int(frame["count"])
        except (KeyError, TypeError, ValueError) as e:
            raise KVTransferError(f"malformed KV layer frame {frame!r}: {e!r}") from e
        if not (0 <= layer < num_layers and 0 <= first and 0 < count and first + count <= num_blocks):
            raise KVTransferError(f"KV layer frame {frame!r} is outside {num_blocks} blocks of {num_layers} layers")
        if any(landed[layer][first : first + count]):
            raise KVTransferError(f"blocks {first}-{first + count - 1} of layer {layer} were sent twice")
        blocks = range(first, first + count)
        recv_into_views(sock, [views[b * per_block + 2 * layer + kv] for b in blocks for kv in (0, 1)], deadline)
        landed[layer][first : first + count] = b"\x01" * count
        remaining -= count


def send_frame(sock: socket.socket, body: dict[str, Any], deadline: float) -> None:
    data = msgpack.packb(body)
    send_views(sock, [memoryview(len(data).to_bytes(4, "little") + data)], deadline)


def recv_frame(sock: socket.socket, deadline: float) -> dict[str, Any]:
    size = bytearray(4)
    recv_into_views(sock, [memoryview(size)], deadline)
    num = int.from_bytes(size, "little")
    if num > MAX_FRAME_BYTES:
        raise KVTransferError(f"a KV transfer frame of {num} bytes; the limit is {MAX_FRAME_BYTES}")
    data = bytearray(num)
    recv_into_views(sock, [memoryview(data)], deadline)
    try:
        body = msgpack.unpackb(bytes(data))
    except (ValueError, msgpack.UnpackException) as e:
        raise KVTransferError(f"undecodable KV transfer frame: {e!r}") from e
    if not isinstance(body, dict):
        raise KVTransferError(f"a KV transfer frame is a {type(body).__name__}, expected a map")
    return body


def expect_ok(body: dict[str, Any], what: str) -> None:
    if body.get("ok") is not True:
        raise KVTransferError(f"{what}: {body.get('error', body)}")


def shut_down(sock: socket.socket) -> None:
    """End a connection that a helper thread may be blocked on (closing it would not wake it)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # already closed by the peer
        pass


def tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)


# -- the two ends --------------------------------------------------------------------------------


class TcpSender:
    """The prefill side: one blocking connection per transfer, on a helper thread."""

    def send(self, host: str, port: int, header: TransferHeader, views: list[memoryview], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        where = f"{host}:{port}"
        try:
            with socket.create_connection((host, port), timeout=timeout_s) as sock:
                tune(sock)
                send_frame(sock, asdict(header), deadline)
                expect_ok(recv_frame(sock, deadline), f"{where} refused the KV of {header.req_id}")
                self._send_payload(sock, views, deadline)
                expect_ok(recv_frame(sock, deadline), f"{where} did not take the KV of {header.req_id}")
        except (OSError, KVTransferError) as e:
            raise KVTransferError(f"KV transfer of {header.req_id} to {where} failed: {e}") from e

    def _send_payload(self, sock: socket.socket, views: list[memoryview], deadline: float) -> None:
        send_views(sock, views, deadline)


class TcpReceiver:
    """The decode side: a listening socket on the event loop, each transfer on a helper thread.

    `is_peer(host)` says whether a live worker's heartbeat names the connecting address; `claim`
    checks a header against the reservation and returns the memory the bytes go to (the
    reserved blocks); `settle` hears how it ended. `stop` ends a transfer in progress (a cancel,
    an expired reservation) and returns once nothing writes into its blocks any more.
    """

    def __init__(self, host: str, port: int, timeout_s: float, is_peer: IsPeer, claim: Claim, settle: Settle) -> None:
        self.host, self.port, self.timeout_s = host, port, timeout_s
        self.is_peer, self.claim, self.settle = is_peer, claim, settle
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._receiving: dict[tuple[str, int], tuple[socket.socket, asyncio.Future[None]]] = {}
        self._connections: set[asyncio.Task[None]] = set()
        self._started: dict[socket.socket, asyncio.Future[None]] = {}  # open connections' helper threads

    async def start(self) -> int:
        """Listen; returns the port (a free one where `port` is 0)."""
        self._loop = asyncio.get_running_loop()
        listener = socket.create_server((self.host, self.port), backlog=64, reuse_port=False)
        listener.setblocking(False)
        self._listener = listener
        self.port = listener.getsockname()[1]
        self._accepting = asyncio.create_task(self._accept_loop(), name="kv-tcp-accept")
        return self.port

    async def close(self) -> None:
        if self._accepting is not None:
            self._accepting.cancel()
        if self._listener is not None:
            self._listener.close()
        self._receiving.clear()
        for conn in list(self._started):
            shut_down(conn)
        # the helper threads end once their sockets are shut; none may outlive the loop they call into
        await asyncio.gather(*self._started.values(), *self._connections, return_exceptions=True)

    async def stop(self, req_id: str, attempt: int) -> None:
        receiving = self._receiving.pop((req_id, attempt), None)
        if receiving is None:
            return
        conn, done = receiving
        shut_down(conn)
        await asyncio.wait([done])

    async def _accept_loop(self) -> None:
        assert self._listener is not None and self._loop is not None
        while True:
            conn, address = await self._loop.sock_accept(self._listener)
            task = asyncio.create_task(self._serve(conn, address[0]))
            self._connections.add(task)
            task.add_done_callback(self._connections.discard)

    async def _serve(self, conn: socket.socket, host: str) -> None:
        with conn:
            try:
                known = await self.is_peer(host)
            except Exception as e:  # Redis unreachable: nobody is known
                logger.warning("refused a KV connection from %s: could not check the live workers (%s)", host, e)
                return
            if not known:
                logger.warning("refused a KV connection from %s: no live worker's heartbeat names that address", host)
                return
            conn.setblocking(True)
            tune(conn)
            done: asyncio.Future[None] = asyncio.ensure_future(asyncio.to_thread(self._receive, conn, host))
            self._started[conn] = done  # before the thread runs: it starts at the loop's next turn
            try:
                await asyncio.shield(done)
            except (OSError, KVTransferError) as e:
                logger.warning("KV transfer from %s failed: %s", host, e)
            finally:
                del self._started[conn]

    def _receive(self, conn: socket.socket, host: str) -> None:
        """One connection, on a helper thread; the loop runs `claim` and `settle`."""
        deadline = time.monotonic() + self.timeout_s
        header = TransferHeader.from_frame(recv_frame(conn, deadline))
        try:
            views = self._on_loop(self._claim(header, host, conn))
        except KVTransferError as e:
            send_frame(conn, {"ok": False, "error": str(e)}, deadline)
            raise
        error: str | None = None
        try:
            send_frame(conn, {"ok": True}, deadline)
            self._recv_payload(conn, header, views, deadline)
        except (OSError, KVTransferError) as e:
            error = str(e) or type(e).__name__
        self._on_loop(self._settle(header, error))
        if error is not None:
            raise KVTransferError(f"KV of {header.req_id}: {error}")
        send_frame(conn, {"ok": True}, time.monotonic() + self.timeout_s)

    def _recv_payload(self, conn: socket.socket, header: TransferHeader, views: list[memoryview],
                      deadline: float) -> None:
        """The bytes, under one deadline for the whole, or with a layered header (tcp_layers.py)
        under a bound on each silence, since they come as the prefill computes them."""
        if header.num_layers:
            recv_layers(conn, views, header.num_layers, self.timeout_s)
        else:
            recv_into_views(conn, views, deadline)

    async def _claim(self, header: TransferHeader, host: str, conn: socket.socket) -> list[memoryview]:
        views = await self.claim(header, host)
        total = sum(len(v) for v in views)
        if total != header.num_bytes:  # the claim checked it; this guards the views it returned
            raise KVTransferError(f"the reservation holds {total} bytes, the sender announced {header.num_bytes}")
        # registered in the same loop turn as the claim: a `stop` from now on finds the transfer
        self._receiving[(header.req_id, header.attempt)] = (conn, self._started[conn])
        return views

    async def _settle(self, header: TransferHeader, error: str | None) -> None:
        self._receiving.pop((header.req_id, header.attempt), None)
        await self.settle(header, error)

    def _on_loop(self, coro: Coroutine[Any, Any, T]) -> T:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()
