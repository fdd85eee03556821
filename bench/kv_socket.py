"""The socket KV transport alone, on loopback: how fast one transfer moves from a pool's blocks
into another pool's blocks, without a stack around it.

    python -m bench.kv_socket [--mib 64,256,1024 --repeats 3]

Both ends are real pools of SmolLM2-135M's float32 layout (a block of one layer's K or V is
16 x 3 x 64 x 4 = 12 KiB, so a transfer is that many scattered pieces on each side), the
destination blocks every other one of its pool. One process, the two ends on their helper
threads as in the workers (services/kv_transfer/tcp.py). Prints GB/s per size (best of the
repeats: the first transfer also faults the destination pages in).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import torch

from bench.stack_harness import format_table
from services.kv_transfer.base import tensor_bytes
from services.kv_transfer.tcp import TcpReceiver, TcpSender, TransferHeader

SEGMENT_BYTES = 16 * 3 * 64 * 4


def pieces(pool: torch.Tensor, count: int, stride: int) -> list[memoryview]:
    whole = tensor_bytes(pool)
    return [whole[i * stride * SEGMENT_BYTES : (i * stride + 1) * SEGMENT_BYTES] for i in range(count)]


async def transfer_seconds(mib: int, repeats: int) -> list[float]:
    count = mib * 2**20 // SEGMENT_BYTES
    source = torch.randint(0, 256, (count * SEGMENT_BYTES,), dtype=torch.uint8)
    target = torch.zeros(2 * count * SEGMENT_BYTES, dtype=torch.uint8)
    sent, into = pieces(source, count, 1), pieces(target, count, 2)

    async def is_peer(host: str) -> bool:
        return True

    async def claim(header: TransferHeader, host: str) -> list[memoryview]:
        return into

    async def settle(header: TransferHeader, error: str | None) -> None:
        if error is not None:
            raise RuntimeError(error)

    receiver = TcpReceiver("127.0.0.1", 0, 60.0, is_peer, claim, settle)
    await receiver.start()
    header = TransferHeader("token", "bench", 0, "prefill", count, count * SEGMENT_BYTES)
    seconds = []
    try:
        for _ in range(repeats):
            start = time.perf_counter()
            await asyncio.to_thread(TcpSender().send, "127.0.0.1", receiver.port, header, sent, 60.0)
            seconds.append(time.perf_counter() - start)
    finally:
        await receiver.close()
    if not torch.equal(target.view(count, 2, SEGMENT_BYTES)[:, 0], source.view(count, SEGMENT_BYTES)):
        raise RuntimeError("the bytes that landed differ from those sent")
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.kv_socket", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", default="64,256,1024", help="transfer sizes in MiB")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    rows = []
    for mib in [int(m) for m in args.mib.split(",")]:
        best = min(asyncio.run(transfer_seconds(mib, args.repeats)))
        rows.append([str(mib), f"{best * 1000:.0f}", f"{mib * 2**20 / best / 1e9:.2f}"])
    print(format_table(["MiB", "ms (best)", "GB/s"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
