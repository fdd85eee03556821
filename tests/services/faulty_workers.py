"""Real workers that SIGKILL their own process at one exact point of a KV handoff, for
tests/services/test_fault_handoff.py. Configured from LLMD_* variables like any worker:

    python -m tests.services.faulty_workers prefill-dies-after-accept
    python -m tests.services.faulty_workers decode-dies-on-kv-ready

prefill-dies-after-accept: a decode worker accepted its offer and holds a reservation; the KV
never comes. decode-dies-on-kv-ready: it accepted an offer and the KV is ready, but it dies before
importing it (the prefill worker has named it as the holder). Its KV pool is twice the configured
LLMD_KV_CACHE__MEMORY_BYTES, so a prefill worker, which offers to the most free blocks first,
picks it over a normal decode worker.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import NoReturn

from services.decode.worker import DecodeWorker
from services.prefill.tracked import Tracked
from services.prefill.worker import PrefillWorker
from services.worker_base import main
from shared.protocol import KVReady
from shared.settings import WorkerServiceSettings


def die() -> NoReturn:
    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("unreachable: SIGKILL cannot be caught")


class PrefillDiesAfterAccept(PrefillWorker):
    async def _transfer(self, t: Tracked, decode_id: str, needed: list[int]) -> None:
        die()


class DecodeDiesOnKVReady(DecodeWorker):
    def __init__(self, settings: WorkerServiceSettings) -> None:
        kv = settings.kv_cache
        if kv.memory_bytes is None:
            raise SystemExit("decode-dies-on-kv-ready needs LLMD_KV_CACHE__MEMORY_BYTES (it takes twice that)")
        kv.memory_bytes *= 2
        super().__init__(settings)

    async def _on_kv_ready(self, msg: KVReady) -> None:
        die()


FAULTS = {"prefill-dies-after-accept": PrefillDiesAfterAccept, "decode-dies-on-kv-ready": DecodeDiesOnKVReady}

if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in FAULTS:
        raise SystemExit(f"usage: python -m tests.services.faulty_workers {{{','.join(FAULTS)}}}")
    main(FAULTS[sys.argv[1]])
