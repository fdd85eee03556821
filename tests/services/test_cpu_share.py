"""ElasticThreads: a CPU worker runs on the cores other processes leave free."""

from __future__ import annotations

from pathlib import Path

import torch

from services.cpu_share import USER_HZ, ElasticThreads, busy_seconds


class FakeCpus:
    """Two CPUs whose busy time this process and the others add to as the test says."""

    def __init__(self) -> None:
        self.now = self.busy = self.own = 0.0

    def run(self, seconds: float, own_cores: float, other_cores: float) -> None:
        self.now += seconds
        self.own += own_cores * seconds
        self.busy += (own_cores + other_cores) * seconds

    def elastic(self, max_threads: int = 2) -> ElasticThreads:
        return ElasticThreads(max_threads, cpus={0, 1}, interval_s=0.5, clock=lambda: self.now,
                              read_busy=lambda cpus: self.busy, read_own=lambda: self.own)  # fmt: skip


def test_a_core_goes_to_a_busy_neighbour_and_comes_back_when_it_is_quiet(two_torch_threads: None) -> None:
    cpus = FakeCpus()
    threads = cpus.elastic()
    assert threads.threads == 2

    cpus.run(0.3, own_cores=2.0, other_cores=0.0)
    assert threads.adjust() is None  # within the first interval: nothing measured yet
    cpus.run(0.3, own_cores=1.3, other_cores=0.7)  # a prefill worker took part of a core
    assert threads.adjust() == 1
    assert torch.get_num_threads() == 1

    cpus.run(1.0, own_cores=1.0, other_cores=1.0)
    assert threads.adjust() is None
    assert threads.threads == 1

    cpus.run(1.0, own_cores=1.0, other_cores=0.1)  # the gateway and Redis alone
    assert threads.adjust() == 2
    assert torch.get_num_threads() == 2


def test_at_least_one_thread_and_never_more_than_its_cpus(two_torch_threads: None) -> None:
    cpus = FakeCpus()
    assert cpus.elastic(max_threads=8).max_threads == 2
    threads = cpus.elastic()
    cpus.run(1.0, own_cores=0.5, other_cores=3.0)
    assert threads.adjust() == 1
    cpus.run(1.0, own_cores=0.5, other_cores=3.0)
    assert threads.adjust() is None


def test_busy_seconds_counts_the_given_cpus_without_idle_iowait_or_steal(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    stat.write_text(
        "cpu  999 999 999 999 999 999 999 999 0 0\n"
        "cpu0 10 1 2 1000 50 3 4 70 0 0\n"
        "cpu1 20 0 5 2000 60 0 1 80 0 0\n"
        "cpu2 400 0 0 10 0 0 0 0 0 0\n"
        "intr 12345 1 2 3\n"
        "ctxt 999\n"
    )
    assert busy_seconds({0, 1}, str(stat)) == (10 + 1 + 2 + 3 + 4 + 20 + 5 + 1) / USER_HZ
    assert busy_seconds({2}, str(stat)) == 400 / USER_HZ
