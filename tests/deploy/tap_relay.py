"""One host's link to the bridge through user space, with a one-way delay that can be changed while
it runs: the kernels these tests run on may lack netem (CONFIG_NET_SCH_NETEM unset, so `tc qdisc
add dev eth0 root netem delay 50ms` answers "Specified qdisc kind is unknown"). Two TAP devices,
one for the host's side and one for the bridge's; frames the host sends wait the delay before they
reach the bridge, as netem on the host's eth0 would hold them; frames towards the host pass at once.

    python -m tests.deploy.tap_relay HOST_TAP BRIDGE_TAP

prints "ready" once both devices exist (the caller then moves them into their namespaces: a TAP
keeps its file descriptor across the move), then reads a delay in milliseconds per stdin line.
"""

from __future__ import annotations

import collections
import fcntl
import os
import selectors
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000  # frames without the 4-byte packet-info prefix
MAX_FRAME = 65536


def open_tap(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    return fd


def frames(fd: int) -> list[bytes]:
    """Every frame waiting on a non-blocking TAP."""
    out: list[bytes] = []
    while True:
        try:
            out.append(os.read(fd, MAX_FRAME))
        except BlockingIOError:
            return out


def send(fd: int, frame: bytes) -> None:
    try:
        os.write(fd, frame)
    except OSError:  # the device is down or its queue is full: dropped, as a wire would lose it
        pass


def relay(host_fd: int, bridge_fd: int) -> None:
    delay_s = 0.0
    held: collections.deque[tuple[float, bytes]] = collections.deque()  # the host's frames, due in order
    selector = selectors.DefaultSelector()
    selector.register(host_fd, selectors.EVENT_READ)
    selector.register(bridge_fd, selectors.EVENT_READ)
    selector.register(sys.stdin, selectors.EVENT_READ)
    while True:
        timeout = max(0.0, held[0][0] - time.monotonic()) if held else None
        for key, _ in selector.select(timeout):
            if key.fileobj is sys.stdin:
                line = sys.stdin.readline()
                if not line:
                    return  # the test is gone
                delay_s = float(line) / 1000
            elif key.fileobj == host_fd:
                due = time.monotonic() + delay_s
                held.extend((due, frame) for frame in frames(host_fd))
            else:
                for frame in frames(bridge_fd):
                    send(host_fd, frame)
        now = time.monotonic()
        while held and held[0][0] <= now:
            send(bridge_fd, held.popleft()[1])


def main() -> None:
    host_tap, bridge_tap = sys.argv[1:3]
    host_fd, bridge_fd = open_tap(host_tap), open_tap(bridge_tap)
    print("ready", flush=True)
    relay(host_fd, bridge_fd)


if __name__ == "__main__":
    main()
