"""CoreLease: CPU workers on one host lend each other idle cores, and take them back within a
layer, without ever running more threads than cores; and the engine thread that uses it."""

from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from services.runtime.core_lease import SLOT, CoreLease, cpu_list_text
from services.runtime.engine_thread import ENGINE_GIL_SWITCH_INTERVAL_S, EngineThread
from services.runtime.step_threads import StepThreads
from shared.engine.sampling_params import SamplingParams
from shared.settings import WorkerServiceSettings
from tests.services.test_faults import until
from tests.services.test_kv_tcp_layers import until as until_awaited

CPUS = {0, 1}
PATIENT_S = 120.0  # a wait this long means the lease never let go: the test fails on the leftover thread


class EveryCore(StepThreads):
    """Steps on every core the lease gives, whatever they measure: for tests of what the lease gives."""

    def choose(self) -> int:
        return self.candidates[-1]


class Host:
    """Leases on one temporary ledger, each recording the thread counts it sets."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.set: dict[str, list[int]] = {}
        self.leases: list[CoreLease] = []

    def lease(self, name: str, max_threads: int = 2, wait_timeout_s: float = PATIENT_S) -> CoreLease:
        calls = self.set.setdefault(name, [])
        lease = CoreLease(str(self.directory), max_threads, cpus=CPUS, set_threads=calls.append,
                          wait_timeout_s=wait_timeout_s)  # fmt: skip
        self.leases.append(lease)
        return lease

    def slots(self) -> dict[str, tuple[int, int]]:
        ledger = self.directory / f"llmd-cores-{cpu_list_text(CPUS)}"
        return {p.name: SLOT.unpack(p.read_bytes()) for p in ledger.iterdir() if p.name != "guard"}


@pytest.fixture
def host(tmp_path: Path) -> Iterator[Host]:
    host = Host(tmp_path)
    yield host
    for lease in host.leases:
        lease.close()


def in_thread(fn: Callable[[], int]) -> tuple[threading.Thread, list[int]]:
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    thread.start()
    return thread, result


def engine_settings(model_path: str, lease_dir: Path, **targets: float) -> WorkerServiceSettings:
    """A leasing engine's settings, with the latency `targets` given (LatencyTargetSettings' fields)."""
    return WorkerServiceSettings.model_validate({
        "model": {"path": model_path, "dtype": "float32"}, "kv_cache": {"memory_bytes": 32 * 2**20},
        "worker": {"elastic_threads": True, "core_lease_dir": str(lease_dir)}, "targets": targets,
    })  # fmt: skip


def test_cpu_lists_name_ledgers_compactly() -> None:
    assert cpu_list_text({0, 1, 2, 3, 6}) == "0-3,6"
    assert cpu_list_text({5}) == "5"
    assert cpu_list_text({0, 2, 3}) == "0,2-3"


def test_a_lone_worker_runs_on_every_core_and_holds_none_once_idle(host: Host) -> None:
    decode = host.lease("decode")
    assert decode.before_step() == 2
    assert host.set["decode"] == [2]
    assert host.slots() == {decode.name: (2, 1)}
    decode.after_call(has_work=True)
    assert decode.before_step() == 2
    assert host.set["decode"] == [2]  # unchanged: torch is not told again
    decode.after_call(has_work=False)
    assert host.slots() == {decode.name: (0, 0)}


def test_a_neighbour_with_work_waits_until_the_borrower_steps_down_between_layers(host: Host) -> None:
    prefill, decode = host.lease("prefill"), host.lease("decode")
    assert prefill.before_step() == 2  # decode idle: prefill borrows its core

    waiter, taken = in_thread(decode.before_step)
    until(lambda: host.slots()[decode.name] == (0, 1), "decode to ask for its core")
    assert waiter.is_alive()  # prefill still runs both cores: decode must not start its step

    prefill.rebalance()
    waiter.join(PATIENT_S)
    assert taken == [1] and prefill.threads == 1
    assert host.set == {"prefill": [2, 1], "decode": [1]}

    prefill.after_call(has_work=True)
    assert prefill.before_step() == 1  # decode still has work: no growing back at the step boundary
    decode.after_call(has_work=False)
    assert prefill.before_step() == 2  # decode went idle: its core is lent again
    assert host.slots() == {prefill.name: (2, 1), decode.name: (0, 0)}


def test_a_worker_at_its_fair_share_keeps_it_between_layers(host: Host) -> None:
    prefill, decode = host.lease("prefill"), host.lease("decode")
    assert prefill.before_step() == 2
    prefill.rebalance()  # no one else has work
    assert prefill.threads == 2
    waiter, _ = in_thread(decode.before_step)
    until(lambda: host.slots()[decode.name][1] == 1, "decode to ask")
    prefill.rebalance()
    waiter.join(PATIENT_S)
    prefill.rebalance()
    assert (prefill.threads, decode.threads) == (1, 1)
    assert host.set["prefill"] == [2, 1]


def test_a_worker_grows_between_layers_into_cores_a_neighbour_lends(host: Host) -> None:
    prefill, decode = host.lease("prefill"), host.lease("decode")
    assert decode.before_step() == 2
    waiter, _ = in_thread(prefill.before_step)
    until(lambda: host.slots()[prefill.name][1] == 1, "prefill to ask")
    decode.rebalance()
    waiter.join(PATIENT_S)
    assert (prefill.threads, decode.threads) == (1, 1)

    prefill.rebalance()  # decode still holds its core: nothing to take
    assert prefill.threads == 1
    assert prefill.neighbour_has_work() and decode.neighbour_has_work()
    decode.lend()  # decode has work still, but lends its core until its next step
    assert host.slots()[decode.name] == (0, 0) and not prefill.neighbour_has_work()
    prefill.rebalance()  # mid-step: prefill takes the lent core at once
    assert prefill.threads == 2 and host.set["prefill"] == [1, 2]

    waiter, taken = in_thread(decode.before_step)  # decode's token is due: it asks for its core back
    until(lambda: host.slots()[decode.name] == (0, 1), "decode to ask again")
    assert waiter.is_alive()
    prefill.rebalance()
    waiter.join(PATIENT_S)
    assert taken == [1] and prefill.threads == 1
    assert host.set == {"prefill": [1, 2, 1], "decode": [2, 1]}


def test_a_step_takes_no_more_threads_than_its_cap(host: Host) -> None:
    prefill, decode = host.lease("prefill"), host.lease("decode")
    assert decode.before_step(cap=1) == 1  # alone, but its steps measured faster on one thread
    decode.rebalance()
    assert decode.threads == 1 and host.slots()[decode.name] == (1, 1)
    assert prefill.before_step() == 1  # the fair share, as beside any neighbour with work
    prefill.after_call(has_work=False)
    decode.rebalance()  # a core is free, but the cap holds until the next step
    assert decode.threads == 1
    decode.after_call(has_work=True)
    assert decode.before_step() == 2 and host.set["decode"] == [1, 2]


def test_more_workers_with_work_than_cores_run_one_thread_each_without_waiting(
    host: Host, caplog: pytest.LogCaptureFixture
) -> None:
    first, second, third = (host.lease(name) for name in ("first", "second", "third"))
    assert first.before_step() == 2
    waiter, taken = in_thread(second.before_step)
    until(lambda: host.slots()[second.name] == (0, 1), "the second to ask")
    first.rebalance()
    waiter.join(PATIENT_S)
    with caplog.at_level(logging.WARNING, logger="services.runtime.core_lease"):
        assert third.before_step() == 1  # no one runs beyond its share: nothing to wait for
    assert (first.threads, taken, third.threads) == (1, [1], 1)
    assert not caplog.records


def test_a_worker_killed_while_borrowing_frees_its_cores_at_once(host: Host) -> None:
    script = f"""
import sys, time
from services.runtime.core_lease import CoreLease
lease = CoreLease({str(host.directory)!r}, 2, cpus={CPUS!r}, set_threads=lambda n: None)
print(lease.name, lease.before_step(), flush=True)
time.sleep(600)
"""
    with subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) as child:
        try:
            assert child.stdout is not None
            name, threads = child.stdout.readline().split()
            assert threads == "2" and host.slots() == {name: (2, 1)}
        finally:
            child.send_signal(signal.SIGKILL)
    decode = host.lease("decode")
    assert decode.before_step() == 2  # no wait for the dead worker's layer boundary
    assert host.slots() == {decode.name: (2, 1)}  # and its file is gone


def test_a_neighbour_that_never_steps_down_is_waited_for_only_so_long(
    host: Host, caplog: pytest.LogCaptureFixture
) -> None:
    hung = host.lease("hung")
    assert hung.before_step() == 2
    decode = host.lease("decode", wait_timeout_s=0.05)
    with caplog.at_level(logging.WARNING, logger="services.runtime.core_lease"):
        assert decode.before_step() == 1
    assert "kept its borrowed cores past 0.05 s; stepping on 1 of 2 cores anyway" in caplog.text


def test_a_worker_that_leaves_stops_counting(host: Host) -> None:
    prefill, decode = host.lease("prefill"), host.lease("decode")
    assert prefill.before_step() == 2
    prefill.leave()
    assert decode.before_step() == 2
    assert host.slots() == {decode.name: (2, 1)}


@pytest.mark.slow
def test_a_worker_loads_on_its_share_of_the_workers_on_the_ledger_and_holds_nothing_after(host: Host) -> None:
    first = host.lease("first")
    with first.loading() as threads:  # alone: every core
        assert threads == 2 and host.slots() == {first.name: (2, 1)}
    assert host.slots() == {first.name: (0, 0)}
    second = host.lease("second")
    # an idle neighbour counts too: the workers of a host start, and load, together
    with second.loading() as threads:
        assert threads == 1 and host.set["second"] == [1]
        assert host.slots()[second.name] == (1, 1)  # held as work: a serving neighbour gives back its surplus
    assert host.slots()[second.name] == (0, 0)


def test_the_engine_thread_steps_on_its_lease_and_yields_to_a_neighbour(
    host: Host, model_path: str, two_torch_threads: None
) -> None:
    settings = engine_settings(model_path, host.directory)

    async def run() -> None:
        thread = EngineThread()
        neighbour = host.lease("neighbour")
        engine = await thread.load(settings)
        assert sys.getswitchinterval() == ENGINE_GIL_SWITCH_INTERVAL_S  # the loop hands the GIL back sooner
        assert await thread.call(torch.get_num_threads) == 1  # loaded on its share beside the neighbour
        assert thread.torch_threads == 2
        assert host.slots() and set(host.slots().values()) == {(0, 0)}  # loaded, idle: holds nothing
        assert neighbour.before_step() == 2  # borrows the idle engine's core

        await thread.call(engine.add_request, "r", [1, 2, 3, 4], SamplingParams(max_tokens=3, temperature=0))
        step = asyncio.ensure_future(thread.step())
        while not step.done():  # the neighbour's layer loop: it gives the core back once the engine asks
            neighbour.rebalance()
            await asyncio.sleep(0.001)
        await step
        (engine_slot,) = (slot for name, slot in host.slots().items() if name != neighbour.name)
        assert engine_slot == (1, 1) and neighbour.threads == 1 and thread.threads_now == 1
        assert await thread.call(torch.get_num_threads) == 1

        neighbour.after_call(has_work=False)
        while engine.has_unfinished:
            await thread.step()
        assert set(host.slots().values()) == {(0, 0)}  # finished: the engine's core is free again

        await thread.call(engine.add_request, "r2", [5, 6, 7], SamplingParams(max_tokens=8, temperature=0))
        assert thread.step_threads is not None
        thread.step_threads.observe(1, 1, 1.0)  # steps like the last one measured far faster on both cores
        await thread.step()
        assert (2, 1) in host.slots().values()  # the neighbour is idle: the engine runs on both cores
        await thread.call(engine.abort_request, "r2")
        assert set(host.slots().values()) == {(0, 0)}  # idle after an abort too, with no step to say so
        assert thread.threads_now == 0
        thread.shutdown()
        assert list(host.slots()) == [neighbour.name]

    asyncio.run(run())


@pytest.mark.slow
def test_a_paced_engine_lends_its_cores_between_steps_only_while_a_neighbour_has_work(
    host: Host, model_path: str, two_torch_threads: None
) -> None:
    # an inter-token target far beyond any step: every pause lasts until the neighbour is done
    settings = engine_settings(model_path, host.directory, itl_ms=60_000)

    async def run() -> None:
        thread = EngineThread()
        engine = await thread.load(settings)
        assert thread.pace(max_pause_s=0.0)
        neighbour = host.lease("neighbour")
        await thread.call(engine.add_request, "r", [1, 2, 3, 4], SamplingParams(max_tokens=8, temperature=0))
        await thread.step()
        await thread.step()
        assert thread.lent_s == 0  # no neighbour has work: no one to lend to
        assert thread.paced_steps == (0, 0)  # nor a step planned

        asker, taken = in_thread(neighbour.before_step)  # the neighbour gets a prompt
        until(lambda: host.slots()[neighbour.name] == (0, 1), "the neighbour to ask for its core")
        step = asyncio.ensure_future(thread.step())
        # the engine lends it both cores before its step, though it still has work
        await until_awaited(lambda: taken == [2])  # the step's pause runs on this event loop
        (engine_slot,) = (slot for name, slot in host.slots().items() if name != neighbour.name)
        assert engine_slot == (0, 0) and not step.done()

        neighbour.after_call(has_work=False)  # its prompt is done: the engine steps at once
        await step
        assert thread.lent_s > 0
        assert thread.paced_steps == (1, 0)  # planned, and its token well within the 60 s target
        lent_s = thread.lent_s
        while engine.has_unfinished:
            await thread.step()
        assert thread.lent_s == lent_s and thread.paced_steps == (1, 0)
        thread.shutdown()

    asyncio.run(run())


@pytest.mark.slow
def test_a_paced_step_is_due_at_its_time_however_long_lending_the_cores_took(
    host: Host, model_path: str, two_torch_threads: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = engine_settings(model_path, host.directory, itl_ms=1000)
    now = [0.0]

    def clock() -> float:  # moves on as it is read, so a wait on it ends
        now[0] += 0.0005
        return now[0]

    async def run() -> None:
        thread = EngineThread(clock=clock)
        engine = await thread.load(settings)
        assert thread.pace(max_pause_s=0.0)  # the next token is due 0.9 s after the last
        neighbour = host.lease("neighbour")
        await thread.call(engine.add_request, "r", [1, 2, 3, 4], SamplingParams(max_tokens=8, temperature=0))
        await thread.step()
        await thread.step()

        lease = thread._lease
        assert lease is not None
        lend = lease.lend

        def slow_lend() -> None:  # the lend itself ends after the token was due
            now[0] += 0.85
            lend()

        monkeypatch.setattr(lease, "lend", slow_lend)
        asker, taken = in_thread(neighbour.before_step)  # the neighbour gets a prompt
        until(lambda: host.slots()[neighbour.name] == (0, 1), "the neighbour to ask for its core")
        now[0] += 0.1
        step = asyncio.ensure_future(thread.step())
        while not step.done():  # the neighbour's layer loop: it gives the cores back once the engine asks
            neighbour.rebalance()
            await asyncio.sleep(0.001)
        await step
        asker.join()
        # the step went at once after the lend, 0.95 s after the last token, not a pause later
        assert thread.paced_steps == (1, 0) and thread.lent_s < 0.01
        thread.shutdown()

    asyncio.run(run())


@pytest.mark.slow
def test_a_paced_engine_pauses_its_streams_for_a_neighbours_prompt_only_where_they_can_take_a_late_gap(
    host: Host, model_path: str, two_torch_threads: None
) -> None:
    settings = engine_settings(model_path, host.directory, itl_ms=1000, itl_percentile=90)
    now = [0.0]

    async def run() -> None:
        thread = EngineThread(clock=lambda: now[0])
        engine = await thread.load(settings)
        thread.step_threads = EveryCore(2)
        # gaps of 0.95 s: on time for a 1 s target, and past the paced pause (due at 0.9 s)
        assert thread.pace(max_pause_s=60.0)
        thread.policy.pause_after_s = 0.0  # every prompt counts as long at once: no late gap is kept for one
        neighbour = host.lease("neighbour")
        await thread.call(engine.add_request, "r", [1, 2, 3, 4], SamplingParams(max_tokens=30, temperature=0))

        async def step_beside_a_prompt(prompt_s: float) -> list[int]:
            """One step, 0.95 s after the last, while the neighbour has a prompt that takes `prompt_s`
            from then; the threads the neighbour got."""
            asker, taken = in_thread(neighbour.before_step)
            until(lambda: host.slots()[neighbour.name] == (0, 1), "the neighbour to ask for its core")
            now[0] += 0.95
            step = asyncio.ensure_future(thread.step())
            await until_awaited(lambda: taken)
            now[0] += prompt_s
            neighbour.after_call(has_work=False)
            await step
            asker.join()
            return taken

        for _ in range(4):  # the first token's gap counts as late: 4 gaps cannot spare another
            now[0] += 0.95
            await thread.step()
        assert await step_beside_a_prompt(0.0) == [1]  # no pause: the step took its core back
        for _ in range(15):
            now[0] += 0.95
            await thread.step()
        # 20 gaps, 1 late: the stream can take a second late gap, so it waits for the prompt on no cores
        assert await step_beside_a_prompt(5.0) == [2] and thread.num_pauses == 1
        assert await step_beside_a_prompt(0.0) == [1]  # that gap is spent
        assert thread.num_pauses == 1
        while engine.has_unfinished:
            now[0] += 0.95
            await thread.step()

        # a stream whose length is sure plans on all of it: 95 gaps may have 9 late, so it pauses at once
        params = SamplingParams(max_tokens=96, temperature=0, ignore_eos=True)
        await thread.call(engine.add_request, "s", [1, 2, 3, 4], params)
        for _ in range(2):  # its prompt, then its first gap (counted late)
            now[0] += 0.95
            await thread.step()
        assert await step_beside_a_prompt(5.0) == [2] and thread.num_pauses == 2
        thread.shutdown()

    asyncio.run(run())


@pytest.mark.slow
def test_an_engine_thread_without_a_place_for_its_lease_runs_fixed_threads_and_says_how_to_fix_it(
    tmp_path: Path, model_path: str, caplog: pytest.LogCaptureFixture
) -> None:
    not_a_directory = tmp_path / "file"
    not_a_directory.write_text("")
    settings = engine_settings(model_path, not_a_directory)

    async def run() -> None:
        thread = EngineThread()
        engine = await thread.load(settings)
        assert thread.torch_threads is None  # no lease; the layer hook still serves call_between_layers
        assert thread.threads_now == await thread.call(torch.get_num_threads)
        await thread.call(engine.add_request, "r", [1, 2, 3], SamplingParams(max_tokens=2, temperature=0))
        while engine.has_unfinished:
            await thread.step()
        thread.shutdown()

    with caplog.at_level(logging.WARNING, logger="services.runtime.engine_thread"):
        asyncio.run(run())
    assert f"elastic threads off: no core lease in {not_a_directory}" in caplog.text
    assert "LLMD_WORKER__CORE_LEASE_DIR" in caplog.text
