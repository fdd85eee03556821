"""A request's KV over the data port layer by layer, while the prefill computes it: the transfer
overlaps the rest of the prefill, and little of it is left once the first token is out.

    prefill worker                                   decode worker (tcp.py's TcpReceiver)
      offer before the prefill (first_token_pending) -> blocks reserved for every prompt token
      LayerStream: header {..., num_layers} ---------> claimed as any transfer into those blocks
      after each layer of each engine step (engine thread, `LayerStreams.after_layer`): the blocks
      that layer just finished are queued; the stream's own thread sends each run of them as a
      frame {layer, first, count} and their K and V bytes, straight from the pool --> `recv_layers`
      {wait} while nothing is ready, so a long prefill is not taken for a stalled peer
      after the prefill: whatever is left (`finish`) <--- {ok} once every block of every layer landed

A block of a layer is final once every token it holds is computed (the last, partial block: once
the whole prompt is); no later step writes it, since a prefill worker never decodes. A request
preempted meanwhile loses its blocks, and bytes already read from them may be stale, so its stream
fails; the decode worker frees the reservation and the request is offered again.
"""

from __future__ import annotations

import asyncio
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict

from services.kv_transfer.base import KVTransferError
from services.kv_transfer.tcp import TransferHeader, expect_ok, recv_frame, send_frame, send_views, shut_down, tune
from shared.engine.engine import Engine

LayerViews = Callable[[list[int], int], list[memoryview] | None]  # Engine.kv_layer_views


class LayerStream:
    """One request's blocks (table positions `needed`) sent to a decode worker as the prefill
    finishes them. `run` connects and sends on a helper thread until every block of every layer
    landed; the engine thread queues work with `layer_done`, the event loop with `finish`; `abort`
    ends it from anywhere."""

    def __init__(
        self, host: str, port: int, header: TransferHeader, needed: list[int], block_size: int,
        layer_views: LayerViews, timeout_s: float,
    ) -> None:
        self.host, self.port, self.header = host, port, header
        self.needed, self.block_size = needed, block_size
        self.layer_views, self.timeout_s = layer_views, timeout_s
        self._queued = [0] * header.num_layers  # per layer: how many of `needed` are queued
        self._work: queue.SimpleQueue[tuple[int, int, list[int]] | None] = queue.SimpleQueue()
        self._preemptions: int | None = None
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()  # `abort` from the engine thread or the loop vs. the connection
        self._aborted: str | None = None

    async def run(self) -> None:
        """Raises KVTransferError if the transfer fails or is aborted."""
        try:
            await asyncio.to_thread(self._send)
        except (OSError, KVTransferError) as e:
            where = f"{self.host}:{self.port}"
            raise KVTransferError(f"streaming the KV of {self.header.req_id} to {where} failed: "
                                  f"{self._aborted or e}") from e

    def layer_done(self, layer: int, num_computed: int, num_tokens: int, num_preemptions: int,
                   table: list[int]) -> None:
        """A step computed `layer` of the request up to `num_computed` of its `num_tokens` tokens,
        in the pool blocks `table`. On the engine thread."""
        if self._preemptions is None:
            self._preemptions = num_preemptions
        elif num_preemptions != self._preemptions:
            self.abort("the prefill worker preempted the request, which freed the blocks being sent")
            return
        final = -(-num_computed // self.block_size) if num_computed >= num_tokens else num_computed // self.block_size
        self._queue_up_to(layer, final, table)

    def finish(self, table: list[int]) -> None:
        """The prefill is over and `table` is the request's whole block table: queue what is left."""
        for layer in range(self.header.num_layers):
            self._queue_up_to(layer, len(table), table)

    def abort(self, reason: str) -> None:
        with self._lock:
            if self._aborted is None:
                self._aborted = reason
            if self._sock is not None:
                shut_down(self._sock)
        self._work.put(None)

    def _queue_up_to(self, layer: int, final: int, table: list[int]) -> None:
        first = end = self._queued[layer]
        while end < len(self.needed) and self.needed[end] < final:
            end += 1
        if end > first:
            self._work.put((layer, first, [table[p] for p in self.needed[first:end]]))
            self._queued[layer] = end

    def _send(self) -> None:
        header, idle_s = self.header, self.timeout_s
        with socket.create_connection((self.host, self.port), timeout=idle_s) as sock:
            with self._lock:
                if self._aborted is not None:
                    raise KVTransferError(self._aborted)
                self._sock = sock
            tune(sock)
            send_frame(sock, asdict(header), time.monotonic() + idle_s)
            expect_ok(recv_frame(sock, time.monotonic() + idle_s), f"the decode worker refused the KV of {header.req_id}")
            remaining = len(self.needed) * header.num_layers
            while remaining:
                try:
                    work = self._work.get(timeout=idle_s / 3)
                except queue.Empty:  # the prefill is still on earlier layers or queued behind others
                    send_frame(sock, {"wait": True}, time.monotonic() + idle_s)
                    continue
                if work is None:
                    raise KVTransferError(self._aborted or "aborted")
                layer, first, block_ids = work
                self._send_layer(sock, layer, first, block_ids, time.monotonic() + idle_s)
                remaining -= len(block_ids)
            expect_ok(recv_frame(sock, time.monotonic() + idle_s), f"the decode worker did not take the KV of "
                       f"{header.req_id}")

    def _send_layer(self, sock: socket.socket, layer: int, first: int, block_ids: list[int], deadline: float) -> None:
        views = self.layer_views(block_ids, layer)
        assert views is not None, "streamed only from a pool in host memory"
        send_frame(sock, {"layer": layer, "first": first, "count": len(block_ids)}, deadline)
        send_views(sock, views, deadline)


class LayerStreams:
    """The streams of a prefill worker's requests, fed from the engine thread between layers."""

    def __init__(self) -> None:
        self._streams: dict[str, LayerStream] = {}

    def add(self, req_id: str, stream: LayerStream) -> None:
        self._streams[req_id] = stream

    def remove(self, req_id: str) -> None:
        self._streams.pop(req_id, None)

    def after_layer(self, engine: Engine, layer: int) -> None:
        """The engine's step in progress has computed `layer` (EngineThread.after_layer)."""
        plan = engine.step_plan
        if plan is None or not self._streams:
            return
        for req, num_new, table in zip(plan.reqs, plan.num_new_tokens, plan.block_tables):
            stream = self._streams.get(req.req_id)
            if stream is not None:
                stream.layer_done(layer, req.num_computed_tokens + num_new, req.num_tokens, req.num_preemptions, table)
