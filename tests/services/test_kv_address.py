"""The KV address a worker advertises when its data port listens on every address (0.0.0.0)."""

from __future__ import annotations

import socket

import pytest

from services.kv_transfer.select import advertised_host
from shared.settings import WorkerSettings

ANYWHERE = WorkerSettings(kv_tcp_host="0.0.0.0")


def resolving_the_host_name_to(monkeypatch: pytest.MonkeyPatch, address: str) -> None:
    name, resolve = socket.gethostname(), socket.gethostbyname
    monkeypatch.setattr(socket, "gethostbyname", lambda host: address if host == name else resolve(host))


def test_the_host_name_s_address_when_it_is_not_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    resolving_the_host_name_to(monkeypatch, "10.1.2.3")
    assert advertised_host(ANYWHERE, "127.0.0.1") == "10.1.2.3"


def test_a_name_that_resolves_to_loopback_gives_the_address_redis_is_reached_from(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As /etc/hosts has it on Debian (127.0.1.1): other hosts could not reach that. Redis here is on
    loopback, so the route to it leaves from 127.0.0.1, not the name's 127.0.1.1 (across hosts, from
    the host's network address: tests/deploy/test_netns_hosts.py)."""
    resolving_the_host_name_to(monkeypatch, "127.0.1.1")
    assert advertised_host(ANYWHERE, "127.0.0.1") == "127.0.0.1"


def test_an_advertised_or_listening_address_is_kept() -> None:
    assert advertised_host(WorkerSettings(kv_tcp_host="0.0.0.0", kv_tcp_advertise="127.0.0.5")) == "127.0.0.5"
    assert advertised_host(WorkerSettings(kv_tcp_host="127.0.0.6")) == "127.0.0.6"
