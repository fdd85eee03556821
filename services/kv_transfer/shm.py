"""KV through a tmpfs that both workers see (one host, or containers given one /dev/shm)."""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
import secrets
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from services.kv_transfer.base import KVConnector, KVTransferError, num_bytes, pack_header, tensor_bytes, unpack_header

logger = logging.getLogger(__name__)

SHM_SCHEME = "shm:"


class SharedMemoryKVConnector(KVConnector):
    """Transfers between workers that share a tmpfs directory (/dev/shm): one file per transfer,
    written with one copy and mapped by the reader, where Redis costs a round trip per 8 MiB
    chunk and copies through its own memory and two sockets.

    A file is `<header length: u32 LE><msgpack header as in Redis><the tensor's raw bytes>`,
    written under a temporary name and renamed, so a reader never sees half of one. Each
    worker also keeps an empty marker file, `<prefix>worker-<token>`: a prefill worker that
    finds the decode worker's marker in its own directory knows that they share it (containers
    on one host each have their own /dev/shm unless given one). Files have no TTL in a tmpfs, so
    `sweep` removes transfers older than `ttl_s`, which a reader that died left behind, and
    markers not refreshed for as long, which a killed worker left behind.
    """

    def __init__(self, directory: str | Path, namespace: str, ttl_s: float) -> None:
        self.directory = Path(directory)
        self.prefix = f"llmd-{namespace}-"
        self.ttl_s = ttl_s
        self.token = secrets.token_hex(8)
        self._marker = self._worker_marker(self.token)
        self._refresh_failed = False

    def _worker_marker(self, token: str) -> Path:
        return self.directory / f"{self.prefix}worker-{token}"

    def advertise(self) -> bool:
        """Create this worker's marker; False (logged) where the directory cannot take files."""
        try:
            self._marker.touch()
        except OSError as e:
            logger.warning("no KV handoffs through shared memory: %s is not usable (%s)", self.directory, e)
            return False
        return True

    def refresh(self) -> None:
        """Show that this worker is alive: a marker older than ttl_s is swept as a dead worker's.
        A marker that disappeared anyway (removed by hand, or the tmpfs was cleared) is recreated."""
        try:
            os.utime(self._marker)
            self._refresh_failed = False
            return
        except FileNotFoundError:
            pass
        except OSError as e:
            self._warn_once(f"could not refresh the KV marker {self._marker} ({e}); prefill workers may use Redis")
            return
        try:
            self._marker.touch()
        except OSError as e:
            self._warn_once(f"could not recreate the KV marker {self._marker} ({e}); prefill workers may use Redis")
            return
        logger.warning("the KV marker %s had disappeared; recreated it", self._marker)
        self._refresh_failed = False

    def _warn_once(self, message: str) -> None:
        """Log a failed refresh once, not every heartbeat until it succeeds again."""
        if not self._refresh_failed:
            logger.warning("%s", message)
        self._refresh_failed = True

    def withdraw(self) -> None:
        self._marker.unlink(missing_ok=True)

    def shares_with(self, token: str) -> bool:
        """Whether the worker that advertised `token` sees this worker's directory."""
        return bool(token) and token.isalnum() and self._worker_marker(token).exists()

    def _path_of(self, location: str) -> Path:
        """The file a location names, refused unless it is one of this deployment's transfers:
        locations arrive in messages, and `discard` deletes what they name."""
        name = location.removeprefix(SHM_SCHEME)
        path = self.directory / Path(name).name
        if not location.startswith(SHM_SCHEME) or str(path) != name or not path.name.startswith(f"{self.prefix}kv-"):
            raise KVTransferError(f"{location!r} is not a KV transfer in {self.directory}")
        return path

    async def put(self, req_id: str, attempt: int, tensor: torch.Tensor) -> str:
        def copy(out: torch.Tensor) -> None:
            # a memcpy, not a torch copy: on a helper thread that would start a second OpenMP team
            memoryview(out.view(torch.uint8).reshape(-1).numpy())[:] = tensor_bytes(tensor)

        return await self.put_filled(req_id, attempt, tensor.shape, tensor.dtype, copy)

    async def put_filled(
        self, req_id: str, attempt: int, shape: Sequence[int], dtype: torch.dtype,
        fill: Callable[[torch.Tensor], object],
    ) -> str:
        """A transfer whose bytes `fill(out)` writes into `out`, a tensor of that shape and dtype
        over the file's own pages: the KV goes from the pool to shared memory in one copy, with
        no buffer between to allocate and fault in. `fill` runs on a helper thread."""
        name = f"{self.prefix}kv-{secrets.token_hex(8)}-{attempt}"  # req ids come from clients: not in file names
        path = self.directory / name
        await asyncio.to_thread(self._write, path, tuple(shape), dtype, fill)
        return SHM_SCHEME + str(path)

    @staticmethod
    def _write(path: Path, shape: tuple[int, ...], dtype: torch.dtype, fill: Callable[[torch.Tensor], object]) -> None:
        header = pack_header(dtype, shape, 1)
        size = num_bytes(shape, dtype)
        tmp = path.with_name(path.name + ".tmp")
        try:
            with open(tmp, "w+b") as f:
                f.write(len(header).to_bytes(4, "little") + header)
                f.flush()
                offset = 4 + len(header)
                if size:
                    # every page now, or ENOSPC here: a full tmpfs would otherwise kill the process
                    # with SIGBUS in the middle of the copy into the mapping
                    os.posix_fallocate(f.fileno(), 0, offset + size)
                    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # map the pages in one call
                    with mmap.mmap(f.fileno(), offset + size, flags=flags) as mapped:
                        out = torch.frombuffer(mapped, dtype=torch.uint8, offset=offset, count=size)
                        fill(out.view(dtype).view(shape))
                        del out  # the mapping cannot close while a tensor still exports it
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    async def get(self, location: str) -> torch.Tensor:
        return await asyncio.to_thread(self._read, self._path_of(location))

    @staticmethod
    def _read(path: Path) -> torch.Tensor:
        """The file's tensor over a private mapping of its pages: no copy until the pool write,
        and the pages outlive the file's removal for as long as the tensor lives."""
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                # copy-on-write: torch.frombuffer wants a writable buffer, and the file stays as it is
                data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else b""
        except FileNotFoundError as e:
            raise KVTransferError(f"no KV transfer at {str(path)!r} (expired or already discarded)") from e
        if size < 4:
            raise KVTransferError(f"KV transfer at {str(path)!r} holds {size} bytes, not even a header")
        header_len = int.from_bytes(data[:4], "little")
        dtype, shape, _ = unpack_header(bytes(data[4 : 4 + header_len]))
        offset = 4 + header_len
        expected = num_bytes(shape, dtype)
        if len(data) - offset != expected:
            raise KVTransferError(
                f"KV transfer holds {len(data) - offset} bytes; {str(dtype).removeprefix('torch.')}{list(shape)} "
                f"needs {expected}"
            )
        if expected == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(data, dtype=torch.uint8, offset=offset).view(dtype).reshape(shape)

    async def discard(self, location: str) -> None:
        self._path_of(location).unlink(missing_ok=True)

    def sweep(self, now: float | None = None) -> int:
        """Remove this deployment's transfers and worker markers older than ttl_s (left by workers
        that were killed; a live worker refreshes its marker every heartbeat interval from its
        start, while its model still loads); returns how many."""
        cutoff = (time.time() if now is None else now) - self.ttl_s
        removed = 0
        for path in [*self.directory.glob(f"{self.prefix}kv-*"), *self.directory.glob(f"{self.prefix}worker-*")]:
            try:
                if path.stat().st_mtime < cutoff:
                    path.unlink()
                    removed += 1
            except FileNotFoundError:  # its reader discarded it meanwhile
                continue
        return removed
