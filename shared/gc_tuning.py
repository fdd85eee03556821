"""A service's heap from its start-up, kept out of Python's garbage collections.

Start-up leaves a large heap of objects that live as long as the process: the tokenizer's
vocabulary, torch's and pydantic's modules, the model's configuration. Each full collection walks
all of it while the event loop waits: in the gateway on a 2-core Zen 4, one took 189 ms in the
middle of a burst of requests, and every stream stalled that long. So once a service has started,
what is alive is moved to the permanent generation (`gc.freeze`), and later collections walk only
what serving allocated.
"""

from __future__ import annotations

import atexit
import gc


def freeze_startup_heap() -> None:
    """Collect what start-up left as garbage, then keep every object alive now out of later
    collections, until the process exits: the interpreter's last collections then free them as
    usual (nanobind's modules, Triton's among them, report every object still alive at exit as a leak)."""
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)
