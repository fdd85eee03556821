"""The project's on-disk cache: `${XDG_CACHE_HOME:-~/.cache}/llmd/<kind>/`.

What goes there is derived from inputs named in the entry's key (a compiled kernel, a
converted model), so it can be deleted at any time and is rebuilt on next use. Entries are
written beside their final name and renamed into place, so processes starting together never
read a half-written one; and one process builds a missing entry while the others that need it
wait for it (`one_builder`), since building (a model's conversion, ~15 s) is the slow part of a
first start and each builder would only slow the others down.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


def cache_dir(kind: str) -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "llmd" / kind


def file_key(path: Path, *parts: str) -> str:
    """A key of the file's bytes and `parts`: it changes when the file's content or any part does, and
    a copy of the same file elsewhere (a new virtual environment, another clone) finds the same entries."""
    digest = hashlib.sha256()
    for part in (content_digest(path), *parts):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def content_digest(path: Path) -> str:
    """sha256 of the file's bytes, read once per path, size and modification time (about 0.1 s per
    100 MB) and remembered under `digests/` in the cache, so later starts only stat the file."""
    stat = path.stat()
    seen = hashlib.sha256(f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:32]
    memo = cache_dir("digests") / seen
    with contextlib.suppress(FileNotFoundError):
        return memo.read_text()
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    content = digest.hexdigest()
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        scratch = memo.with_name(f".{memo.name}.{os.getpid()}")
        scratch.write_text(content)
        scratch.replace(memo)
    except OSError as exc:
        logger.info("could not remember the digest of %s in %s (%s); the next start reads the file again",
                    path, memo.parent, exc)  # fmt: skip
    return content


def derived_folder(kind: str, source: Path, entry: str) -> Path:
    """Where `entry` (a name that carries its format's version) derived from the file `source` lives."""
    return cache_dir(kind) / f"{source.stem}-{file_key(source)}" / entry


def build_folder(target: Path, fill: Callable[[Path], None]) -> Path:
    """`target`, filled by `fill(folder)` in a temporary folder and renamed into place, unless present.

    When another process renames its copy in first, ours is discarded: both hold the same thing.
    """
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        fill(scratch)
        try:
            scratch.rename(target)
        except OSError:
            if not target.is_dir():
                raise
    finally:
        if scratch.exists():
            shutil.rmtree(scratch, ignore_errors=True)
    return target


@contextlib.contextmanager
def one_builder(target: Path, what: str) -> Iterator[None]:
    """Held by one process of this host at a time for `target`: an flock on a file in the temporary
    folder, which the kernel releases if its holder dies. A process that has to wait says so with
    `what` ("converting ..."). Where no lock file can be made it holds nothing: two builders then
    only cost time."""
    digest = hashlib.sha256(str(target.absolute()).encode()).hexdigest()[:16]
    lock_path = Path(tempfile.gettempdir()) / f"llmd-build-{digest}.lock"
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting while another process is %s", what)
            fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            lock_path.unlink(missing_ok=True)  # a failed build too; a killed one leaves an unheld file, reused
    finally:
        os.close(fd)


def load_or_build(
    folder: Path,
    read: Callable[[Path], T],
    build: Callable[[], T],
    write: Callable[[T, Path], None],
    read_errors: tuple[type[Exception], ...] = (OSError, ValueError),
    keep: Callable[[T], bool] = lambda _: True,
    what: str = "",
) -> T:
    """`read(folder)` where the entry exists; else `build()`, written with `write(value, folder)`
    when `keep(value)`. One process builds a missing entry; the others wait for it, then read it.
    An unreadable entry is logged, removed and rebuilt; a failed write is logged and the built
    value still returned: the cache only ever saves time. `what` says what building is, for the log."""
    what = what or f"building {folder}"
    with contextlib.ExitStack() as held:
        if not folder.is_dir():
            held.enter_context(one_builder(folder, what))
        if folder.is_dir():
            try:
                return read(folder)
            except read_errors as exc:
                logger.warning("cache entry %s is unreadable (%s); rebuilding it", folder, exc)
                shutil.rmtree(folder, ignore_errors=True)
        logger.info("%s, once: it is not in the disk cache yet (later starts read it from there)", what)
        started = time.monotonic()
        value = build()
        if keep(value):
            try:
                build_folder(folder, lambda scratch: write(value, scratch))
                logger.info("%s took %.1f s; cached in %s", what, time.monotonic() - started, folder)
            except OSError as exc:
                logger.warning("could not write cache entry %s (%s); the next start builds it again", folder, exc)
        return value
