"""bench/kv_socket.py: one small real transfer through the socket transport, checked byte for byte."""

from __future__ import annotations

import pytest

from bench import kv_socket


def test_prints_the_rate_of_each_size(capsys: pytest.CaptureFixture[str]) -> None:
    assert kv_socket.main(["--mib", "1,2", "--repeats", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split("|")[1:4] == [" MiB ", " ms (best) ", " GB/s "]
    assert [line.split("|")[1].strip() for line in lines[2:]] == ["1", "2"]
