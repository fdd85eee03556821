"""The project's on-disk cache: `${XDG_CACHE_HOME:-~/.cache}/llmd/<kind>/`.

What goes there is derived from inputs named in the entry's key (a compiled kernel, a
converted model), so it can be deleted at any time and is rebuilt on next use. Entries are
written beside their final name and renamed into place, so processes starting together never
read a half-written one.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


def cache_dir(kind: str) -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "llmd" / kind


def file_key(path: Path, *parts: str) -> str:
    """A key that changes when the file is replaced or edited, or when any of `parts` does."""
    stat = path.stat()
    digest = hashlib.sha256()
    for part in (str(path.resolve()), str(stat.st_size), str(stat.st_mtime_ns), *parts):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


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


def load_or_build(
    folder: Path,
    read: Callable[[Path], T],
    build: Callable[[], T],
    write: Callable[[T, Path], None],
    read_errors: tuple[type[Exception], ...] = (OSError, ValueError),
    keep: Callable[[T], bool] = lambda _: True,
) -> T:
    """`read(folder)` where the entry exists; else `build()`, written with `write(value, folder)`
    when `keep(value)`. An unreadable entry is logged, removed and rebuilt; a failed write is
    logged and the built value still returned: the cache only ever saves time."""
    if folder.is_dir():
        try:
            return read(folder)
        except read_errors as exc:
            logger.warning("cache entry %s is unreadable (%s); rebuilding it", folder, exc)
            shutil.rmtree(folder, ignore_errors=True)
    value = build()
    if keep(value):
        try:
            build_folder(folder, lambda scratch: write(value, scratch))
            logger.info("cached %s", folder)
        except OSError as exc:
            logger.warning("could not write cache entry %s (%s); the next start builds it again", folder, exc)
    return value
