"""A service's start-up heap leaves Python's garbage collections (shared/gc_tuning.py); its
garbage is collected first, not kept forever."""

from __future__ import annotations

import gc
import weakref

from shared.gc_tuning import freeze_startup_heap


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def test_garbage_is_collected_first_and_what_lives_is_frozen() -> None:
    kept = Node()
    garbage = Node()
    garbage.other = Node()
    garbage.other.other = garbage  # a cycle only a collection frees
    gone = weakref.ref(garbage)
    del garbage
    try:
        freeze_startup_heap()
        assert gone() is None
        assert gc.get_freeze_count() > 0
        assert all(obj is not kept for obj in gc.get_objects())  # frozen: in no generation a collection walks
    finally:
        gc.unfreeze()
