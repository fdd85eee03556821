"""Where a prefill worker hands a request over (services/prefill/placement.py): the decode worker
it picks from their heartbeats, and the accept it matches to the handoff that asked."""

from __future__ import annotations

import time

from services.prefill.placement import AcceptBoard, DecodePicker
from shared.protocol import HandoffAccept, WorkerStatus


class FakeBus:
    def __init__(self, statuses: list[WorkerStatus]) -> None:
        self.statuses = statuses

    async def live_workers(self, role: str) -> list[WorkerStatus]:
        assert role == "decode"
        return self.statuses


def decode_status(worker_id: str, free_blocks: int, num_running: int, draining: bool = False) -> WorkerStatus:
    return WorkerStatus(worker_id, "decode", f"inbox:{worker_id}", free_blocks, 100, num_running, 0,
                        timestamp=time.time() - 1, draining=draining)


async def test_decode_picker_prefers_free_blocks_then_fewer_running_and_counts_its_own_placements() -> None:
    picker = DecodePicker(FakeBus([  # type: ignore[arg-type]
        decode_status("d-a", free_blocks=50, num_running=1),
        decode_status("d-b", free_blocks=60, num_running=3),
        decode_status("d-c", free_blocks=60, num_running=2),
        decode_status("d-draining", free_blocks=100, num_running=0, draining=True),
    ]))
    assert [s.worker_id for s in await picker.candidates(num_blocks=4)] == ["d-c", "d-b", "d-a"]
    assert await picker.candidates(num_blocks=101) == []

    picker.record("d-c", 20)  # not in d-c's heartbeat yet: 40 free, 3 running as far as we know

    assert [s.worker_id for s in await picker.candidates(num_blocks=4)] == ["d-b", "d-a", "d-c"]


async def test_accept_board_hands_an_answer_only_to_the_handoff_that_asked_that_worker() -> None:
    board = AcceptBoard()
    future = board.expect("r", 1, "d-a")

    assert not board.resolve(HandoffAccept("r", 1, "d-b", [0]))  # a worker we no longer wait for
    assert not board.resolve(HandoffAccept("r", 0, "d-a", [0]))  # an older attempt
    assert board.resolve(HandoffAccept("r", 1, "d-a", [0, 1]))
    assert (await future).needed_blocks == [0, 1]
    board.forget("r", 1)
    assert not board.resolve(HandoffAccept("r", 1, "d-a", [0, 1]))
